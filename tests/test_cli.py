"""The command line as a user runs it: list, tour."""

import subprocess
import sys

from parlab.schemes import all_schemes


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "parlab", *args], capture_output=True, text=True, timeout=600)


def test_list_names_every_registered_scheme():
    out = _cli("list")
    assert out.returncode == 0, out.stderr
    listed = [line.split()[0] for line in out.stdout.splitlines()]
    assert listed == list(all_schemes()) and {"collectives", "dp", "dp-naive", "tp", "pp"} <= set(listed)


def test_tour_runs_every_scheme_at_world_size_4_with_one_verdict_line_each():
    out = _cli("tour")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert [line.split(" ")[0] for line in lines] == list(all_schemes())
    for line in lines:
        assert "(world 4): matches single device: max |err|" in line and line.endswith(": PASS"), line
