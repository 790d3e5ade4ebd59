"""How long does it take to start ranks? parlab.launch beside the other ways to run rank code from a notebook.

Every launcher runs the same job, in one run (so the ratios share the machine's load): N ranks, each initialises
torch.distributed (gloo) and does one all_reduce. Prints medians and ratios:

    parlab.launch with spares (the default in a Jupyter kernel: the rank server prepares the next launch's ranks
        while the notebook goes on; a 0.5 s pause, untimed, stands for the student between two cells), 4 and 8 ranks;
        and back to back (no pause: the spares are not all ready)
    parlab.launch without spares (the default in scripts and tests: ranks forked at the launch)
    torch.multiprocessing.spawn (fresh interpreters that import torch)
    accelerate's notebook_launcher (forks this process; elastic rendezvous)        if accelerate is importable
    nbdistributed's %%distributed cell, per cell (persistent workers in a kernel)   if nbdistributed is importable

    python benchmarks/bench_launch.py [--repeats 15] [--spawn-repeats 5] [--no-kernel]

Targets (issue 28): 4 ranks <= 0.08 s, 8 ranks <= 0.12 s, <= 10 ms per extra rank, <= 0.75x nbdistributed's cell.

It also times parlab.launch from inside a Jupyter kernel (where students call it), unless --no-kernel, and the
first launch of a lesson: in a fresh kernel, `import parlab`, wait 5 s (a student reading the first cells), then
one 4-rank launch, which must take <= 0.5 s because the import started the rank server in the background.

    python benchmarks/bench_launch.py --first-launch-only     # just that figure
"""

import argparse
import os
import socket
import statistics
import subprocess
import sys
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


THINK = 0.5  # seconds between two parlab launches (not timed): a student's time between two cells, at the least


def time_parlab(world_size: int, spares: bool, think: float = THINK) -> float:
    os.environ["PARLAB_SPARES"] = "1" if spares else "0"
    time.sleep(think)
    started = time.perf_counter()
    assert parlab.launch(one_all_reduce, world_size) == [float(world_size)] * world_size
    return time.perf_counter() - started


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ACCELERATE_CODE = """
import contextlib, io, os, socket, statistics, time
import torch, torch.distributed as dist
from accelerate import notebook_launcher

def rank():
    dist.init_process_group("gloo")  # from the environment notebook_launcher sets
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()

def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])

times = []
for _ in range({repeats} + 1):  # the first one is not counted (imports)
    time.sleep(0.2)
    started = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # it prints "Launching training on N CPUs."
        notebook_launcher(rank, num_processes={world}, use_port=port())
    times.append(time.perf_counter() - started)
print("TIMES", statistics.median(times[1:]), min(times[1:]), max(times[1:]))
"""


def time_accelerate(world_size: int, repeats: int) -> list[float]:
    """Median, min and max seconds of accelerate's notebook_launcher, in a process of its own: it forks the
    process it runs in, which must not be one with parlab's threads (a forked copy of a lock held by another
    thread hangs the ranks; seen here)."""
    result = subprocess.run(
        [sys.executable, "-c", ACCELERATE_CODE.format(world=world_size, repeats=repeats)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-2000:])
    return [float(x) for x in result.stdout.split("TIMES")[-1].split()]


NBDISTRIBUTED_CODE = """
import statistics, time
ip = get_ipython()
ip.run_line_magic("load_ext", "nbdistributed")
ip.run_line_magic("dist_init", "-n {world}")
cell = "t = torch.ones(1)\\ndist.all_reduce(t)\\n"
ip.run_cell_magic("distributed", "", cell)  # the first cell
times = []
for _ in range({repeats}):
    started = time.perf_counter()
    ip.run_cell_magic("distributed", "", cell)
    times.append(time.perf_counter() - started)
ip.run_line_magic("dist_shutdown", "")
print("TIMES", statistics.median(times), min(times), max(times))
"""


def time_nbdistributed(world_size: int, repeats: int) -> list[float]:
    """Median, min and max seconds of one %%distributed cell (4 persistent workers, one all_reduce) in a kernel."""
    return _in_fresh_kernel(NBDISTRIBUTED_CODE.format(world=world_size, repeats=repeats), after="TIMES")[-3:]


def importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


