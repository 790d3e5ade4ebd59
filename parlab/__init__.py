"""parlab: see how large models are trained on many devices.

Each parallelism scheme lives in its own readable module (`parlab.collectives`, `parlab.data_parallel`,
`parlab.tensor_parallel`, `parlab.pipeline` with `parlab.schedules`, ...): the algorithm, its rank loop and its
theory, every building block taking the process group it works in. How each is run and checked is in
`parlab.runs` (the CLI's registry), each lesson's figures in `parlab.lessons`. The shared machinery is here:

    parlab.launch(fn, world_size, ...)   run rank code on real processes (parlab.launch)
    parlab.live(fn or "scheme", ...)     the same, its timeline drawn while the ranks run (parlab.live)
    parlab.comm                          traced collectives and compute spans
    parlab.compare(...)                  one verdict line against the single-device reference (parlab.check)
    parlab.models                        the reference GPT, its data and its single-device training
    parlab.memory, parlab.mesh           bytes held, counted from tensors; the device mesh (torch's DeviceMesh)
    parlab.plots                         timelines, shard diagrams and the package's palette (imports plotly)
"""

import copyreg
import importlib
import os
import sys
import types

# What `parlab.X` names, and where it lives. Imported on first use, so that `python -m parlab list` or `plan` does not
# pay for importing torch (the CLI imports only what a command needs).
_EXPORTS = {
    "comm": ("parlab.comm", None),
    "CountCheck": ("parlab.check", "CountCheck"),
    "Verdict": ("parlab.check", "Verdict"),
    "check_equal": ("parlab.check", "check_equal"),
    "compare": ("parlab.check", "compare"),
    "CollectiveMismatch": ("parlab.launch", "CollectiveMismatch"),
    "LaunchTimeout": ("parlab.launch", "LaunchTimeout"),
    "RankError": ("parlab.launch", "RankError"),
    "Results": ("parlab.launch", "Results"),
    "device": ("parlab.launch", "device"),
    "init_from_env": ("parlab.launch", "init_from_env"),
    "progress": ("parlab.launch", "progress"),
    "warm_up": ("parlab.launch", "warm_up"),
    "Event": ("parlab.trace", "Event"),
    "Trace": ("parlab.trace", "Trace"),
}


class _Package(types.ModuleType):
    """The parlab package: `parlab.launch` is the launch function (not the module of the same name, which is
    `sys.modules["parlab.launch"]`), and the other names load on first use."""

    @property
    def launch(self):
        return importlib.import_module("parlab.launch").launch

    @launch.setter
    def launch(self, module):  # the import system binds the submodule here; parlab.launch stays the function
        pass

    @property
    def live(self):  # like launch: parlab.live(...) is the function, its module is sys.modules["parlab.live"]
        return importlib.import_module("parlab.live").live

    @live.setter
    def live(self, module):
        pass

    def __getattr__(self, name: str):
        if name not in _EXPORTS:
            raise AttributeError(f"module 'parlab' has no attribute {name!r}")
        module, attribute = _EXPORTS[name]
        value = importlib.import_module(module)
        return value if attribute is None else getattr(value, attribute)

    def __dir__(self):
        return sorted({*super().__dir__(), *_EXPORTS, "launch", "live"})


sys.modules[__name__].__class__ = _Package
# Rank code that names `parlab` travels by value (cloudpickle); the package itself travels by name, as any module.
copyreg.pickle(_Package, lambda package: (importlib.import_module, (package.__name__,)))

# jsonschema (which plotly's first figure imports, through nbformat) builds an IRI parser at import that no lesson uses:
# about 1.5 s of CPU in every kernel. It is imported at its first use instead (parlab/runtime/lazy_imports.py).
importlib.import_module("parlab.runtime.lazy_imports").defer_rfc3987_syntax()

# In a Jupyter kernel (or with PARLAB_WARM=1) importing parlab starts the rank server at once (parlab.launch does it
# at its import), so that the lesson's first launch is warm; nowhere else does `import parlab` import torch.
if os.environ.get("PARLAB_WARM", "").strip() == "1" or (
    "ipykernel" in sys.modules and os.environ.get("PARLAB_WARM", "").strip() != "0"
):
    importlib.import_module("parlab.launch")

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
    "warm_up",
]
