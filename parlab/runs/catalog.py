"""The schemes `python -m parlab list` names, without importing them (which would import torch: ~2 s).

Each scheme's own module in parlab/runs/ registers it (its `SCHEMES`); this list repeats only its name and help line,
in the order of the lessons, so that `list` and `--help` answer at once. tests/test_cli.py checks that it matches
the registry exactly: a new scheme adds one line here.
"""

CATALOG: list[tuple[str, str]] = [
    ("collectives", "ring all-reduce written with send/recv, checked against dist.all_reduce"),
    ("dp", "data parallel, bucketed all-reduces overlapped with backward; vs one device and torch DDP"),
    ("dp-naive", "data parallel, one blocking all-reduce per gradient after backward"),
    ("tp", "tensor parallel (Megatron): column/row-parallel MLP and attention, vocab-parallel embedding and loss"),
    (
        "pp",
        "pipeline parallel: GPipe, 1F1B, interleaved, zero-bubble, ZB-V and DualPipeV schedules, with their bubbles",
    ),
    ("megatron-sp", "Megatron sequence parallelism on tensor parallelism: LayerNorm regions split along the sequence"),
    ("ulysses", "DeepSpeed-Ulysses: sequence split, all-to-all to a head split around attention"),
    ("ring", "Ring Attention: sequence split, K/V blocks passed round a ring, online-softmax merge"),
    ("ring-zigzag", "Ring Attention, zigzag layout: rank r holds chunks r and 2P-1-r, equal causal work"),
    ("usp", "USP: Ulysses all-to-all inside, ring attention across, on a ulysses x ring mesh"),
    ("zero", "ZeRO stages 1-3 (+ mixed precision): memory per rank vs the paper; vs one device and torch's own"),
    ("offload", "ZeRO-2 with Adam's state in host memory (ZeRO-Offload) or on disk (ZeRO-Infinity); vs one device"),
    (
        "hybrid",
        "hybrid parallelism on one device mesh: data (ZeRO) x pipeline x context x tensor, + experts, each on its axis",
    ),
    ("ps", "parameter server on rank 0, workers on the others; sync (vs one device) or async (staleness, replayed)"),
    ("moe", "expert parallelism: a Mixture-of-Experts GPT, experts spread over ranks, all-to-all dispatch and combine"),
]
