"""Pipeline parallelism: schedules (validity, exact bubbles, phases, memory), numerics vs one device, bad input, CLI."""

import json
import subprocess
import sys
from fractions import Fraction

import pytest
from cli_in_process import run_cli

from parlab.lessons import pipeline as lesson
from parlab.runs.pipeline import phase_lines, run_pipeline
from parlab.schemes.pipeline import executor as pipeline
from parlab.schemes.pipeline import schedules as pp
from parlab.schemes.pipeline.actions import Action, Schedule
from parlab.schemes.pipeline.schedules import ScheduleError

# --------------------------------------------------------------------------------------------- partitioning


def test_split_layers_even_and_explicit():
    assert pipeline.split_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert pipeline.split_layers(8, 4, [3, 2, 2, 1]) == [range(0, 3), range(3, 5), range(5, 7), range(7, 8)]
    with pytest.raises(ValueError, match="not divisible"):
        pipeline.split_layers(6, 4)
    with pytest.raises(ValueError, match="adds up to 7"):
        pipeline.split_layers(8, 4, [2, 2, 2, 1])
    with pytest.raises(ValueError, match="3 entries"):
        pipeline.split_layers(8, 4, [4, 2, 2])


def test_stages_hold_exactly_the_reference_parameters():
    from parlab.core.models import GPTConfig, build_model

    cfg = GPTConfig(layers=4)
    model = build_model(cfg)
    ranges = pipeline.split_layers(4, 2)
    stages = [pipeline.Stage(model, s, 2, ranges[s]) for s in range(2)]
    names = [set(st.named) for st in stages]
    assert names[0].isdisjoint(names[1])
    assert names[0] | names[1] == {n for n, _ in model.named_parameters()}
    assert "wte.weight" in names[0] and "lm_head.weight" in names[1] and "blocks.2.ln1.weight" in names[1]


# ---------------------------------------------------------------------------------------- schedules as data

CASES = [(p, m) for p in (1, 2, 3, 4, 5) for m in range(p, 2 * p + 3)]


@pytest.mark.parametrize("p,m", CASES)
def test_every_schedule_is_valid_and_its_ideal_bubble_is_the_formula_exactly(p, m):
    for name, v in [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("zb", 1)]:
        if name == "interleaved" and m % p:
            continue
        schedule = pp.make_schedule(name, p, m, v)
        timeline = pp.validate(schedule)  # complete, deadlock-free, messages received in the order sent
        assert len(timeline) == sum(len(a) for a in schedule.actions)
        ideal = pp.bubble(timeline, p)
        formula, _ = pp.bubble_formula(name, p, m, v)
        assert isinstance(ideal, Fraction) and ideal == formula, (name, p, m, v, ideal, formula)
    if p > 1:
        assert pp.bubble(pp.simulate(pp.gpipe(p, m)), p) == Fraction(p - 1, m + p - 1)


def test_done_when_figures_at_p4_m8():
    bubbles = {
        name: pp.bubble(pp.validate(pp.make_schedule(name, 4, 8, lesson.chunks(name))), 4) for name in pp.SCHEDULES
    }
    assert bubbles["gpipe"] == bubbles["1f1b"] == Fraction(3, 11)
    assert bubbles["interleaved"] == Fraction(3, 19) < bubbles["1f1b"]
    assert bubbles["zb"] == Fraction(1, 9) < bubbles["interleaved"]
    assert bubbles["zbv"] == bubbles["dualpipev"] == Fraction(1, 17) < bubbles["zb"]


def test_ideal_timeline_respects_every_dependency():
    for name, v in [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1)]:
        schedule = pp.make_schedule(name, 4, 8, v)
        timeline = pp.simulate(schedule)
        end = {pp._key(schedule, t.rank, t.action): t.end for t in timeline}
        for t in timeline:
            op, mb, s = pp._key(schedule, t.rank, t.action)
            if op in ("B", "BI"):
                end[("G", mb, s)] = end[(op, mb, s)]
        by_rank = {}
        for t in timeline:
            for dep in pp.dependencies(schedule, t.rank, t.action):
                assert end[dep] <= t.start, (name, t, dep)
            assert t.start >= by_rank.get(t.rank, 0)  # one action at a time, in the listed order
            by_rank[t.rank] = t.end
        assert [t.action for t in sorted(timeline, key=lambda t: t.start) if t.rank == 0] == schedule.actions[0]


