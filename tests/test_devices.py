"""Every tensor a rank hands to a collective is on `parlab.device()`: checks that run without a GPU.

The first GPU run (one H200, NCCL) found six schemes making tensors on the CPU in rank code and handing them to
NCCL ("No backend type associated with device type cpu"). On a CPU-only machine gloo takes them, so nothing else
in CI would notice. Two guards:

1. From the source (ast): in the modules rank code runs in, every tensor factory (`torch.zeros`, `torch.randn`,
   `torch.tensor`, ...) and every parlab builder of models and batches (`build_model`, `make_batches`, ...) is given
   `device=`, or its line says why it belongs on the host: `# host: <why>` (a seeded draw moved afterwards, a
   figure's numbers, the parent's single-device reference). `*_like` and `x.new_*` follow their argument: fine.
2. At run time: parlab.core.comm's traced calls refuse a tensor that is not on its group's device, and name the
   scheme's line that handed it over (NCCL simulated on gloo by pretending the group's backend is "nccl").
"""

from __future__ import annotations

import ast
import inspect
import io
import re
import tokenize
from pathlib import Path

import pytest
import torch

import parlab
from parlab.core import comm

ROOT = Path(__file__).resolve().parents[1]

# Whole modules whose code runs in ranks (each may hold some parent-side code too: its factories say "# host:").
SCANNED_FOLDERS = ("parlab/schemes", "parlab/runs", "parlab/twins", "parlab/core")
# Lesson modules hold mostly figures drawn in the notebook: only their rank code is scanned, i.e. the functions
# they hand to `launch(...)` or name as rank code (`*_rank_fn`, `*_rank`: a notebook launches those itself), and the
# module's functions those call (see `rank_functions`).
LESSON_FOLDER = "parlab/lessons"
# The labs' checks modules hold rank code (handed to parlab.launch) beside what runs in the grader or the notebook
# (the single-device references, the verdicts): like the lessons, only their rank functions are read.
LAB_FOLDER = "parlab/grading/labs"

# torch's functions that make a tensor from nothing: on the CPU unless told otherwise.
FACTORIES = frozenset(
    {
        "arange",
        "as_tensor",
        "empty",
        "empty_strided",
        "eye",
        "full",
        "linspace",
        "logspace",
        "ones",
        "rand",
        "randint",
        "randn",
        "randperm",
        "range",
        "tensor",
        "zeros",
    }
)
# parlab's builders of models and data: on the host unless given device= (parlab/core/models.py, lab_model.py).
BUILDERS = frozenset({"build_model", "make_batches", "build_lab_model", "lab_batches"})
HOST_COMMENT = re.compile(r"#\s*host:\s*\S")  # "# host: <why>": a reason is required


def comments_by_line(source: str) -> dict[int, str]:
    """{line number: the comment on it} for every comment of the source."""
    out = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            out[token.start[0]] = token.string
    return out


def torch_names(tree: ast.AST) -> tuple[set[str], set[str]]:
    """(names bound to the torch module, factory names imported from torch) in a module."""
    modules, factories = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name == "torch"}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            factories |= {a.asname or a.name for a in node.names if a.name in FACTORIES}
    return modules, factories


def made_without_device(call: ast.Call, torch_modules: set[str], torch_factories: set[str]) -> str | None:
    """The name of the factory or builder `call` is, when it has no device= (None otherwise)."""
    func, name = call.func, None
    if isinstance(func, ast.Attribute) and func.attr in FACTORIES:
        if isinstance(func.value, ast.Name) and func.value.id in torch_modules:
            name = f"torch.{func.attr}"
    elif isinstance(func, ast.Name) and func.id in torch_factories:
        name = f"torch.{func.id}"
    if isinstance(func, ast.Name) and func.id in BUILDERS or isinstance(func, ast.Attribute) and func.attr in BUILDERS:
        name = func.id if isinstance(func, ast.Name) else func.attr
    if name is None or any(k.arg == "device" for k in call.keywords):
        return None
    return name


def rank_functions(tree: ast.Module) -> set[str]:
    """The module-level functions of a lesson module that run in ranks: each one handed to launch(fn, ...) or named
    as rank code (`*_rank_fn`, `*_rank`), and every function of the module those call (by name), transitively."""
    defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    named = {name for name in defs if name.endswith(("_rank_fn", "_rank"))}
    launched = named | {
        node.args[0].id
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and (
            isinstance(node.func, ast.Name)
            and node.func.id == "launch"
            or isinstance(node.func, ast.Attribute)
            and node.func.attr == "launch"  # parlab.launch(fn, ...)
        )
        and node.args
        and isinstance(node.args[0], ast.Name)
    }
    found, todo = set(), [name for name in launched if name in defs]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        for node in ast.walk(defs[name]):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in defs:
                todo.append(node.func.id)
    return found


