"""Benchmark: training steps per second of naive DP, bucketed DP and torch DDP, measured side by side in one run.

    python benchmarks/bench_dp.py                    # world sizes 2 and 4, two model shapes
    python benchmarks/bench_dp.py --worlds 4 --repeats 3

For each world size, ONE launch builds the three trainers on every rank (same model, same data) and times them in
turns: repeat 1 runs naive, bucketed, DDP; repeat 2 bucketed, DDP, naive; ... so that a slow moment of a shared
machine hits all three alike. A time is rank 0's wall clock between two barriers around `--steps` steps; the figure
printed is the median over repeats. Two models: the reference GPT (2 blocks, 37 parameter tensors) and a deep
narrow one (12 blocks, 197 tensors), where naive DP pays one collective's latency per tensor and bucketing should
win. Only ratios measured in the same run mean anything; absolute steps/s depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch.distributed as dist

import parlab
from parlab.core.models import GPTConfig, build_model, lm_loss, make_batches, make_optimizer
from parlab.schemes import data_parallel as dp

MODELS = {
    "reference GPT, 2 blocks (37 tensors)": {"layers": 2, "hidden": 32},
    "deep GPT, 12 blocks (197 tensors)": {"layers": 12, "hidden": 32},
}
MODES = ("naive DP", "bucketed DP", "torch DDP")


def make_trainer(mode: str, cfg: GPTConfig, bucket_bytes: int):
    """One rank's step function for `mode`: forward, backward, gradient all-reduce, SGD step on its rows."""
    from torch.nn.parallel import DistributedDataParallel

    model = build_model(cfg, seed=0)
    if mode == "torch DDP":
        model = DistributedDataParallel(model, bucket_cap_mb=bucket_bytes / 2**20)
    opt = make_optimizer(model.parameters(), "sgd", 0.1)
    bucketed = dp.BucketedDP(model, bucket_bytes) if mode == "bucketed DP" else None

    def step(x, y):  # x, y: this rank's rows [b, T]
        opt.zero_grad(set_to_none=True)
        lm_loss(model(x), y).backward()
        if mode == "naive DP":
            dp.all_reduce_gradients(model)
        elif mode == "bucketed DP":
            bucketed.finish()
        opt.step()

    return step


def bench_rank(model_opts: dict, batch: int, steps: int, repeats: int, bucket_bytes: int, dtype: str) -> dict:
    """Rank code: time `steps` steps of each trainer, `repeats` times, rotating the order. Returns seconds."""
    P, rank = dist.get_world_size(), dist.get_rank()
    cfg = GPTConfig(dtype=dtype, **model_opts)
    batches = [dp.shard_batch(x, y, rank, P) for x, y in make_batches(cfg, batch, steps, seed=0)]
    trainers = {mode: make_trainer(mode, cfg, bucket_bytes) for mode in MODES}
    for step in trainers.values():  # warm-up: first-call costs stay out of the timings
        step(*batches[0])
    seconds = {mode: [] for mode in MODES}
    for rep in range(repeats):
        order = MODES[rep % 3 :] + MODES[: rep % 3]
        for mode in order:
            dist.barrier()  # untraced bookkeeping: start together
            started = time.perf_counter()
            for x, y in batches:
                trainers[mode](x, y)
            dist.barrier()  # the slowest rank decides when a step is done
            seconds[mode].append(time.perf_counter() - started)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--batch", type=int, default=16, help="global batch")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-bytes", type=int, default=dp.DEFAULT_BUCKET_BYTES)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    args = parser.parse_args()

    print(f"global batch {args.batch}, {args.dtype}, {args.steps} steps x {args.repeats} repeats (median),")
    print(f"bucket {args.bucket_bytes} bytes; steps/s measured side by side in one launch per row\n")
    header = f"{'model':38s} {'P':>2s} " + " ".join(f"{m:>12s}" for m in MODES)
    print(header + f" {'bucketed/DDP':>13s} {'bucketed/naive':>15s}")
    for world in args.worlds:
        for name, model_opts in MODELS.items():
            results = parlab.launch(
                bench_rank,
                world,
                model_opts,
                args.batch,
                args.steps,
                args.repeats,
                args.bucket_bytes,
                args.dtype,
                echo=False,
                timeout=1800,
            )
            rate = {m: args.steps / statistics.median(results[0][m]) for m in MODES}
            row = f"{name:38s} {world:2d} " + " ".join(f"{rate[m]:12.1f}" for m in MODES)
            ratio_ddp = rate["bucketed DP"] / rate["torch DDP"]
            ratio_naive = rate["bucketed DP"] / rate["naive DP"]
            print(row + f" {ratio_ddp:12.2f}x {ratio_naive:14.2f}x", flush=True)
    print("\nsteps/s per trainer; ratios > 1 mean bucketed DP is faster. Noisy on a shared machine: rerun to compare.")


if __name__ == "__main__":
    main()
