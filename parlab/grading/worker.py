"""Execute one assembled lab notebook for the grader: `python parlab/grading/worker.py SCRATCH`.

This process runs next to student code (it starts the kernel the student's answers run in), inside the grader's
sandbox when there is one, so the grader trusts nothing it writes: it reads SCRATCH/status.json as data and decides
every grade itself (parlab/grading/command.py).

SCRATCH/spec.json says what to run: {"timeout": s, "setup_timeout": s, "grace": s, "cells": {index: [kind, name]}}
(kind: "answer", "check" or "setup"); the notebook is SCRATCH/assembled.ipynb. It runs as a plain script that
imports nothing of parlab but a standard-library helper (nor torch): it starts in a moment, and its time is the
submission's.

Each code cell gets its timeout (answer and check cells `timeout`, the lab's own setup cells `setup_timeout`);
past it the kernel gets SIGINT (as from Jupyter's interrupt button), and `grace` seconds later its whole process
group SIGKILL (code that ignores the interrupt), after which the remaining cells are not run. After every cell,
SCRATCH/status.json says what happened so far: the grader still has it if this process is killed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

STATUS_VERSION = 1


def kernel_manager():
    """A kernel in the current Python environment (like nbval's --nbval-current-env)."""
    import ipykernel.kernelspec
    from jupyter_client import AsyncKernelManager
    from jupyter_client.kernelspec import KernelSpecManager

    class CurrentEnv(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            return self.kernel_spec_class(
                resource_dir=ipykernel.kernelspec.RESOURCES, **ipykernel.kernelspec.get_kernel_dict()
            )

    return AsyncKernelManager(kernel_name="python3", kernel_spec_manager=CurrentEnv())


def _kernel_pid(client) -> int | None:
    try:
        return client.km.provisioner.process.pid
    except AttributeError:
        return None


def _error_text(outputs) -> str:
    for o in outputs:
        if o.get("output_type") == "error":
            return f"{o.get('ename', 'Error')}: {o.get('evalue', '')}"[:4000]
    return ""


def main(scratch: str) -> int:
    try:  # (nbformat's jsonschema would build an IRI parser nothing here uses: ~1.5 s of CPU per submission)
        from parlab.runtime.lazy_imports import defer_rfc3987_syntax

        defer_rfc3987_syntax()
    except ImportError:
        pass
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    scratch_path = Path(scratch)
    spec = json.loads((scratch_path / "spec.json").read_text())
    nb = nbformat.read(scratch_path / "assembled.ipynb", as_version=4)
    log = scratch_path / "worker.log"  # this process's stderr: the kernel's, its rank server's and its ranks' too
    status = {"version": STATUS_VERSION, "cells": [], "finished": False}

    def save_status():
        tmp = scratch_path / "status.json.tmp"
        tmp.write_text(json.dumps(status))
        os.replace(tmp, scratch_path / "status.json")

    client = NotebookClient(nb, timeout=None, allow_errors=True, km=kernel_manager(), record_timing=False)
    current = {"started": None, "limit": None, "interrupted": False, "killed": False}
    lock = threading.Lock()

    def watchdog():
        while True:
            time.sleep(0.2)
            with lock:
                if current["started"] is None:
                    continue
                elapsed = time.monotonic() - current["started"]
                pid = _kernel_pid(client)
                if pid is None:
                    continue
                if elapsed > current["limit"] and not current["interrupted"]:
                    # The kernel alone: its launch stops the ranks. (Its process group also holds the rank server,
                    # which a SIGINT kills while it is still importing torch.)
                    current["interrupted"] = True
                    _signal(os.kill, pid, signal.SIGINT)
                elif elapsed > current["limit"] + spec["grace"] and not current["killed"]:
                    current["killed"] = True  # code that ignores the interrupt: the kernel and all it started
                    _signal(lambda p: os.killpg(os.getpgid(p), signal.SIGKILL), pid)

    threading.Thread(target=watchdog, daemon=True).start()
    dead = ""
    with client.setup_kernel(cwd=scratch):
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            kind, name = spec["cells"].get(str(index), ["setup", ""])
            entry = {"index": index, "kind": kind, "name": name}
            if dead:
                entry["skipped"] = dead
                status["cells"].append(entry)
                continue
            limit = spec["timeout"] if kind != "setup" else spec["setup_timeout"]
            if kind == "check":  # only data saved while its own cell runs counts (not a file an answer cell left)
                (scratch_path / "out" / f"{name}.pt").unlink(missing_ok=True)
            log_start = log.stat().st_size if log.exists() else 0
            with lock:
                current.update(started=time.monotonic(), limit=limit, interrupted=False, killed=False)
            try:
                client.execute_cell(cell, index)
            except DeadKernelError:
                dead = f"the kernel died in {kind} cell {entry['name'] or index!r}"
            except Exception as exc:  # nbclient could not run the cell: say so, try the next one
                entry["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            with lock:
                entry["seconds"] = round(time.monotonic() - current["started"], 3)
                entry["timed_out"] = current["interrupted"]
                entry["killed"] = current["killed"]
                current["started"] = None
            if entry["killed"]:
                which = f"{kind} cell {entry['name']!r}" if entry["name"] else f"{kind} cell {index}"
                dead = f"the kernel was killed after {which} ignored the interrupt"
            entry.setdefault("error", _error_text(cell.get("outputs", [])))
            entry["dead"] = dead
            entry["log"] = [log_start, log.stat().st_size if log.exists() else 0]
            status["cells"].append(entry)
            save_status()
    status["finished"] = True
    save_status()
    return 0


def _signal(send, *args) -> None:
    try:
        send(*args)
    except (ProcessLookupError, PermissionError, OSError):
        pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
