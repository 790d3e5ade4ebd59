"""`python -m parlab doctor`: does parlab work on this machine, and how fast does it start ranks?

What a user or an instructor runs on a new machine, GPU or not:

    python -m parlab doctor             every scheme with its defaults and its PyTorch twin
    python -m parlab doctor --quick     every scheme's fastest run that still checks it (Scheme.quick)
    python -m parlab doctor --json      one JSON object instead of the tables

It reports the machine (CPUs, GPUs, torch, CUDA, NCCL, gloo, the grading sandbox), times the phases of a launch
(the rank server's start, each rank's start, its CUDA context, its process group and NCCL communicator, the first
collective), then runs every scheme of the registry (parlab/runs/registry.py) at the largest world size the machine
allows: one GPU per rank on NCCL where there are GPUs (a scheme that refuses that many ranks gets fewer, and one that
refuses every GPU count runs on gloo at 4 ranks), else gloo at 4 ranks. One row per scheme: backend, world size,
the device its collectives' tensors were on (read from the trace), the verdict against one device, the worst error,
the twin's verdict, seconds. The exit status is 0 only when every scheme passes and no twin fails (a twin skipped
with torch's reason is not a failure).
"""

from __future__ import annotations

import os
import platform
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field

GLOO_WORLD = 4  # the world size of a machine without GPUs (every lesson's default)

# The launch's phases, in the order a rank goes through them (parlab.runtime.errors.Results.phases).
PHASES = ("rank_start", "cuda_context", "process_group")


# ------------------------------------------------------------------------------------------------ the machine


def machine() -> dict:
    """What parlab will run on: CPUs, GPUs, torch, CUDA, NCCL, gloo, the grading sandbox. Starts no CUDA here: the
    GPUs are counted through NVML (their names come from the ranks that own them, see `probe_rank`)."""
    import torch
    import torch.distributed as dist

    from parlab.grading.isolation import Sandbox
    from parlab.runtime.launcher import available_cpus, gpu_count

    nccl = None
    if dist.is_nccl_available():
        try:
            nccl = ".".join(str(n) for n in torch.cuda.nccl.version())
        except (RuntimeError, AttributeError, TypeError):  # a build whose NCCL does not say
            nccl = "available"
    sandbox = Sandbox("auto")
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": available_cpus(),  # what this process may use (affinity, container quota)
        "cpus_total": os.cpu_count(),
        "gpus": gpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,  # None: a CPU build of torch
        "nccl": nccl,
        "gloo": dist.is_gloo_available(),
        "sandbox": sandbox.kind,
        "sandbox_detail": sandbox.describe(),
    }


# ------------------------------------------------------------------------------------- the launch, phase by phase


def probe_rank() -> dict:
    """Rank code: the first collective of a fresh rank (one all-reduce of one number on this rank's device),
    timed, and the name of this rank's GPU."""
    import torch

    from parlab.core import comm

    device = comm.device()
    x = torch.ones(1, device=device)
    start = time.perf_counter()
    comm.all_reduce(x, label="doctor: first collective")  # waits for the GPU (comm synchronises)
    seconds = time.perf_counter() - start
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {"first_collective": seconds, "sum": x.item(), "device": str(device), "gpu": gpu}


@dataclass
class LaunchTiming:
    """One timed launch of `probe_rank`; every phase in seconds, the slowest rank's."""

    launch: str  # which launch ("cold: new rank server", "warm", ...)
    backend: str
    world: int
    server_start: float | None  # the rank server's start (it imports torch), when this launch had to wait for it
    rank_start: float  # from the job handed over to the rank's code running (fork, or a spare handed its job)
    cuda_context: float | None  # NCCL: setting the rank's GPU and making its CUDA context
    process_group: float  # torch.distributed's rendezvous; NCCL: the communicator too (device_id: eagerly)
    first_collective: float
    total: float  # from the job handed over to every rank's result back in this process
    spares: int  # ranks served by spares prepared ahead
    ok: bool  # the launch worked and its all-reduce summed right
    gpus: list = field(default_factory=list)
    error: str = ""  # why it failed


