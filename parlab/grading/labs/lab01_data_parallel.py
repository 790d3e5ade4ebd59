"""Lab 01's checks: the student's batch sharding, gradient averaging, bucketed all-reduce overlapped with backward
and gradient accumulation, on live ranks (see parlab/grading/__init__.py for the scheme).

Every check compares with one device training on the whole batch (float64, 1e-10), and verifies from what the
ranks did how they communicated: the bytes each rank handed to torch.distributed (parlab.core.probe), which
all-reduces started while backward was still computing gradients (the check's own gradient hooks, registered
before the student's, note how many calls had been made when each gradient arrived), and which were still in
flight when backward returned (parlab.core.comm's record of every asynchronous call and of when it was waited for).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import parlab
from parlab.core import comm, probe
from parlab.core.check import check_equal, compare
from parlab.core.models import (
    GPTConfig,
    build_model,
    lm_loss,
    make_batches,
    make_optimizer,
    param_bytes,
    train_single_device,
)
from parlab.grading.labs import prediction_lines, run_check
from parlab.schemes.data_parallel import plan_buckets, train_data_parallel
from parlab.schemes.data_parallel import shard_batch as library_shard

LAUNCH = {"timeout": 60, "echo": False}  # a hang (a collective some rank never calls) stops after 60 s
CFG = GPTConfig()  # the reference GPT: 2 layers, hidden 32, float64
B, STEPS = 8, 3  # global batch rows and steps of BATCHES (parts 1 and 2)
BATCHES = make_batches(CFG, B, STEPS, seed=0)  # [(x, y)], x, y: [B, T] token ids
BUCKET_BYTES = 64 * 1024  # the bucket plan of parts 3 and 4 (lesson 01's default)
PLAN = plan_buckets(build_model(CFG), BUCKET_BYTES)  # [[parameter name]], bucket 0 first
DP_RANKS = 2  # parts 3 and 4
ACC_B, ACC_STEPS, ACC_M = 10, 2, 3  # part 4: B = 10 on 2 ranks, b = 5 rows in M = 3 micro-batches of 2, 2, 1
ACC_BATCHES = make_batches(CFG, ACC_B, ACC_STEPS, seed=1)
TRAFFIC = {"P": 4, "M": 3, "B": 24}  # the prediction: ranks, micro-batches, global batch (b = 6: 2 rows each)

STRUCTURAL = {
    "shard": "the rows of the 4 ranks, in rank order, are exactly the global batch; B=6 on 4 ranks raises ValueError",
    "average": "each rank all-reduces exactly one copy of the gradients (bytes counted at the process group)",
    "overlap": "one all-reduce per bucket of the plan, in bucket order, nothing else; at least one started before "
    "backward had computed the last gradient; some still in flight (asynchronous, through parlab.core.comm) when "
    "backward returned, and none after finish(); the averaged gradients match one device",
    "step_traffic": "the predicted all-reduce calls and payload bytes per rank per step (P=4, M=3) against the "
    "theory and against the library's bucketed DP measured at the process group; the ring's wire bytes against "
    "the theory (all within 5%)",
    "training": "2 steps on 2 ranks with 3 uneven micro-batches: the loss and every parameter match one device; on "
    "every rank and step: 3 backward passes, no all-reduce before the last one began, the plan's bucket "
    "all-reduces once, none still in flight at the optimizer step",
}


def run(check: str, *answers) -> None:
    """A check cell: see parlab.grading."""
    run_check(__name__, check, *answers)


def bucket_bytes(plan: list[list[str]] = PLAN) -> list[int]:
    """Bytes of each bucket's gradients, bucket 0 first."""
    sizes = {n: p.numel() * p.element_size() for n, p in build_model(CFG).named_parameters()}
    return [sum(sizes[n] for n in names) for names in plan]


class GradientWatch:
    """The check's own gradient hooks, registered before anyone else's: at each gradient's arrival during backward,
    it notes how many calls into torch.distributed the rank had made so far (`calls`: the probe's record)."""

    def __init__(self, model: torch.nn.Module):
        self.calls: list | None = None
        self.arrivals: list[int] = []  # one entry per gradient arrival: len(calls) at that moment
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self._arrived)

    def _arrived(self, param: torch.Tensor) -> None:
        self.arrivals.append(len(self.calls) if self.calls is not None else 0)


