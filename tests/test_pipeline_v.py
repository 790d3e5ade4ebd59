"""V-shaped pipeline schedules (parlab/schemes/pipeline/schedules_v.py): ZB-V and DualPipeV as data, against torch
2.13's orders, their exact bubbles and memory, the executor's hand-over at the tip of the V, numerics vs one device, bad
input."""

from fractions import Fraction

import pytest
from cli_in_process import run_cli
from torch.distributed.pipelining import schedules as torch_schedules

from parlab.runs.pipeline import run_pipeline
from parlab.schemes.pipeline import schedules as pp
from parlab.schemes.pipeline import schedules_v

TORCH = {"zbv": torch_schedules.ScheduleZBVZeroBubble, "dualpipev": torch_schedules.ScheduleDualPipeV}
TORCH_OPS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "BI", "BACKWARD_WEIGHT": "BW"}


def torch_order(name: str, p: int, m: int) -> list[list[pp.Action]]:
    """torch's `pipeline_order` for p ranks and m micro-batches, as our actions (chunk from torch's V mapping).

    The order is computed by the schedule class's own `_calculate_single_rank_operations` (what its __init__ calls
    for every rank), on an instance made without stages (the constructor wants real PipelineStages and a process
    group). An OVERLAP_F_B action is expanded into its sub-actions, in torch's order; None (idle) is skipped.
    """
    cls = TORCH[name]
    sched = cls.__new__(cls)
    sched.pp_group_size, sched._n_microbatches, sched.num_stages = p, m, 2 * p
    stage_to_rank = torch_schedules.generate_stage_to_rank_mapping(p, 2 * p, style="v")
    orders = []
    for rank in range(p):
        actions = []
        for a in sched._calculate_single_rank_operations(rank):
            for sub in (a.sub_actions or (a,)) if a is not None else ():
                assert stage_to_rank[sub.stage_index] == rank
                chunk = 0 if sub.stage_index < p else 1
                actions.append(pp.Action(TORCH_OPS[sub.computation_type.name], sub.microbatch_index, chunk))
        orders.append(actions)
    return orders


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
@pytest.mark.parametrize("p,m", [(4, 8), (2, 4), (3, 6), (4, 9), (4, 12), (5, 10)])
def test_orders_equal_torch_pipeline_order_action_by_action(name, p, m):
    ours = pp.make_schedule(name, p, m, 2)
    assert ours.actions == torch_order(name, p, m)
    pp.validate(ours)  # torch's order passes our checker: complete, deadlock-free, messages in order


@pytest.mark.parametrize("p,m", [(4, 2), (4, 5), (3, 3), (2, 1)])
def test_zbv_with_few_microbatches_drops_torchs_padding(p, m):
    assert pp.make_schedule("zbv", p, m, 2).actions == torch_order("zbv", p, m)
    pp.validate(pp.make_schedule("zbv", p, m, 2))


def test_torch_lists_dualpipev_steady_pairs_as_overlapped_actions():
    """The one difference of notation (schedules_v docstring): torch's steady F&B pairs are two actions here."""
    cls = TORCH["dualpipev"]
    sched = cls.__new__(cls)
    sched.pp_group_size, sched._n_microbatches, sched.num_stages = 4, 8, 8
    raw = sched._calculate_single_rank_operations(0)
    pairs = [a for a in raw if a is not None and a.sub_actions]
    assert pairs and all(
        [s.computation_type.name for s in a.sub_actions] == ["FORWARD", "FULL_BACKWARD"] for a in pairs
    )
    assert len(pp.make_schedule("dualpipev", 4, 8, 2).actions[0]) == len(raw) + len(pairs)


