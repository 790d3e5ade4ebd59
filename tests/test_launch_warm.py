"""Warm from the start (issue 17): the rank server starts in the background when parlab is imported in a Jupyter
kernel, never blocking it; nothing starts when a script or a test imports parlab, unless asked (PARLAB_WARM=1 or
parlab.launch.warm_up()). The figure itself (first launch <= 0.5 s, 5 s after the import) is measured by
benchmarks/bench_launch.py."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from processes import CHILDREN

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
        from parlab.launch import rank_server_pid
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
        import parlab.launch  # (the package attribute parlab.launch is the function)
        launch_module = sys.modules["parlab.launch"]
        import parlab.runtime.server as server_module
        started = time.perf_counter()
        launch_module.warm_up()
        returned_after = time.perf_counter() - started
        ready_at_return = server_module._server.ready.is_set()
        launch_module.warm_up(wait=True)
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