def timed_launch(label: str, world: int, backend: str, cold: bool = False) -> LaunchTiming:
    """Launch `probe_rank` on `world` ranks and read each phase from the ranks' own timestamps. cold: the launch
    starts a new rank server (its start is timed too). A launch that fails is a timing with ok False and the error."""
    import parlab

    began = time.perf_counter()
    try:
        results = parlab.launch(probe_rank, world, backend=backend, echo=False)
    except Exception as exc:  # NCCL that cannot start, say: the doctor reports it and goes on
        error = " ".join(line.strip() for line in traceback.format_exception_only(exc) if line.strip())
        return LaunchTiming(label, backend, world, None, 0.0, None, 0.0, 0.0, 0.0, 0, False, error=error[:2000])
    wall = time.perf_counter() - began  # launch's own `seconds` start once the rank server is ready

    def slowest(end: str, after: str | None) -> float | None:
        spans = [
            p[end] - (p[after] if after else 0.0) for p in results.phases if end in p and (not after or after in p)
        ]
        return max(spans) if spans else None

    cuda = slowest("cuda_context", "rank_start")
    return LaunchTiming(
        launch=label,
        backend=results.backend,
        world=world,
        server_start=max(0.0, wall - results.seconds) if cold else None,
        rank_start=slowest("rank_start", None),
        cuda_context=cuda,
        process_group=slowest("process_group", "cuda_context" if cuda is not None else "rank_start"),
        first_collective=max(r["first_collective"] for r in results),
        total=results.seconds,
        spares=results.spares,
        ok=all(r["sum"] == world for r in results),
        gpus=[r["gpu"] for r in results if r["gpu"]],
    )


def launch_timings(gpus: int) -> list[LaunchTiming]:
    """A cold launch (a new rank server: it imports torch), warm launches on gloo, and where there are GPUs the
    first NCCL launch (a new process makes its CUDA context and communicator), warm NCCL launches, and one served
    by spares (prepared ahead: the rank's CUDA context made before the launch, PARLAB_SPARES=1)."""
    from parlab.runtime.server import shutdown

    shutdown()  # the cold launch starts its own rank server
    timings = [timed_launch("cold: new rank server", 1, "gloo", cold=True), timed_launch("warm", 1, "gloo")]
    if gpus:
        timings += [timed_launch("first on the GPU", 1, "nccl"), timed_launch("warm", 1, "nccl")]
        if gpus > 1:
            timings.append(timed_launch("warm", gpus, "nccl"))
    backend, world = ("nccl", 1) if gpus else ("gloo", 1)
    before = os.environ.get("PARLAB_SPARES")
    os.environ["PARLAB_SPARES"] = "1"  # the rank server prepares the next launch's ranks after each launch
    try:
        timed_launch("(prepares spares)", world, backend)
        time.sleep(2.0)  # let the spares get ready (CUDA context included) as a notebook's pause between cells would
        timings.append(timed_launch("warm, spares", world, backend))
    finally:
        if before is None:
            os.environ.pop("PARLAB_SPARES", None)
        else:
            os.environ["PARLAB_SPARES"] = before
    return timings


def launch_goals(timings: list[LaunchTiming]) -> list[str]:
    """The issue's goals for a GPU launch, against what was measured (information: they do not set the exit
    status). Empty on a machine without GPUs."""
    by = {(t.launch, t.backend, t.world): t for t in timings}
    gloo, nccl = by.get(("warm", "gloo", 1)), by.get(("warm", "nccl", 1))
    first = by.get(("first on the GPU", "nccl", 1))
    lines = []
    if gloo and nccl:
        ratio = nccl.total / gloo.total
        lines.append(
            f"warm NCCL launch at world 1: {nccl.total:.3f} s = {ratio:.1f} x warm gloo ({gloo.total:.3f} s); "
            f"goal <= 3 x: {'met' if ratio <= 3 else 'NOT met'}"
        )
    if first:
        lines.append(
            f"first NCCL launch at world 1: {first.total:.2f} s after the rank server was ready; goal < 5 s: "
            f"{'met' if first.total < 5 else 'NOT met'}"
        )
    return lines


