"""Sharded checkpoints (parlab.schemes.faults.checkpoint): each rank saves only what it holds; the state loads back on
another world size or mesh (ZeRO-3 on 4 -> ZeRO-3 on 2 and plain DP on 1; TP 2 x DP 2 -> TP 4) exactly, training
continued after a reload equals training never interrupted (float64, 1e-10), and the reshard agrees with PyTorch's own
torch.distributed.checkpoint (dcp.save / dcp.load of FSDP2 state dicts) on the same run."""

import json

import pytest
import torch

from parlab.core import comm
from parlab.core.check import max_abs_error
from parlab.core.models import GPTConfig, build_model, lm_loss, make_batches, make_optimizer, train_single_device
from parlab.runs import checkpoint as runs_ckpt
from parlab.runtime.launcher import launch
from parlab.schemes.faults import checkpoint as ckpt
from parlab.schemes.faults.failures import FaultPlan, resumable_rank
from parlab.schemes.tensor_parallel import TensorParallelGPT

CFG = GPTConfig(vocab_size=32, seq_len=8, hidden=16, heads=2, layers=2, dtype="float64")
LR = 1e-3
TP_CFG = GPTConfig(vocab_size=32, seq_len=8, hidden=16, heads=4, layers=2, dtype="float64")  # 4 heads: TP 4
SAVED_AT = 3  # the checkpoint is taken after 3 steps; training continues to 6


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """ZeRO-3 on 4 ranks and FSDP2 on 4 ranks train the same 3 steps; each saves its own checkpoint."""
    root = str(tmp_path_factory.mktemp("ckpt"))
    batches = make_batches(CFG, 8, 6, 0)
    ours = launch(runs_ckpt.zero_save_rank, 4, CFG, batches[:SAVED_AT], root, lr=LR, echo=False)
    launch(runs_ckpt.dcp_save_rank, 4, CFG, batches[:SAVED_AT], root, lr=LR, echo=False)
    return root, batches, ours


def dp_state_rank(root: str) -> dict:
    """Rank code: plain DP (torch Adam) loads a checkpoint; returns its whole state by checkpoint name."""
    model = build_model(CFG)
    opt = make_optimizer(model.parameters(), "adam", LR)
    ckpt.load_dp(ckpt.Reader(ckpt.latest(f"{root}/parlab")), model, opt)
    state = {f"model.{n}": p.detach().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        state.update({f"optim.{n}.{k}": opt.state[p][k] for k in ckpt.ADAM_STATES})
    return state


def test_each_rank_saves_its_shard_and_the_metadata_says_who_held_what(saved):
    root, _, ours = saved
    folder = ckpt.latest(f"{root}/parlab")
    meta = json.loads((folder / "metadata.json").read_text())
    assert meta["world_size"] == 4 and meta["layout"] == "zero-3" and meta["extra"]["optimizer_step"] == SAVED_AT
    for name, entry in meta["tensors"].items():  # the pieces of every tensor tile it exactly, no overlap
        covered = sorted(tuple(p["flat"]) for p in entry["pieces"])
        assert covered[0][0] == 0 and covered[-1][1] == torch.Size(entry["shape"]).numel(), name
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:], strict=False)), name
    total = sum(b["bytes"] for b in ours)
    psi = sum(t.numel() for n, t in ours[0]["state"].items() if n.startswith("model."))
    assert total == 3 * psi * 8  # master, m, v in float64: every element saved once, by one rank
    assert max(b["bytes"] for b in ours) <= total / 4 * 1.05  # each rank ~1/4 (padding aside)


def test_zero3_on_4_loads_on_zero3_on_2_and_dp_on_1_identically(saved):
    root, _, ours = saved
    on_two = launch(runs_ckpt.zero_load_rank, 2, CFG, root, lr=LR, echo=False)
    on_one = launch(dp_state_rank, 1, root, echo=False)
    assert max_abs_error(on_two[0], ours[0]["state"])[0] == 0.0  # a reshard moves bytes, it computes nothing
    assert max_abs_error(on_two[1], ours[0]["state"])[0] == 0.0
    assert max_abs_error(on_one[0], ours[0]["state"])[0] == 0.0


