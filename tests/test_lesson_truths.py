"""What the lessons say is what the library does: the offload lesson's host bytes (lesson 06), the parameter
server's updates applied and gradients received (lesson 08), what Ulysses' all-to-alls count (lesson 04), the two
byte counts, payload and wire, that every lesson names (lesson 00, used in 01-08), lesson 08's exercise that no
longer prints its answer, and the closing links to the labs. Each figure is measured on live ranks or read from the
stored notebook outputs, and compared with the formula the lesson states."""

import json
from pathlib import Path

import pytest
import torch

from parlab import launch
from parlab.core.models import GPTConfig, build_model, make_batches
from parlab.lessons import collectives as bytes_lesson
from parlab.lessons import parameter_server as ps_lesson
from parlab.lessons import sequence_parallel as sp_lesson
from parlab.runs.collectives import run_ring
from parlab.runs.parameter_server import run_ps
from parlab.runs.zero import run_zero
from parlab.schemes.parameter_server import ps_theory
from parlab.schemes.sequence.sequence_parallel import wire_bytes as sp_wire_bytes
from parlab.schemes.zero.offload import train_offload
from parlab.schemes.zero.stages import plan_units
from parlab.schemes.zero.theory import offload_memory

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def _cells(name: str) -> list[dict]:
    return json.loads((NOTEBOOKS / name).read_text())["cells"]


def _source(cell: dict) -> str:
    return "".join(cell["source"])


def _stdout(cell: dict) -> str:
    return "".join("".join(o.get("text", "")) for o in cell.get("outputs", []) if o.get("name") == "stdout")


def _cell_with(cells: list[dict], text: str) -> dict:
    found = [c for c in cells if text in _source(c)]
    assert len(found) == 1, (text, len(found))
    return found[0]


# --------------------------------------------------------------- lesson 06: what the host holds, mixed precision

TINY = GPTConfig(vocab_size=32, seq_len=8, hidden=16, heads=2, layers=2, dtype="float32")  # fp32 master weights


def _mixed_precision_offload(target: str) -> dict:
    """Rank code: ZeRO-2 with Adam's state on `target`, fp32 master weights and a bf16 compute copy."""
    batches = make_batches(TINY, 4, 2, 0)
    out = train_offload(build_model(TINY, 0), batches, target=target, compute_dtype=torch.bfloat16)
    return {"steady": out["steady"], "units": out["units"]}


@pytest.fixture(scope="module")
def mixed_precision_cpu():
    return launch(_mixed_precision_offload, 2, "cpu", echo=False)


def test_offload_host_holds_fp32_gradients_beside_master_m_v(mixed_precision_cpu):
    """Lesson 06's table: with b_c = 2 (bf16) and b_m = 4 (fp32), the host holds b_m S of gradients (fp32, not the
    paper's fp16) beside 3 b_m S of master, m, v; the device b_c N S of parameters; and the copy to the host moves
    the reduce-scatter's b_c S bytes, converted to fp32 on arrival."""
    results = mixed_precision_cpu
    N = 2
    S = sum(u.shard_numel for u in plan_units(build_model(TINY), N))
    formula = offload_memory([u.numel for u in plan_units(build_model(TINY), N)], N, "cpu", b_c=2, b_m=4)
    assert formula["S"] == S
    for rank in results:
        host = {k: v for k, v in rank["steady"]["host"].items() if v}
        assert host == {"grads": 4 * S, "optimizer": 12 * S} == formula["steady"]["host"]  # 16 bytes per number
        device = {k: v for k, v in rank["steady"]["device"].items() if v}
        assert device == {"params": 2 * N * S} == formula["steady"]["device"]
    steps = 2
    copied = [sum(e.bytes for e in results.trace.select(kind="offload", rank=r)) / steps for r in range(N)]
    assert copied == [2 * S] * N  # b_c S per step crosses to the host; the host keeps it as b_m S


def test_offload_lesson_states_the_library_figures_and_the_papers():
    cells = _cells("06_offload.ipynb")
    table = "".join(_source(c) for c in cells[:3])  # the opening, on three slides
    assert table.count("b_m S$ grads") == 3 and "$b_c S$" in table  # every target: fp32 gradient shard
    assert "14\\Psi" in table and "16\\Psi" in table  # the paper's count beside parlab's
    psi = 10_000_000_000
    cpu = offload_memory([psi], 1, "cpu", 2, 4)["steady_total"]
    assert cpu == {"device": 2 * psi, "host": 16 * psi, "disk": 0}
    printed = _stdout(_cell_with(cells, "offload_memory([psi], 1, target, 2, 4)"))
    assert "cpu : device 20 GB, host 160 GB, disk 0 GB" in printed
    assert "the paper's cpu: device 20 GB, host 140 GB" in printed
    closing = _source(cells[-1])
    assert "14\\Psi$ of the paper's $16\\Psi" in closing and "its host holds $16\\Psi$" in closing


# ----------------------------------------------------------- lesson 08: updates applied vs gradients received


