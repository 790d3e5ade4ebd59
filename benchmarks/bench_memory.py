"""How much memory does a 4-rank lesson take, all processes together? Beside the 1.5 GB goal for a Binder machine.

A Binder machine has about 2 GB of RAM for everything: the Jupyter server, the notebook's kernel, parlab's rank
server and the ranks it forks. Three figures are measured side by side in one run, for every registered scheme at
world size 4 with its default options (what its lesson runs), each in a fresh process with its own rank server,
and for each lesson notebook executed in a real kernel:

- peak RSS of each process, summed: each rank reads its own peak resident set (VmHWM in /proc/self/status) when
  its rank function returns and sends it back through parlab.launch; the rank server's and the parent's are read
  from /proc. An upper bound: the ranks are forked from the rank server, so torch's code and data, imported once,
  are resident in every rank but in memory once, and this sum counts them once per process.
- peak PSS, sampled: every 20 ms the proportional set sizes (Pss in /proc/PID/smaps_rollup) of the parent (or the
  kernel), the rank server and every rank are summed; the largest sum is kept. PSS shares each page among the
  processes that map it, so the sum is what the group occupies, page cache aside. A peak shorter than 20 ms can
  be missed.
- peak "alone", sampled: the same samples, with file-backed pages (torch's shared libraries) counted once in full
  instead of as a share: anonymous PSS summed, plus the largest file-backed resident set of one process. On this
  machine other processes map the same torch libraries and shrink the group's PSS; on Binder the lesson is alone.
  This is the figure compared with the goal.

    python benchmarks/bench_memory.py                      # every scheme, then every notebook in notebooks/
    python benchmarks/bench_memory.py --schemes collectives --notebooks notebooks/00_collectives.ipynb
    python benchmarks/bench_memory.py --no-notebooks

Not counted: the Jupyter server (roughly 100 MB) and the browser, which runs on the learner's machine. Linux only
(/proc).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOAL_BYTES = 1.5e9
WORLD = 4
MB = 1e6


# ----------------------------------------------------------------------------------------------- /proc readers


def status_kib(pid: int | str, field: str) -> int:
    """A 'kB' field of /proc/PID/status (VmHWM: peak resident set, VmRSS: resident set now), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def rollup(pid: int) -> dict[str, int]:
    """/proc/PID/smaps_rollup in bytes: Pss, Pss_Anon, Pss_File, Pss_Shmem, Rss, ..."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return fields


def descendants(root: int) -> list[int]:
    """root and every process below it (from /proc/PID/task/TID/children, which the kernel keeps per thread)."""
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    todo.extend(int(child) for child in f.read().split())
        except OSError:  # the process ended meanwhile
            continue
    return found


def sample(root: int, exclude: set[int], interval: float) -> dict:
    """Sample the tree under `root` until stdin closes; return the peaks. Runs in its own process (see Sampler).

    Peaks kept:
    pss:    the summed PSS (pages shared with processes outside the tree count for a share only);
    alone:  the summed anonymous (and shmem) PSS plus the largest file-backed resident set of any one process in
            the tree: the tree's memory on a machine where nothing else maps torch's libraries (on Binder the
            lesson is alone; here other processes may share those pages and shrink its PSS);
    rss:    the summed resident sets (shared pages counted once per process: an upper bound).
    """
    peak = {"pss": 0, "alone": 0, "rss": 0, "processes": 0, "samples": 0}
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    while not stop.is_set():
        pss = anon = rss = file_max = count = 0
        for pid in descendants(root):
            if pid in exclude:
                continue
            try:
                r = rollup(pid)
            except OSError:  # the process ended between the listing and the read
                continue
            pss += r["Pss"]
            anon += r.get("Pss_Anon", r["Pss"]) + r.get("Pss_Shmem", 0)
            file_max = max(file_max, r["Rss"] - r.get("Anonymous", 0))
            rss += r["Rss"]
            count += 1
        peak["samples"] += 1
        if pss > peak["pss"]:
            peak["processes"] = count
        for key, value in (("pss", pss), ("alone", anon + file_max), ("rss", rss)):
            peak[key] = max(peak[key], value)
        stop.wait(interval)
    return peak


class Sampler:
    """A separate process that samples the tree under `root` every `interval` s (so that sampling costs the measured
    processes no GIL time), excluding itself and `exclude`; `stop()` returns the peaks (see `sample`)."""

    def __init__(self, root: int, exclude: tuple[int, ...] = (), interval: float = 0.02):
        command = [sys.executable, __file__, "--sample", str(root), "--interval", str(interval)]
        command += [f"--exclude={pid}" for pid in exclude]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def stop(self) -> dict:
        out, _ = self.process.communicate("", timeout=60)
        return json.loads(out)


# ----------------------------------------------------------------------------------------- one scheme, measured


def measured_rank(rank_fn, opts: dict):
    """Rank code: the scheme's own rank function, then this rank's peak resident set."""
    value = rank_fn(opts)
    return value, status_kib("self", "VmHWM")


def measure_scheme(name: str) -> dict:
    """Run scheme `name` at world size 4 as its lesson does (ranks, then the report with its single-device
    reference in the parent), measuring as described at the top. Runs in a fresh process (see main)."""
    from parlab.runs.registry import get_scheme
    from parlab.runtime.errors import Results
    from parlab.runtime.launcher import launch
    from parlab.runtime.server import rank_server_pid

    scheme = get_scheme(name)
    opts = scheme.make_options(world_size=WORLD)
    sampler = Sampler(os.getpid())
    started = time.perf_counter()
    raw = launch(measured_rank, WORLD, scheme.rank_fn, opts, echo=False)
    results = Results([value for value, _ in raw], raw.trace, raw.stdout, raw.seconds)
    report = scheme.report(opts, results)
    seconds = time.perf_counter() - started
    peaks = sampler.stop()
    server = rank_server_pid()
    ranks = [hwm for _, hwm in raw]
    return {
        "what": f"scheme {name}",
        "passed": bool(report["passed"]),
        "seconds": seconds,
        "rank_hwm": ranks,
        "server_hwm": status_kib(server, "VmHWM") if server else 0,
        "parent_hwm": status_kib("self", "VmHWM"),
        **{f"{key}_peak": peaks[key] for key in ("pss", "alone", "rss")},
        "processes": peaks["processes"],
        "samples": peaks["samples"],
    }


def measure_notebook(path: Path) -> dict:
    """Execute a lesson notebook in a fresh kernel (the venv's Python) and sample the kernel's process tree."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}})
    sampler = Sampler(os.getpid(), exclude=(os.getpid(),))  # the kernel and below, not this process
    started = time.perf_counter()
    try:
        client.execute(env=env)
        passed = True
    except Exception as exc:  # a failing notebook is reported, the other rows still run
        print(f"  {path.name} failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        passed = False
    seconds = time.perf_counter() - started
    peaks = sampler.stop()
    return {
        "what": f"notebook {path.name}",
        "passed": passed,
        "seconds": seconds,
        **{f"{key}_peak": peaks[key] for key in ("pss", "alone", "rss")},
        "processes": peaks["processes"],
        "samples": peaks["samples"],
    }


# ------------------------------------------------------------------------------------------------------ output


def verdict(nbytes: float) -> str:
    return f"{'within' if nbytes <= GOAL_BYTES else 'OVER'} the {GOAL_BYTES / 1e9:g} GB goal"


def print_row(row: dict) -> None:
    status = "ok" if row["passed"] else "FAILED"
    print(f"{row['what']} ({status}, {row['seconds']:.1f} s, {row['samples']} samples):")
    if "rank_hwm" in row:
        rss_sum = sum(row["rank_hwm"]) + row["server_hwm"] + row["parent_hwm"]
        ranks = " + ".join(f"{h / MB:.0f}" for h in row["rank_hwm"])
        print(
            f"  peak RSS of each process, summed: ranks {ranks} + rank server {row['server_hwm'] / MB:.0f}"
            f" + parent {row['parent_hwm'] / MB:.0f} = {rss_sum / MB:.0f} MB (upper bound: shared pages counted"
            " once per process)"
        )
    else:
        print(f"  peak RSS, summed over the kernel's processes (sampled): {row['rss_peak'] / MB:.0f} MB (upper bound)")
    print(f"  peak PSS, sampled: {row['pss_peak'] / MB:.0f} MB over {row['processes']} processes")
    alone = row["alone_peak"]
    print(f"  peak alone (anonymous PSS + torch's files once): {alone / MB:.0f} MB: {verdict(alone)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schemes", nargs="*", help="scheme names (default: every registered scheme)")
    parser.add_argument("--notebooks", nargs="*", type=Path, help="notebooks (default: notebooks/*.ipynb)")
    parser.add_argument("--no-notebooks", action="store_true")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one scheme or notebook, print JSON
    parser.add_argument("--sample", type=int, help=argparse.SUPPRESS)  # internal: the sampler process
    parser.add_argument("--interval", type=float, default=0.02, help=argparse.SUPPRESS)
    parser.add_argument("--exclude", type=int, action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sample:
        print(json.dumps(sample(args.sample, {os.getpid(), *args.exclude}, args.interval)))
        return
    sys.stdout.reconfigure(line_buffering=True)  # rows appear as they are measured, also in a log file
    if args.one:
        one = measure_notebook(Path(args.one)) if args.one.endswith(".ipynb") else measure_scheme(args.one)
        print("RESULT " + json.dumps(one))
        return

    from parlab.runs.registry import all_schemes

    names = args.schemes if args.schemes else list(all_schemes())
    if not args.no_notebooks:
        notebooks = args.notebooks if args.notebooks else sorted((ROOT / "notebooks").glob("*.ipynb"))
        names += [str(Path(path).resolve()) for path in notebooks]
    print(f"Peak memory of a {WORLD}-rank lesson run, all processes together (goal: under {GOAL_BYTES / 1e9:g} GB)\n")
    rows = []
    for name in names:  # each in a fresh process: its own parent (or kernel), rank server and ranks
        try:
            done = subprocess.run(
                [sys.executable, __file__, "--one", name], capture_output=True, text=True, cwd=ROOT, timeout=900
            )
        except subprocess.TimeoutExpired:
            print(f"{name}: did not finish in 900 s")
            continue
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            print(f"{name}: FAILED to run\n{done.stderr[-2000:]}")
            continue
        rows.append(json.loads(lines[-1][len("RESULT ") :]))
        print_row(rows[-1])
    if rows:
        worst = max(rows, key=lambda r: r["alone_peak"])
        print(f"\nlargest: {worst['what']}, {worst['alone_peak'] / MB:.0f} MB: {verdict(worst['alone_peak'])}")


if __name__ == "__main__":
    main()