def violations(source: str, filename: str, only: set[str] | None = None) -> list[str]:
    """'file:line: torch.zeros without device=' for each factory or builder call of `source` made without device=
    whose lines carry no '# host: <why>' comment. only: scan these module-level functions only (None: all)."""
    tree = ast.parse(source, filename)
    comments = comments_by_line(source)
    torch_modules, torch_factories = torch_names(tree)
    roots = [tree] if only is None else [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in only]
    found = []
    for root in roots:
        for node in ast.walk(root):
            if not isinstance(node, ast.Call):
                continue
            name = made_without_device(node, torch_modules, torch_factories)
            if name is None:
                continue
            lines = range(node.lineno, (node.end_lineno or node.lineno) + 1)
            if any(HOST_COMMENT.search(comments.get(line, "")) for line in lines):
                continue
            found.append(f"{filename}:{node.lineno}: {name}(...) without device=")
    return sorted(set(found), key=lambda v: (v.split(":")[0], int(v.split(":")[1])))


def scanned_files() -> list[tuple[Path, bool]]:
    """(file, whole module?) for every module the guard reads."""
    files = [(p, True) for folder in SCANNED_FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))]
    return files + [(p, False) for folder in (LESSON_FOLDER, LAB_FOLDER) for p in sorted((ROOT / folder).rglob("*.py"))]


# ------------------------------------------------------------------------------------------------- the guard


def test_rank_code_makes_its_tensors_on_the_device():
    """The guard itself: no factory or builder without device= in rank code, unless its line says why."""
    found = []
    for path, whole in scanned_files():
        source = path.read_text()
        only = None if whole else rank_functions(ast.parse(source))
        if only == set():
            continue  # a lesson module that launches nothing: its code all runs in the notebook
        found += violations(source, str(path.relative_to(ROOT)), only)
    assert not found, (
        "tensors made on the CPU in code that runs in ranks (NCCL refuses them): give each device= "
        "(e.g. device=parlab.device(), or device=x.device), or say on its line why it belongs on the host "
        "(# host: <why>):\n" + "\n".join(found)
    )


def test_the_guard_reads_what_it_should():
    """The scanned set holds the rank-side folders and the rank code of the lessons and of the labs. checks."""
    files = {str(p.relative_to(ROOT)) for p, _ in scanned_files()}
    for must in (
        "parlab/runs/collectives.py",
        "parlab/schemes/data_parallel.py",
        "parlab/twins/data.py",
        "parlab/core/comm.py",
        "parlab/schemes/zero/offload.py",
    ):
        assert must in files
    assert "parlab/grading/labs/lab07_hybrid.py" in files and "parlab/grading/labs/lab_bug_hunt_pipeline.py" in files
    source = (ROOT / LESSON_FOLDER / "collectives.py").read_text()
    assert {"collective_rank_fn", "ring_demo_rank_fn", "initial_chunks"} <= rank_functions(ast.parse(source))
    assert "draw_ring_step" not in rank_functions(ast.parse(source))  # a figure, drawn in the notebook
    source = (ROOT / LAB_FOLDER / "lab07_hybrid.py").read_text()
    assert {"run_step", "measure_states"} <= rank_functions(ast.parse(source))  # parlab.launch(run_step, ...)
    assert "judge_step" not in rank_functions(ast.parse(source))  # the verdicts: in the grader


@pytest.mark.parametrize(
    "line, flagged",
    [
        ("x = torch.zeros(3)", True),
        ("x = torch.randn(3, generator=gen, dtype=torch.float64)", True),
        ("x = torch.tensor([1.0])", True),
        ("x = torch.arange(4).view(2, 2)", True),
        ("model = build_model(cfg, seed)", True),
        ("x = torch.zeros(3)  # host:", True),  # no reason given
        ("x = torch.zeros(3)  # the host", True),
        ("x = torch.zeros(3, device=dev)", False),
        ("x = torch.zeros(3)  # host: the seeded draw, moved below", False),
        ("x = torch.zeros_like(y)", False),
        ("x = y.new_zeros(3)", False),
        ("model = build_model(cfg, seed, device=dev)", False),
        ("x = zeros(3)", True),  # from torch import zeros
        ("x = numpy.zeros(3)", False),
    ],
)
def test_the_guard_flags_what_it_should(line, flagged):
    source = f"import numpy\nimport torch\nfrom torch import zeros\n\n\ndef f(cfg, seed, dev, gen, y):\n    {line}\n"
    assert bool(violations(source, "example.py")) == flagged, line


