"""A failure injected and survived (parlab.schemes.faults.failures, parlab.runs.checkpoint): a rank dies mid-step
(os._exit); DP and ZeRO stop, restart from the last sharded checkpoint on the 3 survivors and end where the
uninterrupted run ends; the asynchronous parameter server carries on without the dead worker; bad options are refused
before launch; no checkpoint folder is left behind unless asked."""

import json
import os
import subprocess
import sys

import pytest

from parlab import cli
from parlab.runs.registry import get_scheme, launch_scheme


@pytest.mark.parametrize(
    "scheme, values, message",
    [
        ("dp", {"kill_rank": 4}, "kill_rank=4 is not a rank of world_size=4"),
        ("dp", {"kill_rank": 1, "at_step": 5, "steps": 4}, "at_step=5 must be a step of the run, 1..steps=4"),
        ("zero", {"kill_rank": 1, "at_step": 0}, "at_step=0 must be a step of the run, 1..steps=3"),
        ("dp", {"kill_rank": 1, "at_step": 2, "checkpoint_every": 0}, "checkpoint_every=0 must be >= 1"),
        ("ps", {"kill_rank": 0, "at_step": 2, "mode": "async"}, "a worker (1..world-1) of --mode async"),
        ("ps", {"kill_rank": 1, "at_step": 2, "mode": "sync"}, "a worker (1..world-1) of --mode async"),
    ],
)
def test_bad_failure_options_are_refused_before_launch(scheme, values, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        get_scheme(scheme).make_options(world_size=4, **values)


def test_the_cli_says_it_in_one_line(capsys):
    assert cli.main(["run", "dp", "--world", "4", "--steps", "4", "--kill-rank", "2", "--at-step", "5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("parlab: error: --at-step 5 must be a step of the run")


def test_dp_survives_a_dead_rank_and_ends_where_the_uninterrupted_run_ends(tmp_path):
    kept = tmp_path / "kept"
    _, report = launch_scheme(
        "dp", world_size=4, batch=12, steps=6, kill_rank=2, at_step=5, keep_checkpoint=str(kept), optimizer="adam",
        lr=1e-3,
    )  # fmt: skip
    assert report["passed"], report["verdicts"]
    assert report["killed_rank"] == 2 and report["restarted_on"] == 3
    assert report["resumed_from"] == 4 and report["steps_lost"] == 1  # checkpoints after steps 2 and 4
    assert report["equal_to_uninterrupted"] and report["vs_uninterrupted_max_abs_err"] <= 1e-10
    assert 0 < report["time_to_detect"] < 10 and 0 < report["time_to_restart"] < 60
    assert sorted(p.name for p in kept.glob("step-*")) == ["step-000002", "step-000004"]  # kept, as asked


@pytest.mark.slow  # a fresh interpreter and rank server (torch imported twice): ~25 s on 2 busy cores
def test_zero3_from_the_command_line_restarts_on_3_and_leaves_nothing_behind(tmp_path):
    """The issue's command (with --steps 6, so that step 5 exists); the scratch folder goes with the run."""
    env = {**os.environ, "TMPDIR": str(tmp_path), "PARLAB_WARM": "0"}
    args = ["run", "zero", "--stage", "3", "--world", "4", "--batch", "12", "--steps", "6"]
    out = subprocess.run([sys.executable, "-m", "parlab", *args, "--kill-rank", "2", "--at-step", "5", "--json"],
                         capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    report = json.loads(out.stdout)
    assert out.returncode == 0 and report["passed"], (out.stderr[-2000:], report.get("verdicts"))
    assert report["restarted_on"] == 3 and report["equal_to_uninterrupted"]
    assert report["max_abs_err"] <= 1e-10
    assert not list(tmp_path.glob("parlab-offload-*"))  # no checkpoint folder left behind


def test_a_smaller_global_batch_is_the_documented_difference():
    """The issue's `run dp --world 4 --kill-rank 2 --at-step 5`: the default 3 steps are raised to 8, so that step 5
    exists; batch 8 on 4 ranks: the 3 survivors keep 2 rows each (6 in all); one device on that schedule agrees."""
    _, report = launch_scheme("dp", world_size=4, kill_rank=2, at_step=5)
    assert report["passed"] and report["restarted_on"] == 3 and report["steps"] == 8
    # The newest complete checkpoint: step 4's, or step 2's when step 4's was still being written as the rank died
    # (seen on a loaded machine); the steps lost are counted from the one it resumed from.
    assert report["global_batch_after"] == 6 and report["resumed_from"] in (2, 4)
    assert report["steps_lost"] == 5 - report["resumed_from"]
    assert not report["equal_to_uninterrupted"] and report["vs_uninterrupted_max_abs_err"] > 1e-6
    assert "as expected: the survivors' global batch is 6 rows, not 8" in report["verdicts"][-1]


def test_the_async_parameter_server_carries_on_without_the_dead_worker():
    _, report = launch_scheme("ps", world_size=4, mode="async", steps=5, kill_rank=2, at_step=3, dp=False)
    assert report["passed"], report["verdicts"]
    assert list(report["dead"]) == [2] and report["restarted_on"] is None
    assert sum(u["worker"] == 2 for u in report["updates"]) == 2  # its steps 1 and 2, then silence
    assert len(report["updates"]) == 3 * 5 - 3
