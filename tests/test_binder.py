"""What CI can check of the Binder environment (binder/) without reaching mybinder.org or the PyTorch wheel index.

Checked here:
- binder/requirements.txt takes torch from the PyTorch CPU wheel index, pinned to a "+cpu" build (a version that
  exists only there, so pip cannot fall back to PyPI's CUDA build), and that version is inside pyproject.toml's
  range; every other dependency of parlab (pyproject.toml) is pinned there, inside its pyproject range;
- binder/runtime.txt asks for a Python that pyproject.toml accepts;
- every module imported by the lessons (notebooks/, labs/) and by parlab itself is the standard library, parlab, or
  provided by a package that the binder requirements install (directly or as a dependency, as resolved here);
- the install steps themselves, in a fresh virtual environment without this one's packages: the binder
  requirements (torch: this environment's CPU build of the same version, linked in, since CI cannot reach the
  PyTorch index), then binder/postBuild unchanged, run from a copy of the repository as Binder runs it; then every
  module above imports there, the widgets and plotly JupyterLab extensions are installed, and 2 ranks run an
  all-reduce.

Not checked (needs Binder itself): that repo2docker builds the image, that its base image honours runtime.txt,
that the PyTorch CPU index serves this exact version for that Python, and that the lessons fit in a Binder
machine's memory (benchmarks/bench_memory.py measures that here) and run in its browser (tests/test_browser.py
runs lesson 00 in Chromium with the development environment, not the binder one).
"""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
BINDER = ROOT / "binder"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def binder_requirements() -> tuple[list[str], dict[str, Requirement]]:
    """(pip option lines, {canonical name: Requirement}) of binder/requirements.txt."""
    options, requirements = [], {}
    for line in (BINDER / "requirements.txt").read_text().splitlines():
        line = line.split(" #")[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-"):
            options.append(line)
            continue
        requirement = Requirement(line)
        requirements[canonicalize_name(requirement.name)] = requirement
    return options, requirements


def pyproject_requirements() -> dict[str, Requirement]:
    return {canonicalize_name(r.name): r for r in map(Requirement, PYPROJECT["project"]["dependencies"])}


def pinned_version(requirement: Requirement) -> Version:
    pins = [s for s in requirement.specifier if s.operator == "=="]
    assert len(pins) == 1 and len(requirement.specifier) == 1, f"binder should pin {requirement} with =="
    return Version(pins[0].version)


# ------------------------------------------------------------------------------------------- the static checks


def test_torch_is_the_cpu_build_from_the_cpu_index_within_the_pyproject_range():
    options, requirements = binder_requirements()
    assert f"--extra-index-url {CPU_INDEX}" in options, f"binder/requirements.txt must add the index {CPU_INDEX}"
    assert not any(o.startswith(("--index-url", "-i ")) for o in options), "PyPI must stay the main index"
    torch = pinned_version(requirements["torch"])
    assert torch.local == "cpu", f"pin the CPU build (torch=={torch.public}+cpu), got torch=={torch}"
    allowed = pyproject_requirements()["torch"].specifier
    assert allowed.contains(torch.public), f"binder torch {torch.public} is outside pyproject's torch{allowed}"


def test_every_parlab_dependency_is_pinned_inside_its_pyproject_range():
    _, binder = binder_requirements()
    for name, wanted in pyproject_requirements().items():
        assert name in binder, f"{name} (a parlab dependency in pyproject.toml) is missing from binder/requirements"
        version = pinned_version(binder[name])
        assert wanted.specifier.contains(version.public), f"binder pins {name}=={version}, pyproject wants {wanted}"


def test_runtime_python_is_one_pyproject_accepts():
    text = (BINDER / "runtime.txt").read_text().strip()
    match = re.fullmatch(r"python-(3\.\d+)", text)
    assert match, f"binder/runtime.txt should read python-3.X, got {text!r}"
    requires = PYPROJECT["project"]["requires-python"]
    from packaging.specifiers import SpecifierSet

    assert SpecifierSet(requires).contains(match.group(1)), f"runtime {text} vs requires-python {requires}"


def test_postbuild_installs_parlab_from_the_repository_root_without_dependencies():
    script = (BINDER / "postBuild").read_text()
    assert os.access(BINDER / "postBuild", os.X_OK), "binder/postBuild must be executable"
    install = [line for line in script.splitlines() if "pip install" in line and not line.lstrip().startswith("#")]
    assert install and all("--no-deps" in line for line in install), f"postBuild installs: {install}"
    assert any(re.search(r"(-e|install)\s+\.(\s|$)", line) for line in install), "postBuild must install '.'"


def lesson_and_package_imports() -> dict[str, set[str]]:
    """{top-level module: files importing it} over notebooks/, labs/ (code cells) and parlab/ (sources)."""
    sources: list[tuple[str, str]] = []
    for path in sorted([*ROOT.glob("notebooks/*.ipynb"), *ROOT.glob("labs/**/*.ipynb")]):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "code":
                code = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
                # IPython magics and shell escapes are not Python.
                code = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in code.splitlines())
                sources.append((str(path.relative_to(ROOT)), code))
    for path in sorted([*ROOT.glob("parlab/**/*.py"), *ROOT.glob("labs/**/*.py")]):
        sources.append((str(path.relative_to(ROOT)), path.read_text()))
    found: dict[str, set[str]] = {}
    for name, code in sources:
        for node in ast.walk(ast.parse(code, filename=name)):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                found.setdefault(module.split(".")[0], set()).add(name)
    return found