KERNEL_CODE = """
import statistics, time, torch, torch.distributed as dist, parlab
def one_all_reduce():
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()
parlab.launch(one_all_reduce, {world})  # the first launch in this kernel starts the rank server
times = []
for _ in range({repeats}):
    time.sleep(0.2)  # the student between two cells (not timed)
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


def _in_fresh_kernel(code: str, after: str = "") -> list[float]:
    """Run `code` in a fresh Jupyter kernel; return the numbers it printed (those after the word `after`)."""
    from jupyter_client.manager import start_new_kernel

    env = {k: v for k, v in os.environ.items() if k not in ("PARLAB_WARM", "PARLAB_SPARES")}  # a kernel's defaults
    manager, client = start_new_kernel(kernel_name="python3", env=env)
    try:
        out = []
        client.execute_interactive(
            code,
            timeout=600,
            output_hook=lambda msg: out.append(msg["content"].get("text", "")) if msg["msg_type"] == "stream" else None,
        )
        text = "".join(out)
        return [float(x) for x in (text.split(after)[-1] if after else text).split()]
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


def _median(times: list[float]) -> str:
    return f"{statistics.median(times):.3f} s  (min {min(times):.3f}, max {max(times):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--spawn-repeats", type=int, default=5, help="torch.multiprocessing.spawn takes seconds")
    parser.add_argument("--no-kernel", action="store_true", help="skip the measurements inside a Jupyter kernel")
    parser.add_argument("--first-launch-only", action="store_true", help="only the first launch in a fresh kernel")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.first_launch_only:
        raise SystemExit(0 if report_first_launch(args.world) else 1)
    world, big = args.world, 2 * args.world
    cold = time_parlab(world, spares=True)  # the first launch starts the rank server
    times: dict[str, list[float]] = {"4": [], "8": [], "no spares": [], "spawn": [], "back to back": []}
    with_accelerate = importable("accelerate")
    for repeat in range(args.repeats):  # the launchers take turns, so that all see the same machine load
        times["no spares"].append(time_parlab(world, spares=False))  # (it retires the spares)
        time_parlab(world, spares=True)  # not timed: it leaves spares behind for the next launch
        times["4"].append(time_parlab(world, spares=True))
        if repeat < args.spawn_repeats:
            times["spawn"].append(time_spawn(world))
    for _ in range(args.repeats):
        times["back to back"].append(time_parlab(world, spares=True, think=0.0))
    time_parlab(big, spares=True)  # the spares follow the world size of the last launch
    for _ in range(args.repeats):
        times["8"].append(time_parlab(big, spares=True))
    parlab_4, parlab_8 = statistics.median(times["4"]), statistics.median(times["8"])
    per_rank = (parlab_8 - parlab_4) / (big - world)
    load = os.getloadavg()[0]
    print(
        f"one all_reduce per rank, {args.repeats} runs each ({args.spawn_repeats} of spawn), {os.cpu_count()} CPU cores"
    )
    print(f"parlab.launch, first (starts the rank server):      {cold:.3f} s")
    print(f"parlab.launch, warm, spares, {world} ranks, median:      {_median(times['4'])}")
    print(f"parlab.launch, warm, spares, {big} ranks, median:      {_median(times['8'])}")
    print(f"parlab.launch, per extra rank:                      {per_rank * 1000:.1f} ms")
    print(f"parlab.launch, spares, back to back, {world} ranks:      {_median(times['back to back'])}")
    print(f"parlab.launch, warm, no spares, {world} ranks, median:   {_median(times['no spares'])}")
    print(f"torch.multiprocessing.spawn, {world} ranks, median:      {_median(times['spawn'])}")
    ratios = {"parlab without spares": statistics.median(times["no spares"])}
    ratios["torch.multiprocessing.spawn"] = statistics.median(times["spawn"])
    if with_accelerate:
        acc, acc_min, acc_max = time_accelerate(world, args.repeats)
        spread = f"(min {acc_min:.3f}, max {acc_max:.3f})"
        print(f"accelerate notebook_launcher, {world} ranks, median:     {acc:.3f} s  {spread}")
        ratios["accelerate notebook_launcher"] = acc
    else:
        print("accelerate notebook_launcher: not installed")
    nb = None
    if importable("nbdistributed") and importable("zmq"):
        nb, nb_min, nb_max = time_nbdistributed(world, args.repeats)
        print(
            f"nbdistributed %%distributed cell, {world} ranks, median: {nb:.3f} s  (min {nb_min:.3f}, max {nb_max:.3f})"
        )
        ratios["nbdistributed cell"] = nb
    else:
        print("nbdistributed: not installed")
    print(f"parlab.launch ({world} ranks, spares) against each (parlab's time / theirs):")
    for name, other in ratios.items():
        print(f"  {name}: {parlab_4 / other:.2f}x  ({other / parlab_4:.1f} times parlab's)")
    verdicts = [
        (f"{world} ranks <= 0.08 s", parlab_4 <= 0.08),
        (f"{big} ranks <= 0.12 s", parlab_8 <= 0.12),
        ("per extra rank <= 10 ms", per_rank <= 0.010),
    ]
    if nb is not None:
        verdicts.append(("<= 0.75x nbdistributed's cell", parlab_4 <= 0.75 * nb))
    print("targets: " + ", ".join(f"{text}: {'PASS' if ok else 'FAIL'}" for text, ok in verdicts), end="")
    print(f"  [load average {load:.1f}]")
    if not args.no_kernel:
        k, k_min, k_max = time_in_kernel(world, args.repeats)
        print(f"parlab.launch in a Jupyter kernel, warm, median: {k:.3f} s  (min {k_min:.3f}, max {k_max:.3f})")
        report_first_launch(world)


if __name__ == "__main__":
    main()