def test_sync_server_applies_k_updates_from_n_x_k_gradients():
    P, K = 4, 3
    N = P - 1
    results, report = run_ps(P, "sync", steps=K, dp=False)
    assert report["passed"], report["verdicts"]
    assert report["updates_applied"] == K and len(report["updates"]) == N * K
    assert f"sync: updates applied by the server (K): measured {K} = theory {K}: PASS" in report["verdicts"]
    assert (
        f"sync: gradients received by the server (N x K): measured {N * K} = theory {N * K}: PASS" in report["verdicts"]
    )
    # Measured independently: the server's optimizer spans and the parameter versions it went through.
    assert len(results.trace.select(kind="optimizer", rank=0)) == K
    assert len(report["eval_losses"]) == K + 1  # theta_0 .. theta_K
    assert len(results.trace.select(kind="recv", rank=0)) == N * K  # every gradient received


def test_async_server_applies_every_gradient_it_receives():
    P, K = 3, 2
    N = P - 1
    results, report = run_ps(P, "async", steps=K, dp=False)
    assert report["passed"], report["verdicts"]
    assert report["updates_applied"] == len(report["updates"]) == N * K
    assert (
        f"async: updates applied by the server (N x K): measured {N * K} = theory {N * K}: PASS" in report["verdicts"]
    )
    assert len(results.trace.select(kind="optimizer", rank=0)) == N * K


def test_lesson_08_prints_both_counts():
    printed = _stdout(_cell_with(_cells("08_parameter_server.ipynb"), 'run_ps(P, "sync", steps=STEPS'))
    assert "sync: updates applied by the server (K): measured 20 = theory 20: PASS" in printed
    assert "sync: gradients received by the server (N x K): measured 60 = theory 60: PASS" in printed


# ------------------------------------------------------------------------ lesson 08: an exercise, not an answer


def test_lesson_08_exercise_keeps_its_answer_until_asked():
    G, N, K = 240640, 5, 3
    theory = ps_theory(G, N + 1, K)["theory_server_bytes"] // G
    assert theory == N * (2 * K + 1) == 35
    report = {"grad_bytes": G, "server_bytes": 35 * G, "worker_bytes": [7 * G] * N, "workers": N, "steps": K}
    assert "right" in ps_lesson.check_prediction(35, report)
    wrong = ps_lesson.check_prediction(30, report)
    assert "not what the server" in wrong and "35" not in wrong  # a wrong guess does not get the answer
    assert "No prediction yet" in ps_lesson.check_prediction(None, report)
    assert "35 x G" in ps_lesson.exercise_answer(report) and "2K+1" in ps_lesson.exercise_answer(report)
    cells = _cells("08_parameter_server.ipynb")
    start = cells.index(_cell_with(cells, "## Exercise"))
    exercise = cells[start : start + 4]
    assert "my_prediction = None" in _source(exercise[1])
    assert "reveal = False" in _source(exercise[3])
    for cell in exercise:  # the stored outputs, what a student sees before running anything
        assert "x G" not in _stdout(cell), _stdout(cell)


# ------------------------------------------------------------------- lesson 04: what Ulysses' all-to-alls count


def test_ulysses_makes_4_all_to_alls_forward_and_4_backward_per_attention_call():
    results = sp_lesson.attention_demo("ulysses", 4)  # one attention call, forward and backward
    labels = [e.label for e in results.trace.select(kind="all_to_all", rank=0)]
    assert sorted(labels) == sorted(f"{t} {d}" for t in ("q", "k", "v", "out") for d in ("fwd", "bwd"))
    cells = _cells("04_sequence_parallel.ipynb")
    table = _source(_cell_with(cells, "## Three ways to split the sequence"))
    assert "forward: 4 all-to-alls (q, k, v in; the output back); backward: 4 more" in table and "8 in all" in table
    assert "2 all-to-alls" not in table
    theory = _source(_cell_with(cells, "## Measured bytes beside the theory"))
    assert "8 all-to-alls per layer: q, k, v and the output forward, their 4 gradients backward" in theory
    printed = _stdout(_cell_with(cells, 'for method in ("megatron-sp", "ulysses"):'))
    assert "ulysses: all-to-alls per step (q, k, v, out; forward and backward; per layer): measured 16 = theory 16" in (
        printed
    )  # 8 per layer x L = 2 layers


# ----------------------------------------------------------------- lesson 00: payload and wire, and their uses