def test_a_host_comment_may_close_a_call_of_several_lines():
    source = "import torch\nx = torch.randn(\n    3,\n    4,\n)  # host: drawn here, moved by the caller\n"
    assert violations(source, "example.py") == []
    assert violations(source.replace("# host: drawn here, moved by the caller", ""), "example.py") == [
        "example.py:2: torch.randn(...) without device="
    ]


def test_only_the_lessons_rank_functions_are_read():
    source = (
        "import torch\n\n"
        "def helper():\n    return torch.zeros(2)\n\n"
        "def demo():\n    return helper()\n\n"
        "def figure():\n    return torch.ones(2)\n\n"
        "def run():\n    return launch(demo, 2)\n\n"
        "def other_rank_fn():\n    return 1\n"
    )
    only = rank_functions(ast.parse(source))
    assert only == {"demo", "helper", "other_rank_fn"}
    assert violations(source, "lesson.py", only) == ["lesson.py:4: torch.zeros(...) without device="]


# ---------------------------------------------------------------------------- the traced calls check devices


def _fake_cuda(n: int) -> torch.Tensor:
    """A tensor whose device is cuda:0, made without a GPU (FakeTensorMode only tracks shapes and devices)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(n, device="cuda:0")  # host: never here, a fake CUDA tensor (see the docstring)


def _pretend_nccl(monkeypatch) -> None:
    """This rank's groups say they are NCCL groups, on GPU 0 (no CUDA needed: nothing reaches torch.distributed)."""
    monkeypatch.setattr(comm, "_backend", lambda group: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def _ring_rank(pretend_nccl: bool, fake_cuda: bool) -> str:
    """Rank code: parlab's ring all-reduce on a CPU (or fake CUDA) tensor; the refusal's text, or 'accepted'."""
    import pytest

    from parlab.schemes.collectives import ring_all_reduce

    with pytest.MonkeyPatch.context() as monkeypatch:
        if pretend_nccl:
            _pretend_nccl(monkeypatch)
        x = _fake_cuda(8) if fake_cuda else torch.ones(8)  # host: the tensor under test
        try:
            ring_all_reduce(x)
        except comm.DeviceMismatch as exc:
            return str(exc)
    return "accepted"


def _line_of(function, text: str) -> int:
    """The line number, in its file, of the first line of `function` that contains `text`."""
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if text in line)


def test_a_cpu_tensor_is_refused_on_nccl_with_the_schemes_line():
    """NCCL simulated on gloo: the ring's first send of a CPU tensor is refused before torch.distributed sees it,
    on every rank, naming the call, both devices and the scheme's file:line."""
    from parlab.schemes.collectives import ring_all_reduce

    results = parlab.launch(_ring_rank, 2, True, False, echo=False)
    line = _line_of(ring_all_reduce, "comm.isend(")
    for message in results:
        assert message.startswith("comm.isend: a tensor on cpu, but this rank's nccl group works on cuda:0"), message
        assert "NCCL refuses CPU tensors" in message
        assert message.endswith(f"handed over at parlab/schemes/collectives.py:{line} (exchange)"), message
    # refused before it was recorded or issued: no send or receive on the trace
    assert not [e for e in results.trace.events if e.kind in ("send", "recv")]


def test_a_gpu_tensor_is_refused_on_gloo_and_the_cpu_one_is_not():
    """On a gloo group the device is the CPU: a (fake) CUDA tensor is refused, a CPU one goes through."""
    results = parlab.launch(_ring_rank, 2, False, True, echo=False)
    assert all(m.startswith("comm.isend: a tensor on cuda:0, but this rank's gloo group works on cpu") for m in results)
    assert "NCCL" not in results[0]
    assert list(parlab.launch(_ring_rank, 2, False, False, echo=False)) == ["accepted", "accepted"]


def _check_rank() -> dict:
    """Rank code: check_device on its own under a pretended NCCL group: what passes and what is refused."""
    import pytest

    with pytest.MonkeyPatch.context() as monkeypatch:
        _pretend_nccl(monkeypatch)
        out = {"device": str(comm.device())}
        comm.check_device("all_reduce", None, [_fake_cuda(4)])  # on the group's device: no error
        for what, tensors in (
            ("all_gather", [_fake_cuda(4), torch.ones(4)]),
            ("all_to_all", [torch.ones(1)]),
        ):  # host: test
            try:
                comm.check_device(what, None, tensors)
                out[what] = "accepted"
            except comm.DeviceMismatch as exc:
                out[what] = str(exc)
    out["after"] = str(comm.device())  # the monkeypatch is undone: gloo's CPU again
    return out


