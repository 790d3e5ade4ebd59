"""How long does it take to start ranks? parlab.launch (warm rank server) vs torch.multiprocessing.spawn.

Both run the same job, side by side in one run: 4 ranks, each initialises torch.distributed (gloo) and does one
all_reduce. Prints the median times and their ratio.

    python benchmarks/bench_launch.py [--world 4] [--repeats 7]

It also times parlab.launch from inside a Jupyter kernel (where students call it), unless --no-kernel, and the
first launch of a lesson: in a fresh kernel, `import parlab`, wait 5 s (a student reading the first cells), then
one 4-rank launch, which must take <= 0.5 s because the import started the rank server in the background.

    python benchmarks/bench_launch.py --first-launch-only     # just that figure

Run as a script, `spawn` starts fresh interpreters that import torch (and this file) in each rank; parlab's rank
server imported torch once and forks the ranks.
"""

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import parlab


def one_all_reduce() -> float:
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _spawned_rank(rank: int, world_size: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    one_all_reduce()
    dist.destroy_process_group()


def time_spawn(world_size: int) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.perf_counter()
    mp.spawn(_spawned_rank, args=(world_size, port), nprocs=world_size)
    return time.perf_counter() - started


def time_parlab(world_size: int) -> float:
    started = time.perf_counter()
    assert parlab.launch(one_all_reduce, world_size) == [float(world_size)] * world_size
    return time.perf_counter() - started


KERNEL_CODE = """
import statistics, time, torch, torch.distributed as dist, parlab
def one_all_reduce():
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()
parlab.launch(one_all_reduce, {world})  # the first launch in this kernel starts the rank server
times = []
for _ in range({repeats}):
    started = time.perf_counter()
    parlab.launch(one_all_reduce, {world})
    times.append(time.perf_counter() - started)
print(f"{{statistics.median(times):.3f}} {{min(times):.3f}} {{max(times):.3f}}")
"""


FIRST_LAUNCH_CODE = """
import time
started = time.perf_counter()
import parlab  # in a kernel, this starts the rank server in the background
imported = time.perf_counter() - started
time.sleep({wait})
import torch, torch.distributed as dist
def one_all_reduce():
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()
started = time.perf_counter()
parlab.launch(one_all_reduce, {world})
print(f"{{imported:.3f}} {{time.perf_counter() - started:.3f}}")
"""


def _in_fresh_kernel(code: str) -> list[float]:
    """Run `code` in a fresh Jupyter kernel; return the numbers it printed last."""
    from jupyter_client.manager import start_new_kernel

    env = {k: v for k, v in os.environ.items() if k != "PARLAB_WARM"}  # the default behaviour in a kernel
    manager, client = start_new_kernel(kernel_name="python3", env=env)
    try:
        out = []
        client.execute_interactive(
            code,
            timeout=600,
            output_hook=lambda msg: out.append(msg["content"].get("text", "")) if msg["msg_type"] == "stream" else None,
        )
        return [float(x) for x in "".join(out).split()]
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def time_in_kernel(world_size: int, repeats: int) -> list[float]:
    """Median, min and max of warm launches timed inside a fresh Jupyter kernel."""
    return _in_fresh_kernel(KERNEL_CODE.format(world=world_size, repeats=repeats))[-3:]


def time_first_launch_in_kernel(world_size: int, wait: float) -> tuple[float, float]:
    """In a fresh kernel: seconds to import parlab, then (after `wait` s) seconds of the first launch."""
    imported, first = _in_fresh_kernel(FIRST_LAUNCH_CODE.format(world=world_size, wait=wait))[-2:]
    return imported, first


FIRST_LAUNCH_TARGET = 0.5  # seconds (issue 17)


def report_first_launch(world_size: int, wait: float = 5.0) -> bool:
    imported, first = time_first_launch_in_kernel(world_size, wait)
    verdict = "PASS" if first <= FIRST_LAUNCH_TARGET else "FAIL"
    load = os.getloadavg()[0]  # other processes' load: on 2 cores, a load of 8 makes every figure 3-5x slower
    print(
        f"fresh kernel: import parlab {imported:.3f} s, wait {wait:g} s, first {world_size}-rank launch: "
        f"{first:.3f} s (target <= {FIRST_LAUNCH_TARGET} s): {verdict}  [load average {load:.1f}]"
    )
    return first <= FIRST_LAUNCH_TARGET


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--no-kernel", action="store_true", help="skip the measurements inside a Jupyter kernel")
    parser.add_argument("--first-launch-only", action="store_true", help="only the first launch in a fresh kernel")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.first_launch_only:
        raise SystemExit(0 if report_first_launch(args.world) else 1)
    cold = time_parlab(args.world)  # the first launch starts the rank server
    parlab_times, spawn_times = [], []
    for _ in range(args.repeats):  # interleaved, so both see the same machine load
        parlab_times.append(time_parlab(args.world))
        spawn_times.append(time_spawn(args.world))
    p, s = statistics.median(parlab_times), statistics.median(spawn_times)
    print(f"world size {args.world}, {args.repeats} runs each, one all_reduce per rank, {os.cpu_count()} CPU cores")
    print(f"parlab.launch, first (starts the rank server): {cold:.3f} s")
    spread = lambda times: f"(min {min(times):.3f}, max {max(times):.3f})"  # noqa: E731
    print(f"parlab.launch, warm, median:                   {p:.3f} s  {spread(parlab_times)}")
    print(f"torch.multiprocessing.spawn, median:           {s:.3f} s  {spread(spawn_times)}")
    print(f"spawn / parlab.launch: {s / p:.1f}x")
    if not args.no_kernel:
        k, k_min, k_max = time_in_kernel(args.world, args.repeats)
        print(f"parlab.launch in a Jupyter kernel, warm, median: {k:.3f} s  (min {k_min:.3f}, max {k_max:.3f})")
        print(f"spawn (script) / parlab.launch (kernel): {s / k:.1f}x")
        report_first_launch(args.world)


if __name__ == "__main__":
    main()
