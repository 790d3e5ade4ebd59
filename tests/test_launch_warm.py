"""Warm from the start (issue 17): the rank server starts in the background when parlab is imported in a Jupyter
kernel, never blocking it; nothing starts when a script or a test imports parlab, unless asked (PARLAB_WARM=1 or
parlab.runtime.launcher.warm_up()). The figure itself (first launch <= 0.5 s, 5 s after the import) is measured by
benchmarks/bench_launch.py."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
from processes import CHILDREN, children_of, described, ranks_of, wait_until

from parlab.runtime import launcher
from parlab.runtime import server as server_module
from parlab.runtime.errors import LaunchTimeout, RankError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_script(code: str, **env: str) -> dict:
    """Run CHILDREN + code in a fresh interpreter with PARLAB_WARM unset unless given; return its last JSON line."""
    environment = {k: v for k, v in os.environ.items() if k != "PARLAB_WARM"} | env
    result = subprocess.run(
        [sys.executable, "-c", CHILDREN + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        env=environment,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_importing_parlab_in_a_script_starts_nothing():
    out = _run_script(
        """
        import json, time
        import parlab
        time.sleep(1.0)
        print(json.dumps({"children": children()}))
        """
    )
    assert out["children"] == []


def test_parlab_warm_1_starts_the_server_at_import():
    out = _run_script(
        """
        import json, time
        import parlab
        from parlab.runtime.server import rank_server_pid
        server, started = rank_server_pid(), children()
        results = parlab.launch(lambda: 1, 2)
        print(json.dumps({"server": server, "children": started, "served_by": rank_server_pid()}))
        """,
        PARLAB_WARM="1",
    )
    assert out["server"] is not None and out["children"] == [out["server"]]
    assert out["served_by"] == out["server"]  # the first launch used the server started at import


def test_warm_up_returns_at_once_and_the_first_launch_is_warm():
    out = _run_script(
        """
        import json, sys, time
        import parlab
        import parlab.runtime.launcher
        import parlab.runtime.server as server_module
        started = time.perf_counter()
        server_module.warm_up()
        returned_after = time.perf_counter() - started
        ready_at_return = server_module._server.ready.is_set()
        server_module.warm_up(wait=True)
        started = time.perf_counter()
        parlab.launch(lambda: 1, 4)
        print(json.dumps({"returned_after": returned_after, "ready_at_return": ready_at_return,
                          "first_launch": time.perf_counter() - started}))
        """,
        PARLAB_WARM="0",
    )
    assert out["returned_after"] < 0.5 and not out["ready_at_return"]  # torch is imported in the background
    assert out["first_launch"] < 5.0  # warm: no torch import in it (the benchmark holds it to 0.5 s)


def test_importing_parlab_in_a_kernel_starts_the_server_without_blocking():
    jupyter_client = pytest.importorskip("jupyter_client.manager")
    manager, client = jupyter_client.start_new_kernel(kernel_name="python3", cwd=ROOT)
    try:

        def run(code: str, timeout: float = 120) -> str:
            out = []

            def hook(msg):
                if msg["msg_type"] == "stream":
                    out.append(msg["content"]["text"])
                elif msg["msg_type"] == "error":
                    out.append("\n".join(msg["content"]["traceback"]))

            client.execute_interactive(code, timeout=timeout, output_hook=hook)
            return "".join(out)

        code = (
            "import os, time; os.environ.pop('PARLAB_WARM', None)\n"
            "import parlab, sys\n"
            "m = sys.modules['parlab.runtime.server']\n"
            "print(m.rank_server_pid() is not None, m._server.warm)\n"
        )
        assert run(code).split() == ["True", "True"]
        started = run("import time; print(time.perf_counter())")  # the kernel answers while the server starts
        assert started.strip()
        out = run("import torch.distributed as dist\nprint(parlab.launch(lambda: dist.get_rank(), 2, echo=False))")
        assert out.strip() == "[0, 1]"
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


# ------------------------------------------------------------------------------------- spares (issue 28)
#
# With PARLAB_SPARES=1 (the default in a Jupyter kernel) the rank server forks the next launch's ranks ahead of it:
# spares that have imported parlab and wait for a job. Each launch must still get new processes that run the parlab
# code on disk, in the launch's environment, and leave nothing behind.


@pytest.fixture
def spares(monkeypatch):
    """Spares on for one test; afterwards one launch with them off retires them (the server keeps running)."""
    monkeypatch.setenv("PARLAB_SPARES", "1")
    yield
    monkeypatch.setenv("PARLAB_SPARES", "0")
    launcher.launch(lambda: 0, 1)
    server = server_module.rank_server_pid()
    assert wait_until(lambda: children_of(server) == [], 5.0), "a spare or a rank outlived the test"


def _served_by_spares(fn, world_size: int, *args):
    """Launch until every rank was a spare (the server forks them after each launch, while this process goes on)."""
    for _ in range(20):
        time.sleep(0.1)
        results = launcher.launch(fn, world_size, *args)
        if results.spares == world_size:
            return results
    raise AssertionError("no launch was served by spares")


def _ranks_left() -> list[int]:
    """The rank server's children that are not idle spares (ranks killed at the end of a launch exit at once)."""
    return ranks_of(server_module.rank_server_pid())


