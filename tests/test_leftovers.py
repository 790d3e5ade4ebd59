"""Nothing left behind when the command line is stopped by a signal (issue 41, items 16 and 17): its scratch folders
(the disk offload's Adam state, the checkpoints of a --kill-rank run, with every folder made to hold them), the
rendezvous file, and every process it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cli_in_process import run_cli
from processes import temp_folder_of_our_own


def _session(sid: int) -> list[int]:
    """Live processes of session `sid` (the command's, started with start_new_session: the rank server, the ranks
    and whatever they started stay in it)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":  # fields: state, ppid, pgrp, session
                found.append(int(entry))
    return found


def _wait(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


class _Command:
    """`python -m parlab ARGS` in a session of its own, its temp folder `tmp`, its stderr read as it comes."""

    def __init__(self, tmp: Path, *args: str):
        env = {**os.environ, "TMPDIR": str(tmp), "PARLAB_WARM": "0"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "parlab", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.process.stderr), daemon=True)
        self.reader.start()

    def stop(self, signum: int, group: bool = False) -> int:
        """Send `signum` (to the whole process group, as a terminal's hang-up does, if `group`); the exit status."""
        (os.killpg if group else os.kill)(self.process.pid, signum)
        status = self.process.wait(timeout=120)
        self.reader.join(timeout=10)
        return status


def _left(tmp: Path) -> list[str]:
    """What is left in the command's temp folder, but torch's own compile cache (torchinductor_<user>)."""
    return sorted(p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_"))


def _clean(tmp: Path, sid: int) -> None:
    """No process of the command's session is left, nor any file or folder of parlab's in its temp folder."""
    assert _wait(lambda: not _session(sid), 30), _session(sid)
    assert _wait(lambda: not _left(tmp), 15), _left(tmp)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP", "SIGKILL"])
def test_a_signal_leaves_no_offload_folder_nor_the_folders_made_for_it(sig, tmp_path):
    """Item 17. The offload folder is given nested in folders that do not exist (x/deep/a/b/c): all of them go.
    SIGTERM and SIGHUP (sent to the whole process group, as a closed terminal does) stop the command as Ctrl-C
    does; after SIGKILL the rank server, which outlives its parent briefly, removes them."""
    folder = tmp_path / "x" / "deep" / "a" / "b" / "c"
    args = ["run", "offload", "--target", "disk", "--folder", str(folder), "--world", "2", "--steps", "2000"]
    command = _Command(tmp_path, *args, "--no-twin", "--no-reference")
    assert _wait(lambda: (folder / "rank0").is_dir(), 180), command.lines[-5:]  # the ranks are training
    status = command.stop(getattr(signal, sig), group=sig == "SIGHUP")
    if sig == "SIGKILL":
        assert status == -9
    else:
        assert status == 128 + getattr(signal, sig), command.lines[-10:]
        assert command.lines[-1].strip() == f"parlab: stopped by {sig}", command.lines[-10:]
        assert not any("Traceback" in line for line in command.lines), command.lines
    _clean(tmp_path, command.process.pid)


def test_sigterm_during_a_kill_rank_run_removes_its_checkpoint_folder(tmp_path):
    """Item 17: the checkpoints of a --kill-rank run live in a scratch folder of the parent's."""
    command = _Command(tmp_path, "run", "dp", "--world", "2", "--kill-rank", "1", "--at-step", "90", "--steps", "100")
    assert _wait(lambda: list(tmp_path.glob("parlab-offload-*/step-*")), 240), command.lines[-5:]  # checkpoints
    assert command.stop(signal.SIGTERM) == 128 + signal.SIGTERM, command.lines[-10:]
    _clean(tmp_path, command.process.pid)


def test_a_nested_offload_folder_goes_with_every_folder_made_for_it(tmp_path):
    with temp_folder_of_our_own(str(tmp_path)):
        nested = tmp_path / "x" / "deep" / "a" / "b" / "c"
        out = run_cli("run", "offload", "--target", "disk", "--folder", str(nested), "--world", "2", "--steps", "1")
    assert out.returncode == 0, out.stderr[-3000:]
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob("parlab-*"))


def test_a_run_of_128_ranks_says_so_in_a_pipe_and_stops_cleanly(tmp_path):
    """Item 16: `run hybrid --dp 64 --batch 128` starts 128 ranks, minutes of work on two cores, and was silent in
    a pipe: now a progress line comes (within 2 s of the launch: tests/test_rank_values.py), and SIGTERM stops
    everything."""
    command = _Command(tmp_path, "run", "hybrid", "--dp", "64", "--batch", "128", "--no-twin")
    assert _wait(lambda: any("ranks started" in line for line in command.lines), 120), command.lines
    assert all(line.startswith("parlab: ") for line in command.lines), command.lines
    assert command.stop(signal.SIGTERM) == 128 + signal.SIGTERM, command.lines[-10:]
    _clean(tmp_path, command.process.pid)