def test_check_device_looks_at_every_tensor_of_a_call():
    out = parlab.launch(_check_rank, 1, echo=False)[0]
    assert out["device"] == "cuda:0" and out["after"] == "cpu"
    assert out["all_gather"].startswith("comm.all_gather: a tensor on cpu"), out  # the second tensor of the list
    assert out["all_to_all"].startswith("comm.all_to_all: a tensor on cpu"), out
    assert "tests/test_devices.py:" in out["all_gather"]  # the caller: this file, not comm.py


# ------------------------------------------------------------------- a GPU launch, as far as a CPU can check it


def test_an_nccl_rank_makes_its_cuda_context_then_its_communicator_eagerly(monkeypatch):
    """Under NCCL a rank sets its GPU and makes its CUDA context first, then init_process_group with device_id
    (the communicator is made there, not in the first collective); every phase is timed. CUDA is faked here."""
    from parlab.runtime import rank as rank_code

    calls = []
    monkeypatch.setattr(rank_code, "_cuda_context", lambda i: calls.append(("context", i)) or torch.device("cuda", i))
    monkeypatch.setattr(rank_code.dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    phases = {"rank_start": 0.0}
    rank_code._init_process_group({"backend": "nccl", "rendezvous": "/tmp/r", "world_size": 2}, 1, phases)
    group = {"init_method": "file:///tmp/r", "rank": 1, "world_size": 2, "device_id": torch.device("cuda", 1)}
    assert calls == [("context", 1), ("nccl", group)]
    assert 0.0 < phases["cuda_context"] <= phases["process_group"]

    calls.clear()  # gloo: no CUDA at all, no device_id
    phases = {"rank_start": 0.0}
    rank_code._init_process_group({"backend": "gloo", "rendezvous": "/tmp/r", "world_size": 2}, 0, phases)
    assert calls == [("gloo", {"init_method": "file:///tmp/r", "rank": 0, "world_size": 2})]
    assert "cuda_context" not in phases and phases["process_group"] > 0


def test_this_torch_takes_device_id():
    """init_process_group(device_id=...) exists from torch 2.3; parlab needs >= 2.4 (README)."""
    assert "device_id" in inspect.signature(torch.distributed.init_process_group).parameters


def test_spares_make_a_cuda_context_only_for_an_nccl_job(monkeypatch):
    """A spare of an NCCL job makes its CUDA context ahead, on the GPU of the rank it is prepared as; a gloo job's
    spare never touches CUDA; and a spare of one kind never serves a job of the other."""
    from parlab.runtime import rank as rank_code
    from parlab.runtime import workers

    made = []
    monkeypatch.setattr(rank_code, "_cuda_context", made.append)
    monkeypatch.setattr(rank_code, "_seed_generators", lambda seed: None)  # (not this test process's generators)
    rank_code._prepare_spare(None)
    assert made == []
    rank_code._prepare_spare(3)
    assert made == [3]
    spec = {"env": {}, "sys_path": [], "cwd": "/", "slot_bytes": 1}
    assert workers.spec_key({**spec, "cuda": True}) != workers.spec_key({**spec, "cuda": False})


def test_the_parent_counts_gpus_without_starting_cuda(monkeypatch):
    """default_backend and the launch's checks count GPUs through torch.cuda.device_count (NVML where it can):
    torch.cuda.is_available() would initialise the driver in the parent, ~0.5 s of every command."""
    from parlab.runtime import launcher

    def no(*args):
        raise AssertionError("torch.cuda.is_available() called")

    monkeypatch.setattr(torch.cuda, "is_available", no)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [launcher.default_backend(w) for w in (1, 2, 3)] == ["nccl", "nccl", "gloo"]
    assert launcher.check_launch_args(print, 2, "nccl", 10.0) == "nccl"
    with pytest.raises(ValueError, match="needs one GPU per rank: world_size=3 but 2 GPUs"):
        launcher.check_launch_args(print, 3, "nccl", 10.0)


def test_a_launch_says_its_backend_and_each_ranks_phases():
    results = parlab.launch(lambda: comm.device().type, 2, echo=False)
    assert list(results) == ["cpu", "cpu"] and results.backend == "gloo"
    for phases in results.phases:
        assert list(phases) == ["rank_start", "process_group", "fn_done"]  # no CUDA phase on gloo
        assert 0 < phases["rank_start"] < phases["process_group"] <= phases["fn_done"] < results.seconds


def test_the_trace_says_where_each_collectives_tensors_were():
    def rank():
        x = torch.ones(2)  # host: gloo's device
        comm.all_reduce(x)
        comm.barrier()
        return x

    events = parlab.launch(rank, 2, echo=False).trace.events
    assert {(e.kind, e.device) for e in events} == {("all_reduce", "cpu"), ("barrier", None)}
