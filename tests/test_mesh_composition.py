"""The building blocks compose on a device mesh: DP x TP and DP x PP on 4 ranks match one device (float64).

Each block takes the process group it works in; the mesh (torch's DeviceMesh, through parlab.core.mesh) hands each
its axis' group. The trace records each call's axis, so the tests also prove that data parallelism's all-reduces
ran on the dp axis only, and tensor parallelism's (or the pipeline's sends) on theirs.
"""

from __future__ import annotations

import torch

import parlab
from parlab.core.check import compare
from parlab.core.mesh import DeviceMesh, axis_groups
from parlab.core.models import GPTConfig, build_model, make_batches, make_optimizer, train_single_device
from parlab.schemes.data_parallel import all_reduce_gradients, shard_batch, train_data_parallel
from parlab.schemes.pipeline.executor import build_stages, train_pipeline
from parlab.schemes.pipeline.schedules import one_f_one_b
from parlab.schemes.tensor_parallel import TensorParallelGPT, gather_full, split_dims

CFG = GPTConfig(layers=2, hidden=32, heads=4, vocab_size=64, seq_len=16)
BATCH, STEPS, SEED = 8, 2, 0


def _reference():
    return train_single_device(CFG, make_batches(CFG, BATCH, STEPS, SEED), SEED, "sgd", 0.1)


def dp_tp_rank() -> dict:
    """DP x TP = 2 x 2: TP inside each DP replica (a "tp" group), the replicas' gradients averaged over "dp"."""
    mesh = DeviceMesh({"dp": 2, "tp": 2})
    model = TensorParallelGPT(build_model(CFG, SEED), group=mesh.group("tp"))  # this rank's TP slices
    optimizer = make_optimizer(model.parameters(), "sgd", 0.1)
    batches = make_batches(CFG, BATCH, STEPS, SEED)  # global batches: each DP replica takes its B/2 rows
    out = train_data_parallel(
        model, optimizer, batches, bucket_bytes=16 * 1024, group=mesh.group("dp"), loss_fn=lambda m, x, y: m.loss(x, y)
    )
    return {**out, "split_dims": split_dims(model), "coords": mesh.coords}


def test_dp_x_tp_matches_one_device_and_dp_talks_on_the_dp_axis_only():
    results = parlab.launch(dp_tp_rank, 4, echo=False)
    reference = _reference()
    dims = results[0]["split_dims"]
    for dp_index, ranks in enumerate(([0, 1], [2, 3])):  # the TP pair of each DP replica
        assert [results[r]["coords"] for r in ranks] == [{"dp": dp_index, "tp": 0}, {"dp": dp_index, "tp": 1}]
        params = gather_full([results[r]["params"] for r in ranks], dims)
        verdict = compare(
            f"DP x TP replica {dp_index}: parameters after {STEPS} steps", params, reference.params, show=True
        )
        assert verdict.passed and verdict.max_abs_err <= 1e-10, verdict.line
        grads = gather_full([results[r]["grads"] for r in ranks], dims)
        assert compare("gradients of step 1", grads, reference.grads).max_abs_err <= 1e-10
    loss = [sum(results[r]["losses"][k] for r in (0, 2)) / 2 for k in range(STEPS)]  # mean over the DP replicas
    assert compare("loss", torch.tensor(loss), torch.tensor(reference.losses)).max_abs_err <= 1e-10

    trace = results.trace
    dp_groups = {tuple(g) for g in axis_groups({"dp": 2, "tp": 2}, "dp")}  # {(0, 2), (1, 3)}
    buckets = [e for e in trace.select(kind="all_reduce") if e.label.startswith("bucket")]
    assert len(buckets) > 4 * STEPS  # several buckets per step, on each of the 4 ranks
    assert all(e.axis == "dp" and e.group in dp_groups and e.rank in e.group for e in buckets)
    tp_reduces = [e for e in trace.select(kind="all_reduce") if not e.label.startswith("bucket")]
    assert tp_reduces and all(e.axis == "tp" for e in tp_reduces)  # f, g and the loss: within each TP pair
    assert sum(trace.bytes_per_rank(axis="dp")["all_reduce"]) == sum(e.bytes for e in buckets)


def dp_pp_rank() -> dict:
    """DP x PP = 2 x 2: a 2-stage 1F1B pipeline per DP replica, the stages' gradients averaged over "dp"."""
    mesh = DeviceMesh({"dp": 2, "pp": 2})
    pp_group, dp_group = mesh.group("pp"), mesh.group("dp")
    grad_channel = mesh.twin_group("pp")  # the pipeline's gradients travel apart from its activations
    schedule = one_f_one_b(p=2, m=2)
    stages = build_stages(build_model(CFG, SEED), schedule, mesh.index("pp"))
    module = torch.nn.ModuleList(stages.values())  # this rank's stage(s), whose gradients DP averages
    optimizer = make_optimizer(module.parameters(), "sgd", 0.1)
    replica = mesh.index("dp")
    batches = [shard_batch(x, y, replica, 2) for x, y in make_batches(CFG, BATCH, STEPS, SEED)]  # B/2 rows each
    out = train_pipeline(
        schedule,
        stages,
        optimizer,
        batches,
        group=pp_group,
        grad_group=grad_channel,
        grad_sync=lambda: all_reduce_gradients(module, group=dp_group),
    )
    return {**out, "coords": mesh.coords}


def test_dp_x_pp_matches_one_device_and_dp_talks_on_the_dp_axis_only():
    results = parlab.launch(dp_pp_rank, 4, echo=False)
    reference = _reference()
    for dp_index, ranks in enumerate(([0, 1], [2, 3])):  # the two stages of each DP replica
        assert [results[r]["coords"] for r in ranks] == [{"dp": dp_index, "pp": 0}, {"dp": dp_index, "pp": 1}]
        params = {name: w for r in ranks for name, w in results[r]["params"].items()}
        verdict = compare(
            f"DP x PP replica {dp_index}: parameters after {STEPS} steps", params, reference.params, show=True
        )
        assert verdict.passed and verdict.max_abs_err <= 1e-10, verdict.line
        grads = {name: g for r in ranks for name, g in results[r]["grads"].items()}
        assert compare("gradients of step 1", grads, reference.grads).max_abs_err <= 1e-10
    loss = [(results[1]["losses"][k] + results[3]["losses"][k]) / 2 for k in range(STEPS)]  # last stages
    assert compare("loss", torch.tensor(loss), torch.tensor(reference.losses)).max_abs_err <= 1e-10

    trace = results.trace
    dp_groups = {tuple(g) for g in axis_groups({"dp": 2, "pp": 2}, "dp")}
    reduces = trace.select(kind="all_reduce")
    assert reduces and all(e.axis == "dp" and e.group in dp_groups for e in reduces)
    sends = trace.select(kind="send") + trace.select(kind="recv")
    assert sends and all(e.axis == "pp" and e.peer in e.group for e in sends)  # neighbours in the same pipeline
