"""Experts (ep, borrowed from dp x cp) and USP (cp = ulysses x ring) in the hybrid mesh: one step equal to one
device in float64 (the reference routed in the ranks' capacity groups, aux loss included), every axis' bytes by
kind equal to the theory (the ep all-to-alls to each call's split sizes), every invalid combination refused."""

from __future__ import annotations

import pytest
import torch
from cli_in_process import run_cli

from parlab.core.mesh import axis_groups
from parlab.core.moe import MoE, MoEConfig
from parlab.runs.hybrid import HybridOptions, run_hybrid
from parlab.runs.registry import run_scheme
from parlab.schemes.hybrid.experts import reference_seq_groups

MOE = {"experts": 4, "top_k": 2}

# Each combination exercises a different composition with ep or USP (4 ranks unless said).
COMBINATIONS = [
    {"dp": 2, "pp": 2, "cp": 1, "tp": 1, "ep": 2, **MOE},  # ep = dp: MoE layers inside 1F1B stages
    {"dp": 2, "pp": 1, "cp": 1, "tp": 2, "ep": 2, **MOE},  # experts replicated over tp, no tp call in their FFN
    {"dp": 2, "pp": 1, "cp": 2, "tp": 1, "ep": 2, "cp_method": "zigzag", **MOE},  # ep inside cp; edp over dp
    {"dp": 1, "pp": 2, "cp": 4, "tp": 1, "ep": 2, "cp_method": "usp", "ulysses": 2, **MOE},  # 8: USP x pp x ep
    {"dp": 1, "pp": 1, "cp": 4, "tp": 2, "cp_method": "usp", "ulysses": 2},  # 8 ranks: USP on tp's heads, dense
]


def _axes_used(o: dict) -> set[str]:
    """The axis kinds the run must use: each mesh axis > 1, the gradients' group, ep's and USP's sub-axes."""
    D, C, ep = o["dp"], o["cp"], o.get("ep", 1)
    used = {a for a in ("pp", "tp") if o[a] > 1}
    used |= {"ulysses", "ring"} if o.get("cp_method") == "usp" else ({"cp"} if C > 1 else set())
    used |= {"dp_cp" if C > 1 else "dp"} if D * C > 1 else set()
    used |= {"ep"} if ep > 1 else set()
    used |= {"edp"} if ep > 1 and D * C // ep > 1 else set()  # the experts' replicas
    return used


