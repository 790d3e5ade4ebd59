"""parlab: see how large models are trained on many devices.

The package, folder by folder (the README's "Map of the package" says why each is where it is):

    parlab/schemes/    the parallelism schemes: each family's algorithm, rank loop and theory (a student reads these)
    parlab/core/       what every scheme stands on: traced collectives, the reference models, checks, traces,
                       memory, the device mesh, hardware profiles and the emulated pace
    parlab/runtime/    running rank code on real processes: the launcher, the rank server, hang diagnosis
    parlab/views/      what the ranks did, drawn: timelines, shard diagrams, live timelines, replay, widgets
    parlab/twins/      each scheme's PyTorch twin (DDP, FSDP2, DTensor, pipelining, context_parallel)
    parlab/runs/       how each scheme is run and checked: the registry behind `python -m parlab run`
    parlab/grading/    `python -m parlab grade` and each lab's checks (grading/labs/)
    parlab/lessons/    each lesson's demos and figures, the slides and the figure export

What a notebook or a script reaches from here (each loads on first use: `import parlab` imports no torch):

    parlab.launch(fn, world_size, ...)   run rank code on real processes (parlab/runtime/launcher.py)
    parlab.live(fn or "scheme", ...)     the same, its timeline drawn while the ranks run (parlab/views/live.py)
    parlab.device()                      the device of this rank's tensors (its GPU under NCCL, else the CPU)
    parlab.compare(...)                  one verdict line against the single-device reference (parlab/core/check.py)
    parlab.comm                          traced collectives and compute spans (parlab/core/comm.py)
    parlab.replay(trace or "run.jsonl")  a recorded run played back (parlab/views/replay.py; Trace.save/load)
"""

import importlib
import os
import sys

# What `parlab.X` names, and where it lives. Imported on first use, so that `python -m parlab list` or `plan` does not
# pay for importing torch (the CLI imports only what a command needs).
_EXPORTS = {
    "comm": ("parlab.core.comm", None),
    "CountCheck": ("parlab.core.check", "CountCheck"),
    "Verdict": ("parlab.core.check", "Verdict"),
    "check_equal": ("parlab.core.check", "check_equal"),
    "compare": ("parlab.core.check", "compare"),
    "CollectiveMismatch": ("parlab.runtime.errors", "CollectiveMismatch"),
    "LaunchTimeout": ("parlab.runtime.errors", "LaunchTimeout"),
    "RankError": ("parlab.runtime.errors", "RankError"),
    "Results": ("parlab.runtime.errors", "Results"),
    "launch": ("parlab.runtime.launcher", "launch"),
    "device": ("parlab.core.comm", "device"),
    "init_from_env": ("parlab.runtime.launcher", "init_from_env"),
    "warm_up": ("parlab.runtime.server", "warm_up"),
    "progress": ("parlab.core.comm", "progress"),
    "Event": ("parlab.core.trace", "Event"),
    "Trace": ("parlab.core.trace", "Trace"),
    "replay": ("parlab.views.replay", "replay"),
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'parlab' has no attribute {name!r}")
    module, attribute = _EXPORTS[name]
    value = importlib.import_module(module)
    return value if attribute is None else getattr(value, attribute)


def __dir__():
    return sorted({*globals(), *_EXPORTS})


def live(what, world_size: int = 4, *args, title: str | None = None, **kwargs):
    """Run rank code (like parlab.launch(fn, world_size, ...); returns its Results) or a scheme by name (like
    parlab.runs.registry.launch_scheme(name, world_size=..., **options); returns (results, report)), with its
    timeline drawn while the ranks run (parlab/views/live.py).

    Outside a notebook (a plain script) there is nothing to draw in: the finished timeline is saved as a standalone
    HTML file, and a line on stderr says where."""
    if isinstance(what, str):
        from parlab.runs.registry import launch_scheme

        out = launch_scheme(what, live=True, world_size=world_size, **kwargs)
        results, name = out[0], what
    else:
        from parlab.views.live import launch_live

        out = results = launch_live(what, world_size, *args, title=title, **kwargs)
        name = getattr(what, "__name__", "rank code")
    if not _in_kernel():
        _save_timeline(results, title or f"{name} on {len(results)} ranks")
    return out


def _in_kernel() -> bool:
    """Whether this runs in a Jupyter kernel, where a figure can be shown."""
    shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def _save_timeline(results, title: str) -> str:
    """The finished timeline as a standalone HTML file in the temp folder (plotly.js inside: it opens offline);
    says where on stderr, and returns the path."""
    import tempfile

    from parlab.views.plots import timeline

    handle, path = tempfile.mkstemp(prefix="parlab-live-", suffix=".html")
    with os.fdopen(handle, "w") as f:
        f.write(timeline(results.trace, title=f"{title}: {len(results.trace)} events").to_html(include_plotlyjs=True))
    print(
        f"parlab.live: no notebook to draw in here; the timeline is saved in {path} (open it in a browser)",
        file=sys.stderr,
    )
    return path


# jsonschema (which plotly's first figure imports, through nbformat) builds an IRI parser at import that no lesson uses:
# about 1.5 s of CPU in every kernel. It is imported at its first use instead (parlab/runtime/lazy_imports.py).
importlib.import_module("parlab.runtime.lazy_imports").defer_rfc3987_syntax()

# In a Jupyter kernel (or with PARLAB_WARM=1) importing parlab starts the rank server at once (the launcher does it at
# its import), so that the lesson's first launch is warm; nowhere else does `import parlab` import torch.
if os.environ.get("PARLAB_WARM", "").strip() == "1" or (
    "ipykernel" in sys.modules and os.environ.get("PARLAB_WARM", "").strip() != "0"
):
    importlib.import_module("parlab.runtime.launcher")

__version__ = "0.1.0"

__all__ = [
    "CollectiveMismatch",
    "CountCheck",
    "Event",
    "LaunchTimeout",
    "RankError",
    "Results",
    "Trace",
    "Verdict",
    "check_equal",
    "comm",
    "compare",
    "device",
    "init_from_env",
    "launch",
    "live",
    "progress",
    "replay",
    "warm_up",
]