def test_ring_wire_bytes_follow_from_the_payload():
    for P in (2, 3, 4, 8):
        N = 8 * 24 * P  # bytes, divisible by P
        for kind in ("all_reduce", "reduce_scatter", "all_gather"):
            payload = N // P if kind == "all_gather" else N
            assert bytes_lesson.wire_bytes(kind, payload, P) == sp_wire_bytes(kind, payload, P)
        # an all-reduce is a reduce-scatter of the payload and an all-gather of the shard
        assert bytes_lesson.wire_bytes("all_reduce", N, P) == bytes_lesson.wire_bytes(
            "reduce_scatter", N, P
        ) + bytes_lesson.wire_bytes("all_gather", N // P, P)
        assert bytes_lesson.wire_bytes("all_to_all", N, P) == (P - 1) * N // P  # the piece for itself stays
        assert bytes_lesson.wire_bytes("send", N, P) == N
    with pytest.raises(ValueError, match="no ring formula"):
        bytes_lesson.wire_bytes("broadcast", 32, 4)


@pytest.mark.parametrize("P", [3, 4])
def test_measured_ring_sends_the_wire_bytes_of_its_payload(P):
    """Lesson 00's ring all-reduce, built from send/recv: the bytes it sends (measured) are the wire bytes of the
    all-reduce's payload."""
    _, report = run_ring(P, numel=96)
    assert report["comm"]["send"] == [bytes_lesson.wire_bytes("all_reduce", report["tensor_bytes"], P)] * P


def test_lesson_00_table_of_both_counts():
    lines = bytes_lesson.bytes_table(4)
    rows = {line.split()[0]: line for line in lines[1:]}
    assert "32 (every rank)" in rows["all_reduce"] and rows["all_reduce"].endswith("2(P-1)/P x payload = 48")
    assert "8 (every rank)" in rows["all_gather"] and rows["all_gather"].endswith("(P-1) x payload = 24")
    assert rows["reduce_scatter"].endswith("(P-1)/P x payload = 24")
    assert rows["all_to_all"].endswith("(P-1)/P x payload = 24")
    printed = _stdout(_cell_with(_cells("00_collectives.ipynb"), "collectives.bytes_table(P)"))
    assert printed.strip().split("\n") == lines


def test_zero_wire_bytes_sum_to_one_all_reduce():
    """Lesson 05: a reduce-scatter of payload 2 Psi and an all-gather of payload 2 Psi / N each put (N-1)/N x 2 Psi
    on the wire: together what DP's all-reduce of 2 Psi sends; stage 3 gathers twice, 1.5x."""
    P, psi = 4, 30080
    for stage, ratio in ((1, 1.0), (3, 1.5)):
        _, rep = run_zero(P, stage=stage, mixed_precision=True, steps=1, reference=False)
        c = rep["comm"]
        rs, ag = c["reduce_scatter_per_step"][0], c["all_gather_per_step"][0]
        assert rs == 2 * psi and ag == (2 if stage == 3 else 1) * 2 * psi / P  # payloads
        wire = bytes_lesson.wire_bytes("reduce_scatter", rs, P) + bytes_lesson.wire_bytes("all_gather", ag, P)
        assert wire == c["wire_bytes_per_step"][0] == ratio * bytes_lesson.wire_bytes("all_reduce", 2 * psi, P)
    printed = _stdout(_cell_with(_cells("05_zero.ipynb"), 'wire_bytes("reduce_scatter", rs, P)'))
    assert "stage 1: payload: reduce-scatter 60,160 B, all-gather 15,040 B per step" in printed
    assert "on the wire: reduce-scatter 45,120 B + all-gather 45,120 B = 90,240 B sent per step" in printed
    assert "on the wire: reduce-scatter 45,120 B + all-gather 90,240 B = 135,360 B sent per step" in printed


def test_every_lesson_names_its_byte_counts():
    cells = _cells("00_collectives.ipynb")
    definition = _source(_cell_with(cells, "## Two ways to count bytes"))
    assert "**payload**" in definition and "**wire**" in definition
    for name in ("01_data_parallel", "02_tensor_parallel", "03_pipeline_parallel", "04_sequence_parallel",
                 "05_zero", "07_hybrid", "08_parameter_server"):  # fmt: skip
        text = "\n".join(_source(c) for c in _cells(f"{name}.ipynb"))
        assert "00_collectives.ipynb#Two-ways-to-count-bytes" in text, name
        assert "payload" in text and "wire" in text, name


# ----------------------------------------------------------------------------------- the closing links to labs


@pytest.mark.parametrize(
    "notebook, lab",
    [
        ("06_offload", "lab06_offload"),
        ("07_hybrid", "lab07_hybrid"),
        ("08_parameter_server", "lab08_parameter_server"),
        ("10_pytorch_twins", "lab10_pytorch_twins"),
    ],
)
def test_closing_cell_links_its_lab(notebook, lab):
    closing = _source(_cells(f"{notebook}.ipynb")[-1])
    assert f"**Lab:** [`labs/{lab}.ipynb`](../labs/{lab}.ipynb)" in closing
    assert f"pytest --nbval labs/{lab}.ipynb" in closing


def test_the_course_ends_with_the_bug_hunt():
    link = "[`labs/lab_bug_hunt.ipynb`](../labs/lab_bug_hunt.ipynb)"
    assert link in _source(_cells("08_parameter_server.ipynb")[-1])
    assert link in _source(_cells("00_collectives.ipynb")[-1])