def test_validate_rejects_incomplete_deadlocking_and_misordered_schedules():
    good = pp.one_f_one_b(2, 2)
    missing = Schedule("x", 2, 2, 1, [good.actions[0][:-1], good.actions[1]])
    with pytest.raises(ScheduleError, match="needs one F and one B"):
        pp.validate(missing)
    # the last rank runs its backward before the forward it needs: nothing can ever start it
    stuck = Schedule("x", 2, 2, 1, [good.actions[0], [Action("B", 0), Action("F", 0), Action("F", 1), Action("B", 1)]])
    with pytest.raises(ScheduleError, match="deadlocks"):
        pp.validate(stuck)
    # rank 1 takes micro-batch 1 before 0: it would receive micro-batch 0's activation as micro-batch 1's
    swapped = Schedule(
        "x", 2, 2, 1, [good.actions[0], [Action("F", 1), Action("B", 1), Action("F", 0), Action("B", 0)]]
    )
    with pytest.raises(ScheduleError, match="in the order"):
        pp.validate(swapped)


def test_phases_warmup_counts():
    p, m = 4, 8
    for r, ph in enumerate(pp.phases(pp.one_f_one_b(p, m))):
        w = p - 1 - r
        assert ph["warmup"].get("F", 0) == w and ph["cooldown"].get("B", 0) == w
        assert ph["steady"] == {"F": m - w, "B": m - w}
    for ph in pp.phases(pp.gpipe(p, m)):
        assert ph == {"warmup": {"F": m - 1}, "steady": {"F": 1, "B": 1}, "cooldown": {"B": m - 1}}
    v = 2
    for megatron, extra in [(False, 1), (True, 2)]:
        schedule = pp.interleaved_1f1b(p, m, v, megatron)
        pp.validate(schedule)
        for r, ph in enumerate(pp.phases(schedule)):
            assert ph["warmup"]["F"] == (v - 1) * p + extra * (p - 1 - r)
    assert phase_lines(pp.one_f_one_b(p, m))[0] == "rank 0: warm-up 3 F | steady 5 F + 5 B | cool-down 3 B"


def test_peak_inflight_from_the_schedules():
    p, m = 4, 8
    assert pp.peak_inflight(pp.gpipe(p, m)) == [m] * p
    assert pp.peak_inflight(pp.one_f_one_b(p, m)) == [p - r for r in range(p)]
    assert max(pp.peak_inflight(pp.zero_bubble_h1(p, m))) <= p  # H1: 1F1B's memory
    # interleaved: (micro-batch, chunk) units of 1/v stage each; the minimal warm-up holds no more than 1F1B
    assert max(pp.peak_inflight(pp.interleaved_1f1b(p, m, 2))) == 2 * p
    assert max(pp.peak_inflight(pp.interleaved_1f1b(p, m, 2, megatron_warmup=True))) > 2 * p


# ------------------------------------------------------------------------------------------------ bad input

BASE = {"world_size": 4, "dtype": "float64", "steps": 1, "seed": 0}


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"layers": 6}, "layers=6 is not divisible by stages x virtual = 4 x 1"),
        ({"schedule": "interleaved", "layers": 4}, "layers=4 < stages x virtual = 4 x 2 = 8"),
        ({"schedule": "1f1b", "microbatches": 2, "batch": 4}, "needs microbatches >= stages"),
        ({"schedule": "zb", "microbatches": 3, "batch": 6}, "needs microbatches >= stages"),
        ({"schedule": "interleaved", "microbatches": 6, "batch": 12}, "multiple of stages"),
        ({"microbatches": 5}, "batch=16 is not divisible by microbatches=5"),
        ({"schedule": "gpipe", "virtual": 2}, "only to the interleaved"),
        ({"schedule": "nope"}, "unknown schedule"),
        ({"split": [2, 2, 2]}, "3 entries"),
        ({"layers": 2}, "every stage needs at least one block"),
        ({"layers": 4, "split": [2, 2, 0, 0]}, "every stage needs at least one block"),
    ],
)
def test_bad_input_is_rejected_before_launch(changes, message, monkeypatch):
    import parlab.runs.registry

    def no_launch(*args, **kwargs):
        raise AssertionError("launched despite bad input")

    monkeypatch.setattr(parlab.runs.registry, "launch", no_launch)
    with pytest.raises(ValueError, match=message):
        parlab.runs.registry.run_scheme("pp", **{**BASE, **changes})


# --------------------------------------------------------------------------------- real ranks vs one device


RUNS = {
    "gpipe": ("gpipe", 4, 4, {}),
    "1f1b": ("1f1b", 4, 4, {}),
    "interleaved": ("interleaved", 4, 4, {}),
    "zb, uneven split": ("zb", 4, 4, {"split": [3, 2, 2, 1]}),
    "interleaved v=3 float32": ("interleaved", 2, 2, {"virtual": 3, "layers": 6, "dtype": "float32"}),
}


