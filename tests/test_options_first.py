"""Every option checked, and checked first (issue 41, items 12-16): a mistake gets its own one-line answer before any
process starts, and an option that would change nothing is refused rather than ignored."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from parlab.cli import main
from parlab.runs import registry as runs


@pytest.fixture
def no_launch(monkeypatch):
    """Any attempt to start ranks fails the test: refusals must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("a process was started for options that should have been refused")

    monkeypatch.setattr(runs, "launch", refuse)


def _refused(capsys, *argv: str) -> str:
    """The command's one line on stderr, after exit status 2 (and no process started: no_launch)."""
    assert main(["run", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("parlab: error: ") and len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    "argv, message",
    [
        # Item 12: the options before the pace (its arithmetic divided by them), each with its own message.
        (["hybrid", "--dp", "2", "--pp", "2", "--tp", "1", "--microbatches", "0"], "--microbatches 0 must be >= 1"),
        (["pp", "--microbatches", "0", "--pace", "h100"], "microbatches m=0 must be >= 1"),
        (["dp", "--heads", "0", "--pace", "h100"], "--heads 0 must be >= 1"),
        (["dp", "--seq", "0", "--pace", "h100"], "--seq 0 must be >= 1"),
        (["dp", "--batch", "0", "--pace", "h100"], "--batch 0 must be >= 1"),
        (["dp", "--vocab", "0", "--pace", "h100"], "--vocab 0 must be >= 1"),
        (["dp", "--layers", "0", "--pace", "h100"], "--layers 0 must be >= 1"),
        (["dp", "--pace", "h100,unit=0ms"], "pace h100: unit=0 must be between 1us and 60s"),
        (["pp", "--virtual", "-1", "--pace", "h100"], "virtual stages v=-1 must be >= 1"),
        (["hybrid", "--tp", "0"], "--tp 0 must be >= 1"),
        (["hybrid", "--dp", "-2"], "--dp -2 must be >= 1"),
        # More ranks than one machine starts before the launch times out (a user typed 999).
        (["collectives", "--world", "999"], "--world 999: more ranks than this machine starts"),
        # Item 13: bounded as hybrid bounds it.
        (["moe", "--capacity-factor", "1e300"], "--capacity-factor 1e+300 must be in (0, 1000]"),
        (["moe", "--aux-weight", "1e300"], "--aux-weight 1e+300 must be in [0, 100]"),
        # Item 15: --at-step neither stretches the run without limit nor overrides --steps.
        (["dp", "--kill-rank", "2", "--at-step", "100000"], "would stretch the run to 100003 steps; give --steps"),
        (["dp", "--kill-rank", "2", "--at-step", "4", "--steps", "3"], "--at-step 4 must be a step of the run"),
        (["dp", "--kill-rank", "2", "--at-step", "0"], "--at-step 0 must be a step of the run, 1..steps=3"),
        # Item 15: options that would change nothing.
        (["dp", "--at-step", "2"], "at_step: no effect without kill_rank"),
        (["zero", "--keep-checkpoint", "/tmp/kept"], "keep_checkpoint: no effect without kill_rank"),
        (["dp", "--checkpoint-every", "0"], "checkpoint_every: no effect without kill_rank"),
        (["pp", "--megatron-warmup"], "megatron_warmup: no effect with schedule '1f1b'"),
        (["hybrid", "--top-k", "9"], "--top-k 9: no effect without experts"),
        (["hybrid", "--experts", "4", "--no-drop", "--capacity-factor", "2"], "--capacity-factor 2.0: no effect"),
        (["moe", "--no-drop", "--capacity-factor", "2"], "--capacity-factor 2.0: no effect with drop off"),
        (["zero", "--prefetch"], "prefetch: no effect at stage 1"),
        (["zero", "--loss-scale", "8"], "--loss-scale 8.0: no effect without mixed_precision"),
        (["zero", "--mixed-precision", "--loss-scale", "8"], "only float16 scales the loss"),
        (["offload", "--folder", "/tmp/never-made"], "--folder '/tmp/never-made': no effect with target 'cpu'"),
        (["ps", "--heartbeat", "0.5"], "--heartbeat 0.5: no effect without kill_rank"),
        (["ps", "--mode", "async", "--kill-rank", "2", "--checkpoint-every", "3"], "no effect with ps"),
        # Item 16: a number of micro-batches no run here could check or execute: refused at once.
        (["pp", "--microbatches", "100000", "--batch", "100000"], "microbatches m=100000: at most 1024"),
        (["hybrid", "--pp", "2", "--microbatches", "4096", "--batch", "8192"], "microbatches m=4096: at most 1024"),
    ],
)
def test_a_mistake_gets_its_own_message_before_any_process_starts(argv, message, capsys, no_launch):
    assert message in _refused(capsys, *argv)


@pytest.mark.parametrize("scheme", ["ulysses", "ring", "ring-zigzag", "usp"])
def test_schemes_whose_model_runs_its_own_layers_offer_no_recompute(scheme, capsys):
    """Item 15: --recompute was listed and every value but none refused. It is no longer offered; a Python caller
    who asks for it is refused."""
    with pytest.raises(SystemExit) as exit_:
        main(["run", scheme, "--recompute", "full"])
    assert exit_.value.code == 2 and "unrecognized arguments: --recompute full" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["run", scheme, "--help"])
    assert "--recompute" not in capsys.readouterr().out
    with pytest.raises(ValueError, match="recompute='full' is not applied by"):
        runs.get_scheme(scheme).make_options(recompute="full")


