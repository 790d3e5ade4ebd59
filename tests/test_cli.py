"""The command line as a user runs it: list, tour, and bad options refused before any process starts."""

import subprocess
import sys

import pytest

from parlab.cli import main
from parlab.runs import registry as runs
from parlab.runs.registry import all_schemes


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "parlab", *args], capture_output=True, text=True, timeout=600)


def test_list_names_every_registered_scheme():
    out = _cli("list")
    assert out.returncode == 0, out.stderr
    listed = [line.split()[0] for line in out.stdout.splitlines()]
    assert listed == list(all_schemes()) and {"collectives", "dp", "dp-naive", "tp", "pp"} <= set(listed)


def test_the_catalog_list_reads_is_the_registry():
    from parlab.runs.catalog import CATALOG

    assert CATALOG == [(name, scheme.help) for name, scheme in all_schemes().items()]


@pytest.mark.parametrize("command", [["list"], ["--help"], ["plan", "--top", "2"]])
def test_list_plan_and_help_answer_without_importing_torch(command):
    # Importing torch costs ~1.5-2 s on this machine; without it these commands answer in ~0.25 s.
    probe = f"import sys; from parlab.cli import main\ntry:\n    main({command!r})\nexcept SystemExit:\n    pass\n"
    probe += "print('torch imported:', 'torch' in sys.modules, file=sys.stderr)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert "torch imported: False" in out.stderr, out.stderr[-2000:]


def test_tour_runs_every_scheme_at_world_size_4_with_one_verdict_line_each():
    out = _cli("tour")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if not line.startswith("  ")]
    twins = [line for line in out.stdout.splitlines() if line.startswith("  ")]  # each scheme's PyTorch twin
    assert [line.split(" ")[0] for line in lines] == list(all_schemes())
    for line in lines:
        assert "(world 4): matches single device: max |err|" in line and line.endswith(": PASS"), line
    assert len(twins) == len(lines), twins
    for line in twins:
        assert line.endswith(": PASS") or ": SKIPPED: " in line, line


@pytest.mark.parametrize(
    "argv, message",
    [
        (["tour", "--world", "0"], "--world 0: the number of ranks must be >= 1"),
        (["run", "tp", "--heads", "0"], "--heads 0 must be >= 1"),  # the flag, not the Python field
        (["run", "pp", "--layers", "2"], "every stage needs at least one block"),
        (["run", "pp", "--microbatches", "0"], "microbatches m=0 must be >= 1"),
        (["run", "pp", "--split", "a,b"], "argument --split: 'a,b' is not a comma-separated list of integers"),
        (["run", "dp", "--batch", "x"], "argument --batch: 'x' is not a valid int"),
        (["run", "collectives", "--world", "-1"], "--world -1 must be >= 1"),
        (["run", "nope"], "argument SCHEME: invalid choice: 'nope'"),
    ],
)
def test_bad_options_print_one_error_line_and_start_no_process(argv, message, monkeypatch, capsys):
    def no_launch(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(runs, "launch", no_launch)
    try:
        status = main(argv)
    except SystemExit as exc:  # argparse's own errors exit from parse_args
        status = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    assert len(err) == 1 and err[0].startswith("parlab: error: ") and message in err[0], err


def test_tour_at_world_3_runs_what_accepts_3_and_says_why_it_skipped_the_rest():
    out = _cli("tour", "--world", "3", "--no-twin")  # the twins: the world-4 tour above
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    ran = {line.split()[0]: line for line in lines if line.split()[1:3] == ["(world", "3):"]}
    skipped = {line.split()[0]: line for line in lines if " skipped at world size 3: " in line}
    assert "collectives" in ran and not set(ran) & set(skipped), lines
    assert set(ran) | set(skipped) == set(all_schemes()), lines  # every scheme either ran or was skipped, with why
    assert all(line.endswith(": PASS") for line in ran.values()), lines
    assert "heads=4 is not divisible by world_size=3" in skipped["tp"]
    assert "not divisible by world_size=3" in skipped["dp"]


def test_plan_prints_the_best_plans_and_refuses_nonsense(capsys):
    assert main(["plan", "--top", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("174.6B parameters on 1024 devices of 80 GB") and len(lines) == 3
    # With SP the stage-boundary sends are 1/tp as big, so deeper pipelines win (tests/test_planner.py checks that
    # without SP the best plan is Megatron-LM's TP 8 x PP 8 for GPT-3 on 1024 GPUs).
    assert lines[1].startswith("DP 8 x TP 8 x PP 16 + SP") and "fits" in lines[1]
    assert main(["plan", "--layers", "0"]) == 2
    assert capsys.readouterr().err.strip() == "parlab: error: --layers 0: must be positive"
