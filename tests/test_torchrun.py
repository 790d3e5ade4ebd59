"""The same rank code under torchrun: an elastic restart after a rank fails once (torchrun --nnodes 1:2
--max-restarts 3: the agent restarts the group, parlab resumes from its sharded checkpoint and finishes like one
device), and two torchrun agents on this machine standing in for two nodes (--nnodes 2 --node-rank 0|1, c10d
rendezvous on 127.0.0.1) print the verdicts one machine prints. Each starts torchrun agents (torch imported once per
process): marked slow."""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from parlab import cli
from parlab.core.check import max_abs_error
from parlab.core.models import GPTConfig, make_batches, train_single_device

pytestmark = pytest.mark.slow
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
PYTHON_ERROR = re.compile(r"exitcode\s*:\s*1\b")  # torchrun's report of a worker that raised (a Python error)
ENV = {**os.environ, "PARLAB_WARM": "0", "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(agents: list[list[str]], timeout: float = 60, before=lambda: None) -> list[tuple[int, str, str]]:
    """Run torchrun agents (each a list of arguments; "PORT" stands for a fresh rendezvous port) together; returns
    each one's (exit status, stdout, stderr). Each agent runs in a session of its own, killed with its workers if
    it outlives `timeout`. Once in a few loaded runs, a torchrun agent whose workers had finished waited in its own
    exit barrier or rendezvous until its 300 s timeout (torch 2.13, c10d rendezvous on 127.0.0.1), or a worker
    was lost by torch's machinery (see _machinery_failed): a launch that hung or lost a worker that way is tried
    once more, on a new port, before the test fails (a launch takes 10-16 s here: 60 s is four times that).
    `before()` runs before each attempt (a clean folder for a job that leaves files)."""
    for attempt in range(2):
        before()
        port = str(free_port())
        token = f"{os.getpid()}-{time.monotonic_ns()}"  # in every process of this launch: see _kill_launch
        procs = [
            subprocess.Popen(
                TORCHRUN + [port if a == "PORT" else a.replace("PORT", port) for a in args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**ENV, "PARLAB_TEST_TORCHRUN": token},
                start_new_session=True,
            )  # fmt: skip
            for args in agents
        ]
        try:
            outs = [p.communicate(timeout=timeout) for p in procs]
            done = [(p.returncode, out, err) for p, (out, err) in zip(procs, outs, strict=True)]
            aborted = any(status != 0 and _machinery_failed(err) for status, _, err in done)
            if not aborted or attempt == 1:
                return done
        except subprocess.TimeoutExpired:
            if attempt == 1:
                _kill_launch(procs, token)
                tails = [p.communicate()[1][-1500:] for p in procs]
                raise AssertionError(f"torchrun hung twice; the agents' last words: {tails}") from None
        finally:  # nothing outlives the attempt
            _kill_launch(procs, token)
    raise AssertionError("unreachable")


def _kill_launch(procs: list[subprocess.Popen], token: str) -> None:
    """SIGKILL the agents' sessions and every process that carries the launch's token (torchrun starts its workers
    in sessions of their own, which outlive a killed agent)."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    marker = f"PARLAB_TEST_TORCHRUN={token}".encode()
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and marker in open(f"/proc/{entry}/environ", "rb").read().split(b"\0"):
                os.kill(int(entry), signal.SIGKILL)
        except OSError:  # gone meanwhile, or not ours to read
            pass
    for p in procs:
        if p.returncode is None:
            p.wait()


def _machinery_failed(stderr: str) -> bool:
    """A failed launch that torch's elastic machinery lost, not the rank code: a worker aborted from C++ (SIGABRT)
    without any worker raising, or, after a restart, a rank that could not reach the rendezvous store or its peers
    (gloo's connectFullMesh refused or timed out). Stale addresses of the attempt before, once one restart in three
    here, no longer reach a restarted group (parlab.runtime.launcher._store_of_this_attempt;
    tests/test_elastic_store.py)."""
    aborted = "(SIGABRT)" in stderr and not PYTHON_ERROR.search(stderr)
    return aborted or "connectFullMesh failed" in stderr or "RendezvousConnectionError" in stderr


def _empty(folder):
    def empty() -> None:
        for path in folder.iterdir():
            shutil.rmtree(path) if path.is_dir() else path.unlink()

    return empty


def test_torchrun_restarts_a_failed_rank_and_parlab_resumes_from_its_checkpoint(tmp_path):
    args = ["--nnodes", "1:2", "--nproc-per-node", "2", "--max-restarts", "3", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", "127.0.0.1:PORT", "--rdzv-conf", "last_call_timeout=1"]  # fmt: skip
    job = ["-m", "parlab.runs.checkpoint", "--root", str(tmp_path), "--scheme", "zero", "--stage", "3",
           "--kill-rank", "1", "--at-step", "4", "--steps", "6"]  # fmt: skip
    ((status, _, stderr),) = torchrun([args + job], before=_empty(tmp_path))  # (a retry starts from nothing)
    assert status == 0, stderr[-3000:]
    assert (
        stderr.count("exitcode: 43") == 1
    )  # rank 1 died on purpose once (parlab.schemes.faults.failures.KILLED_EXIT_CODE)
    result = torch.load(tmp_path / "result.pt")
    # Resumed from the checkpoint of step 2. torchrun restarted the group at least once: on a loaded machine it
    # may restart it again for its own reasons (a rendezvous round that timed out), which the run survives too.
    assert result["restarts"] >= 1 and result["start"] == 2
    cfg = GPTConfig(vocab_size=32, seq_len=8, hidden=16, heads=2, layers=2, dtype="float64")
    single = train_single_device(cfg, make_batches(cfg, 8, 6, 0), 0, "adam", 1e-3)
    assert max_abs_error(result["params"], single.params)[0] <= 1e-10


def _masked(lines: list[str]) -> list[str]:
    """Verdict lines with the error's digits masked (they may differ in the last bits, as nbval's sanitizer says)."""
    return [re.sub(r"\d\.\de[-+]\d+", "E", line) for line in lines]


# What the two "nodes" run: four commands one after another, in one process group (as one machine runs them).
COMMANDS = [
    ["run", "collectives"],
    ["run", "dp"],
    ["run", "tp"],
    ["run", "hybrid", "--dp", "1", "--pp", "2", "--tp", "2"],
]
JOB = f"""
import os, sys
from parlab import cli
for args in {COMMANDS!r}:
    if os.environ["RANK"] == "0":
        print("## parlab " + " ".join(args), flush=True)
    if cli.main(args) != 0:
        sys.exit(1)
"""


def test_two_torchrun_agents_on_localhost_print_the_verdicts_of_one_machine(tmp_path, capsys):
    """Two agents (two "nodes") of 2 processes each, world size 4: `python -m parlab run SCHEME` for collectives,
    dp, tp and hybrid (dp 1 x pp 2 x tp 2: the pipeline's hop crosses the nodes) under torchrun."""
    job = tmp_path / "job.py"
    job.write_text(JOB)
    agents = [
        ["--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", "127.0.0.1:PORT",
         # Both agents are on 127.0.0.1, so both would guess they host the rendezvous store; say which one does,
         # or node 0 could outlive a node 1 that hosted it and wait for it (seen once).
         "--rdzv-conf", f"is_host={1 if node == 0 else 0}", str(job)]
        for node in (0, 1)
    ]  # fmt: skip
    (status0, out0, err0), (status1, out1, err1) = torchrun(agents, timeout=90)
    assert [status0, status1] == [0, 0], err0[-2000:] + err1[-2000:]
    two_nodes = [line for line in out0.splitlines() if line.strip()]  # global rank 0 lives on node 0
    assert out1.strip() == ""  # ranks 2, 3 (node 1) leave the report to rank 0
    one_machine = []
    for args in COMMANDS:  # the same commands on one machine (parlab.launch)
        one_machine.append("## parlab " + " ".join(args))
        assert cli.main([*args, "--world", "4"]) == 0
        one_machine += [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert sum(line.endswith(": PASS") for line in one_machine) >= 20
    assert _masked(two_nodes) == _masked(one_machine)