def test_training_continued_after_a_reshard_equals_training_never_interrupted(saved):
    root, batches, _ = saved
    single = train_single_device(CFG, batches, 0, "adam", LR)  # 6 steps, never interrupted
    plan = FaultPlan(f"{root}/parlab", every=0, resume=True)
    zero2 = launch(resumable_rank, 2, "zero", CFG, batches, plan, optimizer="adam", lr=LR, stage=3, echo=False)
    dp1 = launch(resumable_rank, 1, "dp", CFG, batches, plan, optimizer="adam", lr=LR, echo=False)
    for results in (zero2, dp1):
        assert results[0]["start"] == SAVED_AT
        assert max_abs_error(results[0]["params"], single.params)[0] <= 1e-10
        losses = [sum(r["losses"][k] for r in results) / len(results) for k in range(6 - SAVED_AT)]  # global mean
        assert max_abs_error(losses, single.losses[SAVED_AT:])[0] <= 1e-10
    assert zero2[0]["bytes_read"] < 0.6 * dp1[0]["bytes_read"]  # a ZeRO rank reads its shard, DP everything


def test_the_reshard_matches_torch_distributed_checkpoint(saved):
    """FSDP2 saved on 4 ranks with dcp.save, loaded on 2 with dcp.load: the same tensors as parlab's reshard.
    (They differ by the last bits of 3 Adam steps computed by two implementations, not by the reshard.)"""
    root, _, _ = saved
    ours = launch(runs_ckpt.zero_load_rank, 2, CFG, root, lr=LR, echo=False)
    theirs = launch(runs_ckpt.dcp_load_rank, 2, CFG, root, lr=LR, echo=False)
    assert set(ours[0]) == set(theirs[0])
    assert max_abs_error(ours[0], theirs[0])[0] <= 1e-10


def test_an_incomplete_checkpoint_is_never_loaded(tmp_path):
    (tmp_path / "step-000002").mkdir()
    (tmp_path / "step-000002" / "metadata.json").write_text("{}")
    (tmp_path / "step-000004").mkdir()  # a rank died while saving: pieces, no metadata
    (tmp_path / "step-000004" / "rank0.pt").write_bytes(b"")
    assert ckpt.latest(tmp_path).name == "step-000002"


# ---------------------------------------------------------------------------------------- TP 2 x DP 2 -> TP 4


def tp_rank(batches, root: str, tp: int, resume: bool) -> dict:
    """Rank code: TP over `tp` ranks x DP over the rest (rank = dp * tp + t), Adam; trains `batches` (the first
    SAVED_AT then saves, or loads and trains the rest); returns this rank's slices and split dims."""
    P, rank = comm.group_size(), comm.group_rank()
    dp = P // tp
    tp_groups = [torch.distributed.new_group([d * tp + t for t in range(tp)]) for d in range(dp)]
    dp_groups = [torch.distributed.new_group([d * tp + t for d in range(dp)]) for t in range(tp)]
    d, t = divmod(rank, tp)
    model = TensorParallelGPT(build_model(TP_CFG), group=tp_groups[d])
    opt = make_optimizer(model.parameters(), "adam", LR)
    if resume:
        ckpt.load_tp(ckpt.Reader(ckpt.latest(root)), model, opt)
    todo = batches[SAVED_AT:] if resume else batches[:SAVED_AT]
    for x, y in todo:
        b = x.shape[0] // dp
        loss = model.loss(x[d * b : (d + 1) * b], y[d * b : (d + 1) * b])
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():  # the data-parallel mean over replicas holding the same slice
            comm.all_reduce(p.grad, group=dp_groups[t], label="dp grads")
            p.grad /= dp
        opt.step()
    if not resume:
        pieces = ckpt.tp_pieces(model, opt, t, holder=d == 0)
        ckpt.save(root, SAVED_AT, pieces, layout=f"tp{tp}xdp{dp}", extra={"optimizer_step": ckpt.optimizer_step(opt)})
    return {n: (p.detach().clone(), p.tp_split_dim) for n, p in model.named_parameters()}