def _in_flight(first_event: int) -> int:
    """All-reduces issued through parlab.core.comm since event `first_event` and not waited for yet."""
    events = comm.trace_events()[first_event:]
    return sum(1 for e in events if e.kind == "all_reduce" and e.end is None)


def _plain_calls(calls) -> list[dict]:
    return [{"op": c["op"], "bytes": int(c["bytes"])} for c in calls]


# ------------------------------------------------------------------------------------------ 1 · the rows


def _run_shard(shard, x, y) -> dict:
    x_r, y_r = shard(x, y, dist.get_rank(), dist.get_world_size())
    return {"x": x_r, "y": y_r}


def collect_shard(shard_batch) -> dict:
    x, y = BATCHES[0]
    results = parlab.launch(_run_shard, 4, shard_batch, x, y, **LAUNCH)
    try:
        shard_batch(x[:6], y[:6], 0, 4)
        raises = False
    except ValueError:
        raises = True
    return {"ranks": list(results), "raises_on_uneven": raises}


def judge_shard(data) -> list[str]:
    ranks, (x, y) = data["ranks"], BATCHES[0]
    return [
        compare("x rows of ranks 0..3, concatenated", torch.cat([res["x"] for res in ranks]), x).line,
        compare("y rows of ranks 0..3, concatenated", torch.cat([res["y"] for res in ranks]), y).line,
        check_equal("rows on each rank (the fewest)", min(len(res["x"]) for res in ranks), B // 4).line,
        f"B=6 on 4 ranks raises ValueError: {'PASS' if data['raises_on_uneven'] is True else 'FAIL'}",
    ]


# ------------------------------------------------------------------------------------- 2 · the average


def _run_average(average, x, y) -> dict:
    world, r = dist.get_world_size(), dist.get_rank()
    model = build_model(CFG, seed=0)
    x_r, y_r = library_shard(x, y, r, world)  # [B/P, T]: this check does not depend on your shard_batch
    lm_loss(model(x_r), y_r).backward()
    with probe.recording(keep_sent_data=False) as calls:
        average(model)
    return {"grads": {n: p.grad for n, p in model.named_parameters()}, "calls": calls}


def collect_average(average_gradients) -> dict:
    return {"ranks": list(parlab.launch(_run_average, 4, average_gradients, *BATCHES[0], **LAUNCH))}


def judge_average(data) -> list[str]:
    ranks = data["ranks"]
    reference = train_single_device(CFG, BATCHES[:1], seed=0).grads  # the whole batch on one device
    lines = [compare(f"rank {r}: gradients after averaging", ranks[r]["grads"], reference).line for r in range(4)]
    grad_bytes = param_bytes(build_model(CFG))
    for r in range(4):
        sent = probe.total_bytes(ranks[r]["calls"], "allreduce")
        lines.append(check_equal(f"rank {r}: bytes all-reduced (one copy of the gradients)", sent, grad_bytes).line)
    return lines


# --------------------------------------------------------------------------- 3 · buckets during backward


def _run_overlap(overlapped_dp, batch) -> dict:
    world, r = dist.get_world_size(), dist.get_rank()
    model = build_model(CFG, seed=0)
    watch = GradientWatch(model)  # registered before your hooks: it sees each gradient arrive first
    dp = overlapped_dp(model, PLAN)
    x_r, y_r = library_shard(*batch, r, world)  # [b, T]
    loss = lm_loss(model(x_r), y_r)
    with probe.recording(keep_sent_data=False) as calls:
        watch.calls, first_event = calls, len(comm.trace_events())
        loss.backward()
        in_flight = _in_flight(first_event)  # the moment backward returns
        dp.finish()
        left = _in_flight(first_event)
        traced = sum(1 for e in comm.trace_events()[first_event:] if e.kind == "all_reduce")
    return {
        "grads": {n: p.grad for n, p in model.named_parameters()},
        "calls": _plain_calls(calls),
        "before_last_gradient": watch.arrivals[-1] if watch.arrivals else 0,
        "in_flight_after_backward": in_flight,
        "in_flight_after_finish": left,
        "traced": traced,  # all-reduces made through parlab.core.comm (the only ones whose wait is seen)
    }


def collect_overlap(overlapped_dp) -> dict:
    return {"ranks": list(parlab.launch(_run_overlap, DP_RANKS, overlapped_dp, BATCHES[0], **LAUNCH))}


def _bucket_verdict(label: str, calls, expected: list[int]) -> str:
    ops = [c["op"] for c in calls]
    sizes = [int(c["bytes"]) for c in calls if c["op"] == "allreduce"]
    what = f"{label}: one all-reduce per bucket, in bucket order, nothing else"
    if set(ops) <= {"allreduce"} and sizes == expected:
        return f"{what}: PASS"
    others = sorted(set(ops) - {"allreduce"})
    found = f"all-reduces of {sizes} bytes" + (f", and {others}" if others else "")
    return f"{what}: found {found}: FAIL"


def judge_overlap(data) -> list[str]:
    ranks = data["ranks"]
    reference = train_single_device(CFG, BATCHES[:1], seed=0).grads
    expected = bucket_bytes()
    lines = [compare(f"rank {r}: gradients after finish()", ranks[r]["grads"], reference).line for r in range(DP_RANKS)]
    for r in range(DP_RANKS):
        res = ranks[r]
        lines.append(_bucket_verdict(f"rank {r}", res["calls"], expected))
        what = f"rank {r}: an all-reduce started before backward computed the last gradient"
        early = int(res["before_last_gradient"])
        lines.append(f"{what}: PASS" if early >= 1 else f"{what}: found none: FAIL")
        what = f"rank {r}: all-reduces in flight when backward returned, none after finish()"
        flying, left = int(res["in_flight_after_backward"]), int(res["in_flight_after_finish"])
        ok = flying >= 1 and left == 0
        found = f"found {flying} in flight, then {left}"
        if int(res.get("traced", 1)) == 0:
            found += " (none made through parlab.core.comm, the only all-reduces whose wait is seen)"
        lines.append(f"{what}: PASS" if ok else f"{what}: {found}: FAIL")
    return lines


# ------------------------------------------------------------------ the prediction: one step's traffic


def _run_library_step(batches, microbatches: int) -> dict:
    model = build_model(CFG, seed=0)
    opt = make_optimizer(model.parameters(), "sgd", 0.1)
    with probe.recording(keep_sent_data=False) as calls:
        train_data_parallel(model, opt, batches, bucket_bytes=BUCKET_BYTES, microbatches=microbatches)
    return {"calls": _plain_calls(calls)}


def _number(value):
    """A prediction as plain data for the grader: a float if it is a number, else its repr (which FAILs)."""
    try:
        return float(value.item() if hasattr(value, "item") else value) if not isinstance(value, bool) else repr(value)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return repr(value)[:40]


def collect_step_traffic(allreduce_calls, allreduce_bytes, ring_wire_bytes) -> dict:
    world, m = TRAFFIC["P"], TRAFFIC["M"]
    batches = make_batches(CFG, TRAFFIC["B"], 1, seed=2)  # one optimizer step
    rank0 = parlab.launch(_run_library_step, world, batches, m, **LAUNCH)[0]
    allreduces = [c for c in rank0["calls"] if c["op"] == "allreduce"]
    return {
        "predicted": [_number(allreduce_calls), _number(allreduce_bytes), _number(ring_wire_bytes)],
        "measured": [float(len(allreduces)), float(sum(c["bytes"] for c in allreduces))],
    }


def judge_step_traffic(data) -> list[str]:
    world, m = TRAFFIC["P"], TRAFFIC["M"]
    calls, payload, wire = data["predicted"]
    measured_calls, measured_bytes = data["measured"]
    grad_bytes = param_bytes(build_model(CFG))
    case = f"P={world}, M={m}, per rank per step"
    lines = prediction_lines(f"{case}: all-reduce calls", calls, len(PLAN), measured_calls)
    lines += prediction_lines(f"{case}: bytes handed to all_reduce", payload, grad_bytes, measured_bytes)
    lines += prediction_lines(f"{case}: bytes on the wire (ring)", wire, 2 * (world - 1) / world * grad_bytes)
    return lines


# ----------------------------------------------------------------------- 4 · gradient accumulation


def train_accumulating(overlapped_dp, accumulation_step, batches, microbatches: int, lr: float = 0.1) -> dict:
    """Rank code: data parallelism with your OverlappedDP and your accumulation_step, SGD on every rank."""
    world, r = dist.get_world_size(), dist.get_rank()
    model = build_model(CFG, seed=0)  # the same weights on every rank
    watch = GradientWatch(model)  # the check's: when each gradient arrives (one arrival per parameter per backward)
    dp = overlapped_dp(model, PLAN)
    opt = make_optimizer(model.parameters(), "sgd", lr)
    losses, steps = [], []
    with probe.recording(keep_sent_data=False) as calls:
        watch.calls = calls
        for x, y in batches:
            x_r, y_r = library_shard(x, y, r, world)  # [b, T]: this rank's rows
            opt.zero_grad()
            first_call, first_arrival, first_event = len(calls), len(watch.arrivals), len(comm.trace_events())
            losses.append(float(accumulation_step(model, dp, x_r, y_r, microbatches)))
            steps.append(
                {
                    "calls": _plain_calls(calls[first_call:]),
                    "arrivals": [n - first_call for n in watch.arrivals[first_arrival:]],
                    "in_flight": _in_flight(first_event),  # at the optimizer step
                }
            )
            opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": torch.tensor(losses, dtype=torch.float64), "params": params, "steps": steps}


def collect_training(overlapped_dp, accumulation_step) -> dict:
    args = (overlapped_dp, accumulation_step, ACC_BATCHES, ACC_M)
    return {"ranks": list(parlab.launch(train_accumulating, DP_RANKS, *args, **LAUNCH))}


def judge_training(data) -> list[str]:
    ranks = data["ranks"]
    reference = train_single_device(CFG, ACC_BATCHES, seed=0, lr=0.1)
    mean_loss = torch.stack([res["losses"] for res in ranks]).mean(dim=0)  # each rank's loss is over its b rows
    losses = torch.tensor(reference.losses, dtype=torch.float64)
    lines = [compare("loss of each step, averaged over ranks", mean_loss, losses).line]
    for r in range(DP_RANKS):
        what = f"rank {r}'s parameters after {ACC_STEPS} steps"
        lines.append(compare(what, ranks[r]["params"], reference.params).line)
    n_params, expected = len(reference.params), bucket_bytes()
    for r in range(DP_RANKS):
        steps = ranks[r]["steps"]
        what = f"rank {r}, every step: {ACC_M} backward passes, no all-reduce before the last one began"
        found = []
        for k, step in enumerate(steps):
            arrivals = step["arrivals"]
            if len(arrivals) != ACC_M * n_params:
                found.append(f"step {k}: {len(arrivals) / n_params:g} backward passes")
            elif arrivals[(ACC_M - 1) * n_params] != 0:
                found.append(f"step {k}: {arrivals[(ACC_M - 1) * n_params]} calls before the last backward")
        lines.append(f"{what}: PASS" if not found else f"{what}: found {'; '.join(found)}: FAIL")
        what = f"rank {r}, every step: one all-reduce per bucket, in bucket order, nothing else"
        wrong = []
        for k, step in enumerate(steps):
            verdict = _bucket_verdict("", step["calls"], expected)
            if verdict.endswith(": FAIL"):
                wrong.append(f"step {k}: " + verdict.removesuffix(": FAIL").split(": found ", 1)[-1])
        lines.append(f"{what}: PASS" if not wrong else f"{what}: found {'; '.join(wrong)}: FAIL")
        flying = [int(step["in_flight"]) for step in steps]
        what = f"rank {r}, every step: every all-reduce waited for before the optimizer step"
        lines.append(f"{what}: PASS" if not any(flying) else f"{what}: found {flying} still in flight: FAIL")
    return lines