@pytest.mark.parametrize("options", COMBINATIONS, ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
def test_experts_and_usp_in_the_mesh_match_one_device_and_each_axis_its_theory(options):
    results, report = run_hybrid(**options, steps=1)
    assert report["passed"], report["verdicts"]
    assert report["max_abs_err"] <= 1e-10
    measured, theory = report["comm"]["per_axis_measured"], report["comm"]["per_axis_theory"]
    assert measured == theory and all(any(v) for v in theory.values())
    assert {key.split()[0] for key in theory} == _axes_used(options)
    assert report["bytes_per_rank"]["params"] == report["bytes_per_rank"]["params_theory"]
    if options.get("cp_method") == "usp":  # no call on the whole cp group: its two sub-axes carry it all
        assert not any(key.startswith("cp ") for key in theory)
        assert {"ulysses all_to_all", "ring send"} <= set(theory)
    if options.get("ep", 1) == 1:
        return
    moe = report["moe"]
    assert moe["dropped_step1"] > 0 and moe["dropped_step1"] == moe["reference"]["dropped"]  # capacity bites
    assert moe["load_step1"] == moe["reference"]["load"]
    assert "tp all_reduce" not in theory or options["tp"] > 1

    # The ep all-to-alls: the bytes each rank handed to torch.distributed on the ep axis (the trace) are the
    # theory's, and the rows they carried are every kept assignment, sent once and received once.
    traced = [0] * report["world_size"]
    for e in results.trace.events:
        if e.axis == "ep" and e.kind == "all_to_all":
            traced[e.rank] += e.bytes
    assert traced == theory["ep all_to_all"]
    opts = HybridOptions.make(**options, steps=1)
    cfg = opts.gpt_config()
    moe_layers = sum(cfg.moe.is_moe_layer(i) for i in range(cfg.layers))
    kept = opts.batch * cfg.seq_len * opts.top_k * moe_layers - moe["dropped_step1"]
    assert sum(moe["a2a_rows_per_rank"]) == 2 * kept * opts.tp  # each tp rank exchanges the same rows


def test_the_ep_and_edp_groups_cut_dp_x_cp_ep_fastest():
    axes = {"dp": 2, "pp": 1, "cp": 2, "tp": 2}
    dp_cp = axis_groups(axes, "dp", "cp")
    assert dp_cp == [[0, 2, 4, 6], [1, 3, 5, 7]]  # one group per tp rank, dp x cp in mesh order
    opts = HybridOptions.make(dp=2, cp=2, tp=2, ep=2, **MOE)
    assert opts.world_size == 8 and opts.sizes["ep"] == 2  # ep borrows ranks: the world is still dp pp cp tp


def test_the_reference_routes_in_the_cp_ranks_sequence_groups():
    """MoEConfig(seq_groups=...) routes each cp block's positions as a capacity group of its own (zigzag here)."""
    T, H = 8, 8
    blocks = reference_seq_groups(T, 2, "zigzag")
    assert blocks == ((0, 1, 6, 7), (2, 3, 4, 5))
    torch.manual_seed(0)
    x = torch.randn(2, T, H, dtype=torch.float64)
    cfg = MoEConfig(experts=4, top_k=2, capacity_factor=0.75, seq_groups=blocks)
    grouped = MoE(H, 16, cfg).double()
    one = MoE(H, 16, MoEConfig(experts=4, top_k=2, capacity_factor=0.75)).double()
    one.load_state_dict(grouped.state_dict())
    y = grouped(x)
    for block in blocks:  # each block alone through a one-group layer: the same tokens, the same drops
        pos = list(block)
        assert torch.equal(y[:, pos], one(x[:, pos]))
    assert grouped.stats["dropped"] > 0


@pytest.mark.parametrize(
    "options, message",
    [
        ({"dp": 2, "tp": 1, "ep": 2}, r"ep=2 spreads the experts of MoE layers, but the model has none"),
        ({"dp": 2, "tp": 1, "ep": 4, **MOE}, r"borrows its ranks from dp x cp = 2 x 1 = 2: ep must divide it"),
        ({"dp": 4, "tp": 1, "ep": 4, "experts": 6}, r"experts=6 is not divisible by the 4 expert-parallel ranks"),
        ({"dp": 1, "tp": 2, "sequence_parallel": True, **MOE}, r"sequence_parallel with MoE layers"),
        ({"dp": 2, "tp": 1, "ep": 2, "zero": 1, **MOE}, r"zero=1 with MoE layers: ZeRO shards one flat buffer"),
        ({"dp": 1, "cp": 4, "tp": 2, "cp_method": "usp", "ulysses": 3}, r"ulysses=3 must divide cp"),
        ({"dp": 1, "cp": 4, "tp": 2, "cp_method": "usp", "ulysses": 4}, r"heads / tp = 2 is not divisible by ulys"),
        ({"dp": 1, "cp": 2, "tp": 1, "ulysses": 2}, r"ulysses=2 splits the cp axis for cp_method usp, not 'ring'"),
        ({"dp": 2, "tp": 1, "aux_weight": -1.0, **MOE}, r"aux_weight=-1 must be in \[0, 100\]"),
    ],
)
def test_every_invalid_expert_or_usp_combination_is_refused_before_launch(options, message, monkeypatch):
    monkeypatch.setattr("parlab.runs.registry.launch", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(ValueError, match=message):
        run_scheme("hybrid", **options)


def test_usp_picks_the_largest_ulysses_the_heads_allow():
    assert HybridOptions.make(cp=4, tp=2, cp_method="usp").ulysses == 2  # heads / tp = 2: ring of 2
    assert HybridOptions.make(cp=4, tp=1, cp_method="usp").ulysses == 4  # heads 4: Ulysses alone
    assert HybridOptions.make(cp=4, tp=1).ulysses == 1


def test_zero_with_experts_on_the_command_line_is_one_error_line():
    done = run_cli("run", "hybrid", "--dp", "2", "--tp", "1", "--ep", "2", "--experts", "4", "--zero", "1")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("parlab: error: --zero 1 with MoE layers")
