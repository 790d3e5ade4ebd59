"""Memory accounting counts the tensors held; the device mesh builds the right groups."""

import pytest
import torch
import torch.distributed as dist

import parlab
from parlab.core import comm
from parlab.core.memory import MemoryLedger, saved_activations, state_bytes, tensor_bytes
from parlab.core.mesh import DeviceMesh, axis_groups, check_mesh, mesh_coords, mesh_rank
from parlab.core.models import GPTConfig, build_model, lm_loss, make_batches, make_optimizer


def test_tensor_bytes_counts_each_storage_once():
    t = torch.zeros(10, dtype=torch.float64)
    assert tensor_bytes(t) == 80
    assert tensor_bytes(t, t[:5], [t.view(2, 5)]) == 80  # views share the storage
    assert tensor_bytes({"a": torch.zeros(3, dtype=torch.float32), "b": [torch.zeros(2, dtype=torch.int64)]}) == 28


def test_state_bytes_of_a_model_and_adam():
    cfg = GPTConfig(tied=True)
    model = build_model(cfg)
    n = sum(p.numel() for p in model.parameters())  # parameters() yields the tied weight once
    opt = make_optimizer(model.parameters(), "adam", 1e-3)
    x, y = make_batches(cfg, 2, 1)[0]
    lm_loss(model(x), y).backward()
    opt.step()
    held = state_bytes(model, opt)
    assert held["params"] == held["grads"] == 8 * n
    # Adam keeps m and v (8 bytes each per parameter) plus one float32 step counter per parameter tensor.
    tensors = len(list(model.parameters()))
    assert held["optimizer"] == 2 * 8 * n + tensors * 4


def test_saved_activations_grow_with_the_batch_and_exclude_parameters():
    cfg = GPTConfig()
    model = build_model(cfg)

    def saved_for(batch):
        x, _ = make_batches(cfg, batch, 1)[0]
        with saved_activations(exclude=model) as saved:
            model(x).sum()
        return saved.bytes

    small, large = saved_for(2), saved_for(4)
    assert small > 0
    assert large == pytest.approx(2 * small, rel=0.05)  # activations scale with the batch, parameters do not


def test_ledger_peak():
    ledger = MemoryLedger()
    ledger.record("a", params=10, grads=0)
    ledger.record("b", params=10, grads=10)
    ledger.record("c", params=10, grads=5)
    assert ledger.peak()["label"] == "b" and ledger.peak()["total"] == 20


def test_mesh_layout_last_axis_fastest():
    axes = {"dp": 2, "tp": 2}
    assert [mesh_coords(r, axes) for r in range(4)] == [
        {"dp": 0, "tp": 0},
        {"dp": 0, "tp": 1},
        {"dp": 1, "tp": 0},
        {"dp": 1, "tp": 1},
    ]
    assert all(mesh_rank(mesh_coords(r, axes), axes) == r for r in range(4))
    assert axis_groups(axes, "tp") == [[0, 1], [2, 3]]
    assert axis_groups(axes, "dp") == [[0, 2], [1, 3]]
    assert axis_groups({"pp": 2, "dp": 2, "tp": 2}, "dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_bad_mesh_is_rejected_before_launch():
    with pytest.raises(ValueError, match="mesh dp=2 x tp=3 = 6 ranks, but world_size=4"):
        check_mesh({"dp": 2, "tp": 3}, 4)
    with pytest.raises(ValueError, match="must be a positive int"):
        check_mesh({"dp": 0}, 4)


def test_mesh_groups_reduce_along_their_axis_only():
    def fn():
        mesh = DeviceMesh({"dp": 2, "tp": 2})
        along_tp = torch.tensor([float(dist.get_rank())])
        comm.all_reduce(along_tp, group=mesh.group("tp"))
        along_dp = torch.tensor([float(dist.get_rank())])
        comm.all_reduce(along_dp, group=mesh.group("dp"))
        return mesh.coords, along_tp.item(), along_dp.item(), mesh.ranks("tp")

    results = parlab.launch(fn, 4)
    assert [r[1] for r in results] == [1.0, 1.0, 5.0, 5.0]  # tp groups {0,1}, {2,3}
    assert [r[2] for r in results] == [2.0, 4.0, 2.0, 4.0]  # dp groups {0,2}, {1,3}
    assert results[3][3] == [2, 3]
    groups = {e.group for e in results.trace.select(kind="all_reduce")}
    assert groups == {(0, 1), (2, 3), (0, 2), (1, 3)}  # the trace says which group each call used
