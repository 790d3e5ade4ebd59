"""Every scheme beside its PyTorch twin: the API a practitioner uses, run on the same model, data and weights.

parlab writes each scheme by hand. PyTorch ships most of them: DDP, ZeroRedundancyOptimizer, FSDP2's
`fully_shard`, DTensor's `parallelize_module`, `context_parallel`, `torch.distributed.pipelining`. A twin is
the few lines of that API which do what parlab's scheme does, run in the same launch right after parlab's rank
code, on the same process group, and compared with parlab's result:

    report["twin"] == {"name": "torch DDP", "max_abs_err": 0.0, "tol": 1e-10, "passed": True, "comm": {...}, ...}
    report["twin"] == {"name": "no PyTorch twin", "skipped": "the parameter server has no ..."}

The twin's traffic is recorded with `parlab.twins.record` (every communication operator torch dispatches), so
its bytes (`comm`, per kind and rank) stand beside parlab's. One module per family of schemes:

    parlab/twins/data.py       collectives, dp, zero, offload    dist.all_reduce, DDP, ZeroRedundancyOptimizer, FSDP2
    parlab/twins/tensor.py     tp, megatron-sp, hybrid           parallelize_module (+ fully_shard on a 2-D mesh)
    parlab/twins/sequence.py   ring, ring-zigzag, ulysses, usp   context_parallel
    parlab/twins/pipeline.py   pp (and the V schedules)          pipelining: PipelineStage + Schedule*

parlab/twins/twin.py says what a twin is; parlab/twins/registry.py finds each scheme's and runs it.

How a launch gets its twin (parlab.runs.registry.launch_scheme(..., twin=True) and `python -m parlab run`): the rank
code is wrapped by `with_twin` (parlab/twins/registry.py), which returns `Twinned(value, twin_output)`; `split` takes
the two apart in the parent, the scheme's own report is built from parlab's values as before, and `twin_report` adds the
comparison.
"""