def third_party(modules: dict[str, set[str]]) -> dict[str, set[str]]:
    local = {"parlab", "solutions"} | {p.stem for p in ROOT.glob("labs/**/*.py")}
    return {m: f for m, f in modules.items() if m not in sys.stdlib_module_names and m not in local}


def installed_closure(names: list[str]) -> set[str]:
    """The named distributions and everything they require (markers evaluated here, no extras), as installed."""
    environment = {**default_environment(), "extra": ""}
    seen: set[str] = set()
    todo = [canonicalize_name(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate(environment):
                todo.append(canonicalize_name(requirement.name))
    return seen


def test_every_import_of_the_lessons_and_of_parlab_comes_with_the_binder_requirements():
    modules = third_party(lesson_and_package_imports())
    assert "torch" in modules and "plotly" in modules, f"the import scan found too little: {sorted(modules)}"
    _, binder = binder_requirements()
    closure = installed_closure(list(binder))
    providers = metadata.packages_distributions()
    missing = {}
    for module, files in sorted(modules.items()):
        dists = {canonicalize_name(d) for d in providers.get(module, [])}
        if not dists & closure:
            missing[module] = (sorted(dists) or ["(not installed here)"], sorted(files))
    assert not missing, f"imported but not installed by binder/requirements.txt: {missing}"


# ------------------------------------------------------------------------------------ the install, for real


def _run(command: list[str], cwd: Path, env: dict, timeout: float) -> str:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (
        f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done.stdout


@pytest.mark.slow
def test_binder_install_steps_in_a_fresh_environment(tmp_path):
    """requirements.txt (torch from this machine's CPU wheel), then postBuild, in a venv with nothing else."""
    options, requirements = binder_requirements()
    torch_version = pinned_version(requirements["torch"]).public
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)  # no system site-packages
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"  # postBuild's "python" is the fresh venv's
    env["PIP_NO_COMPILE"] = "1"  # skip byte-compiling torch: half the install time, nothing to do with Binder

    # Step 1, as Binder runs it (one pip command), except torch: the PyTorch index is out of CI's reach, so this
    # environment's torch (the same version's CPU build) stands in for it, linked in rather than installed again
    # (unpacking its wheel cost ~13 s of CPU): a .pth file puts a folder of links to its packages and its
    # dist-info on the fresh venv's path, pip finds torch==VERSION there already and installs the rest, torch's
    # own dependencies included.
    linked = tmp_path / "torch-of-this-environment"
    linked.mkdir()
    installed = metadata.distribution("torch")
    site_packages = Path(installed.locate_file(""))
    for name in [*installed.read_text("top_level.txt").split(), f"torch-{installed.version}.dist-info"]:
        os.symlink(site_packages / name, linked / name)
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    Path(site, "torch-of-this-environment.pth").write_text(f"{linked}\n")
    rest = tmp_path / "requirements-without-torch.txt"
    rest.write_text("\n".join(str(r) for name, r in requirements.items() if name != "torch") + "\n")
    _run([str(python), "-m", "pip", "install", "-q", f"torch=={torch_version}", "-r", str(rest)], tmp_path, env, 900)

    # Step 2: postBuild, unchanged, from a copy of the repository (Binder runs it from the repository root).
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "parlab", repo / "parlab", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, repo / name)
    shutil.copytree(BINDER, repo / "binder")
    shutil.copytree(ROOT / "jupyter_config", repo / "jupyter_config")  # the quiet first open (postBuild merges it)
    out = _run([str(repo / "binder" / "postBuild")], repo, env, 300)
    assert "widgets and plotly extensions installed" in out, out

    # Then: every third-party module the lessons and parlab import, imports; torch is the CPU build; ranks run.
    modules = sorted(third_party(lesson_and_package_imports()))
    probe = f"""
import importlib, sys
for name in {modules!r}:
    importlib.import_module(name)
import torch, torch.distributed as dist, parlab
assert not torch.version.cuda, torch.version.cuda
assert parlab.__file__.startswith({str(repo)!r}), parlab.__file__
assert sys.prefix == {str(venv)!r}, sys.prefix

def total():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()

print("imports ok;", "all-reduce on 2 ranks:", parlab.launch(total, 2, echo=False))
"""
    out = _run([str(python), "-c", probe], tmp_path, env, 120)
    assert "all-reduce on 2 ranks: [3.0, 3.0]" in out, out