def test_tp2_x_dp2_saved_loads_on_tp4_and_trains_on_like_one_device(tmp_path):
    batches = make_batches(TP_CFG, 8, 6, 0)
    launch(tp_rank, 4, batches, str(tmp_path), 2, False, echo=False)
    meta = json.loads((ckpt.latest(tmp_path) / "metadata.json").read_text())
    assert {p["rank"] for e in meta["tensors"].values() for p in e["pieces"]} == {0, 1}  # dp replica 0 saves
    results = launch(tp_rank, 4, batches, str(tmp_path), 4, True, echo=False)
    full = {}
    for name, (_, dim) in results[0].items():
        parts = [r[name][0] for r in results]
        full[name] = parts[0] if dim is None else torch.cat(parts, dim)
    single = train_single_device(TP_CFG, batches, 0, "adam", LR)
    assert max_abs_error(full, single.params)[0] <= 1e-10


def test_the_loss_after_a_reload_is_the_loss_before(tmp_path):
    """A reload restores the function, not only the numbers: the same loss on the same batch."""
    batches = make_batches(CFG, 4, 1, 0)
    model = build_model(CFG, seed=3)
    opt = make_optimizer(model.parameters(), "sgd", 0.1)
    launch(_save_dp, 1, model, str(tmp_path), echo=False)
    fresh = build_model(CFG, seed=0)
    ckpt.load_dp(ckpt.Reader(ckpt.latest(tmp_path)), fresh, opt)
    x, y = batches[0]
    assert lm_loss(fresh(x), y).item() == lm_loss(model(x), y).item()


def _save_dp(model, root):
    opt = make_optimizer(model.parameters(), "sgd", 0.1)
    ckpt.save(root, 1, ckpt.dp_pieces(model, opt), layout="dp", extra={"optimizer_step": 0})


# ------------------------------------------------------------------------------------------- PP 2 stages -> DP 1


def pp_save_rank(batches, root: str) -> None:
    """Rank code: a 2-stage 1F1B pipeline (one block each, Adam) trains SAVED_AT steps; each rank saves its stage."""
    from parlab.schemes.pipeline.executor import build_stages, train_pipeline
    from parlab.schemes.pipeline.schedules import make_schedule

    schedule = make_schedule("1f1b", 2, 2)
    stages = build_stages(build_model(CFG), schedule, comm.group_rank())
    optimizer = make_optimizer([w for s in stages.values() for w in s.named.values()], "adam", LR)
    train_pipeline(schedule, stages, optimizer, batches[:SAVED_AT])
    pieces = ckpt.pp_pieces(stages, optimizer)
    ckpt.save(root, SAVED_AT, pieces, layout="pp2", extra={"optimizer_step": ckpt.optimizer_step(optimizer)})


def test_pipeline_stages_saved_on_2_ranks_load_into_one_replica_and_train_on(tmp_path):
    batches = make_batches(CFG, 8, 6, 0)
    launch(pp_save_rank, 2, batches, str(tmp_path), echo=False)
    meta = json.loads((ckpt.latest(tmp_path) / "metadata.json").read_text())
    holders = {name: [p["rank"] for p in e["pieces"]] for name, e in meta["tensors"].items()}
    assert holders["model.wte.weight"] == [0] and holders["model.lm_head.weight"] == [1]  # each its own stage
    plan = FaultPlan(str(tmp_path), every=0, resume=True)
    dp1 = launch(resumable_rank, 1, "dp", CFG, batches, plan, optimizer="adam", lr=LR, echo=False)
    single = train_single_device(CFG, batches, 0, "adam", LR)
    assert dp1[0]["start"] == SAVED_AT and max_abs_error(dp1[0]["params"], single.params)[0] <= 1e-10