# ---------------------------------------------------------------------------------------------- the schemes


@dataclass
class SchemeRow:
    scheme: str
    backend: str
    world: int
    device: str  # where the tensors handed to torch.distributed were, from the trace ("cuda", "cpu")
    passed: bool
    max_abs_err: float | None
    twin: str  # PASS, FAIL, SKIPPED or "-" (not run)
    seconds: float
    options: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # why this world size; why the twin was skipped; an error


def worlds_to_try(gpus: int) -> list[int]:
    """World sizes, best first: every GPU on NCCL down to one, then gloo's 4 ranks (a scheme that refuses one rank
    per GPU still gets checked, on the CPU), then fewer gloo ranks."""
    # parlab.launch picks NCCL whenever there is one GPU per rank: a world of <= gpus ranks runs on NCCL.
    return [*range(gpus, 0, -1), *(w for w in range(GLOO_WORLD, 0, -1) if w > gpus)]


def choose_world(scheme, gpus: int, quick: bool) -> tuple[int | None, dict, list[str]]:
    """(the world size, the options, why the larger sizes were refused) for a scheme; None when none fits."""
    options = dict(scheme.quick) if quick else {}
    refused = []
    for world in worlds_to_try(gpus):
        try:
            scheme.make_options(world_size=world, **options)
            return world, options, refused
        except ValueError as exc:
            refused.append(f"refuses world {world}: {exc}")
    return None, options, refused


def run_scheme_row(name: str, scheme, gpus: int, quick: bool, twin: bool) -> SchemeRow:
    """Run one scheme (and its twin) where `choose_world` says; any error becomes a failed row."""
    from parlab.runs.registry import launch_scheme
    from parlab.runtime.launcher import default_backend

    world, options, refused = choose_world(scheme, gpus, quick)
    notes = refused[-1:] if refused and world is not None else refused  # the last refusal says why this size
    if world is None:
        return SchemeRow(name, "-", 0, "-", False, None, "-", 0.0, options, notes)
    began = time.perf_counter()
    backend = default_backend(world)
    try:
        results, report = launch_scheme(name, twin=twin, world_size=world, **options)
    except Exception as exc:  # a rank's error, a timeout: the row fails and says why; the next scheme runs
        text = [line for line in "".join(traceback.format_exception_only(exc)).splitlines() if line.strip()]
        return SchemeRow(
            name, backend, world, "-", False, None, "-", time.perf_counter() - began, options, notes + text
        )
    devices = sorted({e.device.split(":")[0] for e in results.trace.events if e.device})
    twin_report = report.get("twin")
    if twin_report is None:
        twin_status = "-"
    elif "skipped" in twin_report:
        twin_status = "SKIPPED"
        notes.append(f"twin skipped: {twin_report['skipped']}")
    elif twin_report.get("passed"):
        twin_status = "PASS"
    else:
        twin_status = "FAIL"
        notes.append(f"twin: {twin_report.get('error') or '; '.join(twin_report.get('verdicts', []))}")
    if not report["passed"]:
        notes += [line for line in report["verdicts"] if "FAIL" in line]
    return SchemeRow(
        name,
        results.backend or backend,
        world,
        "+".join(devices) or "-",
        report["passed"],
        report["max_abs_err"],
        twin_status,
        time.perf_counter() - began,
        options,
        notes,
    )


def row_passed(row: SchemeRow) -> bool:
    return row.passed and row.twin != "FAIL"


