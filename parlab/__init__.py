"""parlab: see how large models are trained on many devices.

Each parallelism scheme lives in its own readable module (`parlab.collectives`, `parlab.data_parallel`,
`parlab.tensor_parallel`, `parlab.pipeline` with `parlab.schedules`, ...): the algorithm, its rank loop and its
theory, every building block taking the process group it works in. How each is run and checked is in
`parlab.runs` (the CLI's registry), each lesson's figures in `parlab.lessons`. The shared machinery is here:

    parlab.launch(fn, world_size, ...)   run rank code on real processes (parlab.launch)
    parlab.comm                          traced collectives and compute spans
    parlab.compare(...)                  one verdict line against the single-device reference (parlab.check)
    parlab.models                        the reference GPT, its data and its single-device training
    parlab.memory, parlab.mesh           bytes held, counted from tensors; the device mesh (torch's DeviceMesh)
    parlab.plots                         timelines, shard diagrams and the package's palette (imports plotly)
"""

from parlab import comm
from parlab.check import CountCheck, Verdict, check_equal, compare
from parlab.launch import (
    CollectiveMismatch,
    LaunchTimeout,
    RankError,
    Results,
    device,
    init_from_env,
    launch,
    progress,
    warm_up,
)
from parlab.trace import Event, Trace

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
    "progress",
    "warm_up",
]