def test_a_failure_run_has_a_default_step_and_the_default_length_follows_it():
    """Item 11 and 15: --kill-rank alone dies in step 3 of 6; --at-step S alone runs S + 3 steps; an explicit
    --steps is never overridden."""
    dp = runs.get_scheme("dp")
    assert (dp.make_options(kill_rank=2).at_step, dp.make_options(kill_rank=2).steps) == (3, 6)
    assert dp.make_options(kill_rank=2, at_step=5).steps == 8
    assert dp.make_options(kill_rank=2, steps=3).at_step == 3 and dp.make_options(kill_rank=2, steps=2).at_step == 2
    assert dp.make_options(kill_rank=2, at_step=3, steps=3).steps == 3
    assert dp.make_options(kill_rank=2, at_step=90, steps=100).steps == 100  # a long run, asked for
    assert dp.make_options().steps == 3 and dp.make_options().checkpoint_every is None


def test_checking_a_schedule_grows_with_m_not_m_squared():
    """Item 16: the completeness check looked each (op, micro-batch, chunk) up in a list: m = 4000 took 15 s."""
    from parlab.runs.pipeline import PPOptions

    started = time.perf_counter()
    PPOptions.make(microbatches=1024, batch=1024, world_size=2, layers=2).check()
    assert time.perf_counter() - started < 10  # ~1 s here alone; the rest is margin for a loaded machine


@pytest.mark.parametrize("threads", [10**6, 100000])
def test_launch_refuses_more_threads_than_the_machine_has_cores(threads):
    """Item 16: threads=10**6 was accepted, and both ranks died trying to start them."""
    import parlab

    with pytest.raises(ValueError, match="threads must be at most this machine's"):
        parlab.launch(len, 2, threads=threads, echo=False)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lesson", "", "--out", "OUT"], "--lesson is empty"),
        (["--lesson", "03", "--out", "FILE"], "is a file, not a folder"),
        (["--lesson", "03", "--out", "FILE/sub"], "cannot be created: '{tmp}/FILE' is a file"),
        (["--lesson", "03", "--out", "/proc/x"], "'/proc/x' cannot be created or written here"),
    ],
)
def test_figures_refuses_a_bad_lesson_or_out_folder_in_one_line(argv, message, tmp_path, capsys):
    """Item 14: each of these was a traceback (an empty key, mkdir on a file, under a file, in /proc)."""
    (tmp_path / "FILE").write_text("not a folder")
    argv = [str(tmp_path / a) if a in ("OUT", "FILE", "FILE/sub") else a for a in argv]
    assert main(["figures", *argv, "--format", "html"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("parlab: error: ") and message.format(tmp=tmp_path) in err and len(err.splitlines()) == 1
    assert Path(tmp_path / "FILE").read_text() == "not a folder"