# ------------------------------------------------------------------------------------------------- printing


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def machine_lines(info: dict) -> list[str]:
    gpus = f"{info['gpus']}" + (f" ({', '.join(info['gpu_names'])})" if info.get("gpu_names") else "")
    return [
        f"machine: {info['platform']}, Python {info['python']}",
        f"CPUs: {info['cpus']} usable ({info['cpus_total']} on the machine); GPUs: {gpus}",
        f"torch {info['torch']}; CUDA {info['cuda'] or '- (a CPU build)'}; NCCL {info['nccl'] or '-'}; "
        f"gloo {'yes' if info['gloo'] else 'NO'}",
        f"grading sandbox: {info['sandbox_detail']}",
    ]


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Columns padded to their widest cell, left-aligned text, two spaces apart."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]
    return [
        "  ".join(str(cell).ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in [header, *rows]
    ]


def launch_lines(timings: list[LaunchTiming]) -> list[str]:
    header = ["launch", "backend", "world", "server start", "rank start", "cuda context", "process group"]
    header += ["first collective", "total", "spares"]
    rows = [
        [t.launch, t.backend, str(t.world), _seconds(t.server_start), _seconds(t.rank_start)]
        + [_seconds(t.cuda_context), _seconds(t.process_group), _seconds(t.first_collective), _seconds(t.total)]
        + [str(t.spares)]
        for t in timings
    ]
    errors = [f"  {t.launch} ({t.backend}, world {t.world}) FAILED: {t.error}" for t in timings if not t.ok]
    title = "launch phases (seconds, the slowest rank; 'total' from the job handed over to every result back):"
    return [title] + ["  " + line for line in table(header, rows)] + errors


def scheme_lines(rows: list[SchemeRow]) -> list[str]:
    header = ["scheme", "backend", "world", "device", "passed", "max |err|", "twin", "seconds"]
    cells = [
        [
            r.scheme,
            r.backend,
            str(r.world),
            r.device,
            "PASS" if r.passed else "FAIL",
            "-" if r.max_abs_err is None else f"{r.max_abs_err:.1e}",
            r.twin,
            f"{r.seconds:.1f}",
        ]
        for r in rows
    ]
    lines = table(header, cells)
    notes = [f"  {r.scheme}: {note}" for r in rows for note in r.notes]
    return lines + (["notes:", *notes] if notes else [])


# ------------------------------------------------------------------------------------------------- the command


def doctor(quick: bool = False, twin: bool = True, only: list[str] | None = None, echo: bool = True) -> dict:
    """Run the checks; with `echo`, print them as tables (progress goes to stderr either way). Returns the
    report: {machine, quick, launch, launch_goals, schemes, passed, seconds} (`python -m parlab doctor --json`
    prints it; passed: every scheme passed and no twin failed)."""
    from parlab.runs.registry import all_schemes

    began = time.perf_counter()
    schemes = all_schemes()
    names = list(schemes) if not only else only
    info = machine()
    if echo:
        print("\n".join(machine_lines(info)), flush=True)
    timings = launch_timings(info["gpus"])
    info["gpu_names"] = sorted({name for t in timings for name in t.gpus})
    goals = launch_goals(timings)
    if echo:
        print("\n" + "\n".join(launch_lines(timings) + [f"  {line}" for line in goals]) + "\n", flush=True)
    rows = []
    for name in names:  # progress on stderr: stdout holds the tables (or the JSON) only
        print(f"doctor: {name} ...", end=" ", file=sys.stderr, flush=True)
        rows.append(run_scheme_row(name, schemes[name], info["gpus"], quick, twin))
        print(f"{'PASS' if row_passed(rows[-1]) else 'FAIL'} ({rows[-1].seconds:.1f} s)", file=sys.stderr, flush=True)
    passed = all(row_passed(r) for r in rows) and all(t.ok for t in timings)
    seconds = time.perf_counter() - began
    if echo:
        print("\n" + "\n".join(scheme_lines(rows)))
        failed = [r.scheme for r in rows if not row_passed(r)]
        failed += [f"the {t.launch} launch ({t.backend})" for t in timings if not t.ok]
        verdict = "every scheme passed" if passed else f"FAILED: {', '.join(failed)}"
        print(f"\ndoctor{' --quick' if quick else ''}: {verdict} ({len(rows)} schemes, {seconds:.0f} s)")
    return {
        "machine": info,
        "quick": quick,
        "launch": [asdict(t) for t in timings],
        "launch_goals": goals,
        "schemes": [asdict(r) for r in rows],
        "passed": passed,
        "seconds": seconds,
    }