@pytest.fixture(scope="module")
def runs():
    """Each case once on real ranks (2 steps of SGD): {name: (results, report)}."""
    return {name: run_pipeline(s, p, m, steps=2, batch=8, **extra) for name, (s, p, m, extra) in RUNS.items()}


@pytest.mark.parametrize("name", list(RUNS))
def test_numerics_match_single_device(runs, name):
    schedule, p, m, extra = RUNS[name]
    results, report = runs[name]
    assert report["passed"], "\n".join(report["verdicts"])
    assert report["max_abs_err"] <= (1e-10 if extra.get("dtype", "float64") == "float64" else 1e-5)
    # the executor held exactly what the schedule says
    assert report["peak_inflight_per_rank"] == report["peak_inflight_ideal_per_rank"]
    assert all(b > 0 for b in report["peak_activation_bytes_per_rank"])
    assert report["bubble_ideal_fraction"] == report["bubble_formula_fraction"]
    assert 0 < report["bubble_measured"] < 1
    if schedule == "gpipe":
        assert report["peak_inflight_per_rank"] == [m] * p
    if schedule in ("1f1b", "zb"):
        assert report["peak_inflight_microbatches"] <= p
    if schedule == "zb":  # the weight gradients really ran as spans of their own, one per micro-batch and step
        assert results.trace.count_per_rank("backward_weight") == [m * 2] * p
        assert results.trace.count_per_rank("backward") == [0] * p


def test_gpipe_holds_more_activation_bytes_than_1f1b(runs):
    gpipe, one_f = runs["gpipe"][1], runs["1f1b"][1]
    # rank 2 of 4 with m=4: GPipe holds 4 micro-batches, 1F1B p - r = 2; the measured bytes halve
    # (both runs split the layers evenly, so each micro-batch's activations are the same size in both)
    assert gpipe["peak_activation_bytes_per_rank"][2] == 2 * one_f["peak_activation_bytes_per_rank"][2]


def test_timeline_figure_has_both_panels_and_microbatch_labels():
    results, report = run_pipeline("1f1b", 2, 2, steps=1, batch=4, layers=2)
    fig = lesson.timelines(pp.make_schedule("1f1b", 2, 2), results.trace)
    names = {t.name for t in fig.data}
    assert {"forward", "backward"} <= names
    for panel in ("y", "y2"):  # every span of both panels carries its micro-batch number
        for t in fig.data:
            if t.yaxis == panel and t.name in ("forward", "backward"):
                assert sorted(t.text) == ["0", "0", "1", "1"], (panel, t.name, t.text)
    axes = {t.yaxis for t in fig.data}
    assert axes == {"y", "y2"}  # ideal on top, measured below
    assert "bubble 1/3" in fig.layout.annotations[0].text


def test_bubble_table_lists_every_schedule_from_its_ideal_timeline():
    lines = lesson.bubble_table(4, 8, v=2)
    rows = {line.split()[0]: line for line in lines[2:]}
    assert list(rows) == list(pp.SCHEDULES)
    assert "3/11" in rows["gpipe"] and "3/19" in rows["interleaved"] and "1/9" in rows["zb"]
    assert "1/17" in rows["zbv"] and rows["zbv"].endswith("8 (= 4 stages of activations)")
    assert rows["dualpipev"].endswith("9 (= 9/2 stages of activations)")  # DualPipe's PP + 1
    assert lesson.v_formula_lines(4, 8)[2:] == [
        "zbv             3  (p-1)(T_F+T_B-2T_W) = 0",
        "dualpipev       3  (PP/2-1)(F&B+B-3W) = 6",
    ]
    assert rows["interleaved"].endswith("8 (= 4 stages of activations)")  # 8 (micro-batch, chunk) units, v = 2
    assert "needs microbatches >= stages" in lesson.bubble_table(4, 2)[3]  # 1F1B refuses m < p, with the reason


def test_the_scheme_module_does_not_import_plotly():
    code = "import sys, parlab.schemes.pipeline.executor; assert not [m for m in sys.modules if m.startswith('plotly')]"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---------------------------------------------------------------------------------------------------- CLI


def test_cli_json_gpipe():
    out = run_cli("run", "pp", "--world", "4", "--schedule", "gpipe", "--microbatches", "8", "--steps", "1", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["passed"] is True
    assert report["bubble_ideal"] == 3 / 11 and report["bubble_ideal_fraction"] == "3/11"
    assert report["bubble_formula"] == 3 / 11
    assert report["peak_inflight_microbatches"] == 8
    assert 0 < report["bubble_measured"] < 1
