"""Measured timelines with and without an emulated device and link (parlab.core.pace), side by side in one run.

    python benchmarks/bench_pace.py                 # p = 4, m = 8 pipelines and DP at world 4
    python benchmarks/bench_pace.py --repeats 3     # the median of 3 runs of each

Pipelines: the measured bubble of gpipe, 1f1b, interleaved (v = 2) and zb, unpaced and paced, beside the ideal
bubble (exact, from the schedule's simulation with unit costs F = 1, B = 2, BI = BW = 1, communication free). The
paced runs use F = 50 ms and a fast link (alpha 0.1 ms, 1 GB/s): the ideal assumes free communication.
Data parallel at world 4: the fraction of all-reduce time hidden under backward (bucketed DP), unpaced and paced
with the default link (alpha 1 ms, 50 MB/s). Unpaced, 4 ranks share this machine's cores, so the measured times
mostly measure waiting for a core.
"""

from __future__ import annotations

import argparse
import os
import statistics

from parlab.core.trace import Trace
from parlab.runs.data_parallel import run_dp
from parlab.runs.pipeline import run_pipeline

PIPELINE_PACE = "unit=50ms,alpha=0.1ms,bandwidth=1GB/s"
DP_PACE = "default"


def hidden_fraction(trace: Trace) -> float:
    """Of the time the all-reduces were in flight (each rank, each bucket), the share a backward span covered."""
    hidden = total = 0.0
    for rank in range(trace.world_size):
        backward = trace.select(kind="backward", rank=rank)
        for e in trace.select(kind="all_reduce", rank=rank):
            total += e.duration
            for b in backward:
                hidden += max(0.0, min(e.end, b.end) - max(e.start, b.start))
    return hidden / total if total else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}\n")

    print(f"Pipeline bubble, p = 4, m = 8 (paced: {PIPELINE_PACE})")
    print(f"{'schedule':12s} {'ideal':>7s} {'unpaced':>9s} {'paced':>7s} {'paced - ideal':>14s}")
    paced_order, ideal_order = [], []
    for schedule in ("gpipe", "1f1b", "interleaved", "zb"):
        rows = {}
        for pace in ("", PIPELINE_PACE):
            runs = [run_pipeline(schedule, 4, 8, steps=2, pace=pace)[1] for _ in range(args.repeats)]
            rows[pace] = statistics.median(r["bubble_measured"] for r in runs)
            ideal = runs[0]["bubble_ideal"]
        paced_order.append((rows[PIPELINE_PACE], schedule))
        ideal_order.append((ideal, schedule))
        delta = (rows[PIPELINE_PACE] - ideal) * 100
        print(f"{schedule:12s} {ideal:7.1%} {rows['']:9.1%} {rows[PIPELINE_PACE]:7.1%} {delta:+11.1f} pp")
    ideal, paced = dict((s, b) for b, s in ideal_order), dict((s, b) for b, s in paced_order)
    same = all(paced[a] < paced[b] for a in ideal for b in ideal if ideal[a] < ideal[b])  # ties may go either way
    print(f"paced bubbles in the ideal's order (ties in the ideal excepted): {same}\n")

    print(f"Data parallel, world 4, bucketed (paced: {DP_PACE}): share of all-reduce time hidden under backward")
    for pace in ("", DP_PACE):
        runs = [run_dp(4, steps=3, pace=pace, ddp=False)[0] for _ in range(args.repeats)]
        fraction = statistics.median(hidden_fraction(r.trace.of_step(2)) for r in runs)
        print(f"{'paced' if pace else 'unpaced':8s} {fraction:6.1%}")


if __name__ == "__main__":
    main()