def test_spares_never_carry_state_from_one_launch_to_the_next(spares, tmp_path):
    def fn(folder):
        import random

        import torch.distributed as dist

        from parlab.core import comm

        seen = (getattr(comm, "_left_by_a_launch", None), os.environ.get("LEFT_BY_A_LAUNCH"), os.getcwd())
        groups = dist.distributed_c10d._world.group_count
        comm._left_by_a_launch = os.getpid()  # a global, the environment, the folder, a new group, the generators
        os.environ["LEFT_BY_A_LAUNCH"] = "1"
        os.chdir(folder)
        dist.new_group([0])
        return os.getpid(), seen, groups, random.random()

    first = _served_by_spares(fn, 2, str(tmp_path))
    second = _served_by_spares(fn, 2, str(tmp_path))
    assert {pid for pid, *_ in first}.isdisjoint(pid for pid, *_ in second)  # new processes
    for _pid, seen, groups, _ in [*first, *second]:
        assert seen == (None, None, os.getcwd()) and groups == first[0][2]
    assert first[0][3] != second[0][3]  # drawn from a new seed


def test_spares_run_in_the_environment_of_their_launch(spares, monkeypatch):
    def fn():
        return os.environ.get("MY_SETTING"), os.environ.get("PYTEST_CURRENT_TEST"), os.environ["RANK"]

    monkeypatch.setenv("MY_SETTING", "1")
    _served_by_spares(fn, 2)
    monkeypatch.setenv("MY_SETTING", "2")  # read at import by some module? The spares prepared with "1" retire
    results = launcher.launch(fn, 2)
    assert list(results) == [
        ("2", os.environ["PYTEST_CURRENT_TEST"], "0"),
        ("2", os.environ["PYTEST_CURRENT_TEST"], "1"),
    ]
    assert results.spares == 0
    for attempt in range(20):  # pytest's own per-phase variable differs from the spares': they still serve
        time.sleep(0.1)
        monkeypatch.setenv("PYTEST_CURRENT_TEST", f"noise {attempt}")
        results = launcher.launch(fn, 2)
        assert list(results) == [("2", f"noise {attempt}", "0"), ("2", f"noise {attempt}", "1")]
        if results.spares == 2:
            break
    assert results.spares == 2


def test_a_launch_after_a_parlab_file_changed_runs_the_new_code(spares, tmp_path, monkeypatch):
    """A copy of the package first on sys.path; its parlab/core/comm.py (imported by every spare) is edited."""
    shutil.copytree(os.path.join(ROOT, "parlab"), tmp_path / "parlab", ignore=shutil.ignore_patterns("__pycache__"))
    probe = tmp_path / "parlab" / "core" / "comm.py"
    original = probe.read_text()
    probe.write_text(original + "\nEDIT_PROBE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def fn():
        from parlab.core import comm

        return comm.EDIT_PROBE, comm.__file__

    assert list(_served_by_spares(fn, 2)) == [(1, str(probe))] * 2
    probe.write_text(original + "\nEDIT_PROBE = 2\n")
    results = launcher.launch(fn, 2)
    assert list(results) == [(2, str(probe))] * 2 and results.spares == 0  # the stale spares were not used
    assert list(_served_by_spares(fn, 2)) == [(2, str(probe))] * 2


def test_spares_keep_the_launch_guarantees(spares):
    """A failing rank still names itself and stops the others, a hang still ends at its timeout, and nothing is
    left behind: no rank process, no file descriptor in this process."""
    import torch
    import torch.distributed as dist

    def fn(fail):
        if fail and dist.get_rank() == 1:
            raise ValueError("rank one is unhappy")
        t = torch.ones(2)
        dist.all_reduce(t)
        if fail:
            time.sleep(60)
        return t.sum().item()

    _served_by_spares(fn, 3, False)
    fds = len(os.listdir("/proc/self/fd"))
    for i in range(12):
        if i % 4 == 3:
            started = time.perf_counter()
            with pytest.raises(RankError, match="rank one is unhappy") as info:
                launcher.launch(fn, 3, True)
            assert info.value.rank == 1 and time.perf_counter() - started < 10
        else:
            assert list(launcher.launch(fn, 3, False)) == [6.0] * 3
        assert wait_until(lambda: _ranks_left() == [], 5.0), described(_ranks_left())
    with pytest.raises(LaunchTimeout):
        launcher.launch(lambda: time.sleep(60), 2, timeout=1.5)
    assert wait_until(lambda: _ranks_left() == [], 5.0), described(_ranks_left())
    assert len(os.listdir("/proc/self/fd")) == fds