def test_v_layout_places_two_stages_per_rank_down_and_back_up():
    s = pp.make_schedule("zbv", 4, 8, 2)
    assert [s.stage(r, 0) for r in range(4)] == [0, 1, 2, 3]
    assert [s.stage(r, 1) for r in range(4)] == [7, 6, 5, 4]
    assert [s.rank_of(st) for st in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    # the tip of the V (stage 3 -> 4 on rank 3) sends nothing; every other hop is a message
    channels = pp.messages(s)
    assert all(src != dst for src, dst, _ in channels)
    assert len(channels[(2, 3, "act")][0]) == 8 and len(channels[(3, 2, "act")][0]) == 8  # down, then back up


def test_exact_bubbles_memory_and_formulas_at_p4_m8():
    zb = pp.bubble(pp.validate(pp.make_schedule("zb", 4, 8)), 4)
    for name, peak in [("zbv", 8), ("dualpipev", 9)]:
        s = pp.make_schedule(name, 4, 8, 2)
        ideal = pp.bubble(pp.validate(s), 4)
        formula, _ = pp.bubble_formula(name, 4, 8, 2)
        assert ideal == formula == Fraction(1, 17) < zb == Fraction(1, 9)
        # ZB-V holds 2p chunk-sized sets = p whole stages (1F1B's memory); DualPipeV one more (DualPipe's PP + 1)
        assert pp.peak_inflight(s) == [peak] * 4
    assert schedules_v.paper_idle("zbv", 4) == (0, "(p-1)(T_F+T_B-2T_W)")  # the paper's ZB-V: zero, at unit costs
    assert schedules_v.paper_idle("dualpipev", 4)[0] == 6  # DualPipe's bound with F&B = F + B: 2 (p - 1)


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
def test_closed_form_is_the_simulated_bubble_where_it_holds(name):
    for p in range(1, 7):
        for m in range(2 * p if name == "dualpipev" else 1, 2 * p + 4):
            s = pp.make_schedule(name, p, m, 2)
            ideal, (formula, _) = pp.bubble(pp.validate(s), p), pp.bubble_formula(name, p, m, 2)
            if schedules_v.formula_holds(name, p, m):
                assert ideal == formula, (name, p, m)


# ------------------------------------------------------------------------------------------------ bad input

BASE = {"world_size": 4, "dtype": "float64", "steps": 1, "seed": 0}


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"schedule": "zbv", "virtual": 3, "layers": 12}, "needs exactly 2 stages per rank in a V"),
        ({"schedule": "zbv", "virtual": 1, "world_size": 3, "batch": 8}, r"v=1 gives 3 stages"),
        ({"schedule": "dualpipev", "microbatches": 4, "batch": 8}, r"needs microbatches >= 2 x stages: m=4 < 2p=8"),
        ({"schedule": "zbv", "layers": 4}, "layers=4 < stages x virtual = 4 x 2 = 8"),
    ],
)
def test_bad_input_is_rejected_before_launch(changes, message, monkeypatch):
    import parlab.runs.registry

    monkeypatch.setattr(parlab.runs.registry, "launch", lambda *a, **k: pytest.fail("launched despite bad input"))
    with pytest.raises(ValueError, match=message):
        parlab.runs.registry.run_scheme("pp", **{**BASE, **changes})


def test_cli_prints_one_error_line():
    out = run_cli("run", "pp", "--schedule", "dualpipev", "--microbatches", "4")
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("parlab: error:") and "m=4 < 2p=8" in lines[0], out.stderr


# --------------------------------------------------------------------------------- real ranks vs one device


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
def test_a_training_step_equals_one_device(name):
    results, report = run_pipeline(name, 4, 8, steps=1, batch=8)
    assert report["passed"], "\n".join(report["verdicts"])
    assert report["max_abs_err"] <= 1e-10
    assert report["bubble_ideal_fraction"] == report["bubble_formula_fraction"] == "1/17"
    # the executor held exactly what the schedule says, and sent exactly the schedule's messages (none at the tip)
    assert (
        report["peak_inflight_per_rank"]
        == report["peak_inflight_ideal_per_rank"]
        == pp.peak_inflight(pp.make_schedule(name, 4, 8, 2))
    )
    assert report["comm"]["send"] == report["comm"]["theory_send_bytes_per_rank"]
    assert report["layers_per_stage"] == [1] * 8
    if name == "zbv":  # ZB-V splits every backward: one BW span per (micro-batch, chunk) and step
        assert results.trace.count_per_rank("backward_weight") == [8 * 2] * 4
        assert results.trace.count_per_rank("backward") == [0] * 4
    else:  # DualPipeV: full backwards in the steady state, split ones in the fill and the drain
        assert all(n > 0 for n in results.trace.count_per_rank("backward"))
        assert all(n > 0 for n in results.trace.count_per_rank("backward_weight"))
