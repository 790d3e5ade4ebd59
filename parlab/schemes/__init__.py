"""The parallelism schemes: each family's algorithm, rank loop and theory, every block taking its process group.

A student reads these files; each is a teaching text (the paper and its maths at the top, shapes in comments,
`group=` on every collective) and imports only parlab/core and other schemes.

    collectives.py        the collectives chunk by chunk, and a ring all-reduce written with send/recv
    data_parallel.py      DP: naive and bucketed all-reduces overlapped with backward
    tensor_parallel.py    Megatron TP: column/row-parallel layers, f and g, vocab-parallel embedding and loss
    pipeline/             schedules as data (actions, schedules, schedules_v) and the executor that runs them
    sequence/             Megatron SP, DeepSpeed-Ulysses, ring attention (contiguous, zigzag) and USP
    zero/                 ZeRO stages 1-3, the paper's formulas (theory.py), offload to host memory or disk
    expert_parallel.py    expert parallelism: the all-to-all dispatch and combine of an MoE layer
    hybrid/               every axis on one device mesh, its pieces, experts on the mesh, and the planner
    parameter_server.py   a parameter server, synchronous and asynchronous
    recompute/            activation recomputation measured against Korthikanti et al.'s formulas
    faults/               sharded checkpoints that reshard on load, and training that survives a dead rank

How each is run and checked (`python -m parlab run NAME`) is in parlab/runs; its figures in parlab/lessons.
"""
