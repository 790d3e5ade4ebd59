"""parlab.launch: results in rank order, errors with the rank's traceback, hangs end, nothing left behind."""

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
from processes import ranks_of

import parlab
from parlab.core import comm
from parlab.runtime.server import rank_server_pid


def _rank_processes(settle: float = 2.0) -> list[int]:
    """The rank server's children that are not spares. A spare forked a moment ago has not named itself yet (it
    still has the server's name): give it `settle` seconds; a rank that outlived its launch stays."""
    deadline = time.monotonic() + settle
    while True:
        pid = rank_server_pid()
        ranks = [] if pid is None else ranks_of(pid)
        if not ranks or time.monotonic() > deadline:
            return ranks
        time.sleep(0.05)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_results_come_back_in_rank_order_as_tensors():
    def fn(scale, offset=0.0):
        t = torch.full((3,), float(dist.get_rank()))
        comm.all_reduce(t)
        return {"rank": dist.get_rank(), "world": dist.get_world_size(), "t": t * scale + offset}

    results = parlab.launch(fn, 4, 2.0, offset=1.0)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert all(r["world"] == 4 for r in results)
    for r in results:
        assert isinstance(r["t"], torch.Tensor)
        assert torch.equal(r["t"], torch.full((3,), (0 + 1 + 2 + 3) * 2.0 + 1.0))


def test_closures_and_locals_travel_by_value():
    secret = torch.arange(5.0)

    def fn():
        return secret * (dist.get_rank() + 1)

    results = parlab.launch(fn, 2)
    assert torch.equal(results[1], secret * 2)


def test_trace_records_bytes_from_the_tensors_passed():
    def fn():
        comm.all_reduce(torch.ones(10, dtype=torch.float64))
        if dist.get_rank() == 0:
            comm.send(torch.ones(3, dtype=torch.float32), dst=1)
        elif dist.get_rank() == 1:
            comm.recv(torch.empty(3, dtype=torch.float32), src=0)
        with comm.span("work", kind="forward"):
            torch.ones(100).sum()

    results = parlab.launch(fn, 3)
    table = results.trace.bytes_per_rank()
    assert table["all_reduce"] == [80, 80, 80]
    assert table["send"] == [12, 0, 0]
    assert table["recv"] == [0, 12, 0]
    spans = results.trace.select(kind="forward")
    assert len(spans) == 3 and all(e.end >= e.start for e in spans)


def test_rank_prints_come_back_in_rank_order(capsys):
    def fn():
        print(f"hello from {dist.get_rank()}")

    results = parlab.launch(fn, 3)
    assert results.stdout == ["hello from 0\n", "hello from 1\n", "hello from 2\n"]
    assert capsys.readouterr().out == "[rank 0] hello from 0\n[rank 1] hello from 1\n[rank 2] hello from 2\n"


def test_a_failing_rank_raises_with_its_rank_and_traceback_and_stops_the_others():
    def fn():
        if dist.get_rank() == 2:
            raise ValueError("rank two is unhappy")
        time.sleep(60)  # the others would wait for a long time: they must be stopped instead

    started = time.perf_counter()
    with pytest.raises(parlab.RankError) as info:
        parlab.launch(fn, 4, timeout=30)
    assert time.perf_counter() - started < 10
    assert info.value.rank == 2
    assert "ValueError: rank two is unhappy" in str(info.value)
    assert "rank 2 failed" in str(info.value)
    assert _rank_processes() == []


def test_a_rank_that_dies_without_a_word_is_reported():
    def fn():
        if dist.get_rank() == 1:
            os._exit(3)
        time.sleep(60)

    with pytest.raises(parlab.RankError, match="exited with code 3") as info:
        parlab.launch(fn, 2, timeout=30)
    assert info.value.rank == 1


def test_a_hang_ends_at_the_timeout_naming_the_unfinished_ranks():
    def fn():
        if dist.get_rank() in (1, 3):  # only two ranks join the all_reduce: a hang
            comm.all_reduce(torch.ones(2))

    started = time.perf_counter()
    with pytest.raises(parlab.LaunchTimeout) as info:
        parlab.launch(fn, 4, timeout=2)
    assert time.perf_counter() - started < 8
    assert info.value.unfinished == [1, 3]
    assert "ranks [1, 3] had not finished after 2 s" in str(info.value)
    assert _rank_processes() == []


def test_interrupt_stops_the_ranks():
    def fn():
        time.sleep(60)

    timer = threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        parlab.launch(fn, 2, timeout=30)
    assert _rank_processes() == []
    assert parlab.launch(lambda: dist.get_rank(), 2) == [0, 1]  # and the next launch works


@pytest.mark.parametrize(
    "fn, world_size, kwargs, error, message",
    [
        (lambda: 0, 0, {}, ValueError, "world_size must be >= 1, got 0"),
        (lambda: 0, 2.0, {}, TypeError, "world_size must be an int, got 2.0"),
        (lambda: 0, True, {}, TypeError, "world_size must be an int"),
        ("not a function", 2, {}, TypeError, "fn must be callable, got str"),
        (lambda: 0, 2, {"backend": "mpi"}, ValueError, "backend must be 'gloo' or 'nccl'"),
        (lambda: 0, 2, {"timeout": 0}, ValueError, "timeout must be a finite number of seconds > 0"),
    ],
)
def test_bad_arguments_are_rejected_before_any_process_starts(fn, world_size, kwargs, error, message):
    before = _rank_processes()
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        parlab.launch(fn, world_size, **kwargs)
    assert _rank_processes() == before


@pytest.mark.skipif(torch.cuda.device_count() >= 64, reason="needs fewer GPUs than ranks")
def test_more_gpu_ranks_than_gpus_is_rejected():
    with pytest.raises(ValueError, match="needs one GPU per rank: world_size=64"):
        parlab.launch(lambda: 0, 64, backend="nccl")


def test_no_processes_or_file_descriptors_leak_over_50_launches():
    def fn():
        t = torch.ones(4)
        comm.all_reduce(t)
        return t.sum()

    parlab.launch(fn, 4)  # warm up: the rank server exists from here on
    fds_before, server = _open_fds(), rank_server_pid()
    for i in range(50):
        if i % 10 == 5:  # failures and timeouts in between must not leak either
            with pytest.raises(parlab.RankError):
                parlab.launch(lambda: 1 / 0, 2)
        else:
            assert parlab.launch(fn, 4)[3] == 16.0
    assert rank_server_pid() == server  # the same server served every launch
    assert _rank_processes() == []
    assert _open_fds() == fds_before


def test_a_notebooks_progress_bar_goes_once_the_ranks_report():
    """A stored lesson (and its slides) keeps no bar per launch; a launch that ended without a report keeps its
    last state (where it was when it stopped)."""
    from parlab.runtime.progress import _ProgressLine

    class Handle:
        def __init__(self):
            self.shown = []

        def update(self, data, raw):
            self.shown.append(data)

    shown = {}
    for reported in (True, False):
        bar = _ProgressLine(2)
        bar.enabled, bar.notebook, bar.last, bar.handle = True, True, "2/2 ranks started after 3 s", Handle()
        bar._show_html = lambda text, done, total, bar=bar: bar.handle.shown.append(text)
        bar.close(reported=reported)
        shown[reported] = bar.handle.shown
    assert shown[True] == [{"text/html": ""}]  # emptied in place: nothing left under the cell
    assert len(shown[False]) == 1 and "0/2 ranks started after" in shown[False][0]  # its final state, redrawn


def test_progress_from_the_ranks_reaches_the_parent(monkeypatch, capsys):
    from parlab.runtime.progress import _ProgressLine

    monkeypatch.setattr(_ProgressLine, "FORCE", True)
    monkeypatch.setattr(_ProgressLine, "DELAY", 0.0)

    def fn():
        for step in range(3):
            time.sleep(0.3 * (dist.get_rank() + 1))  # rank 1 is the slowest
            parlab.progress(step + 1, 3, "step")
        return dist.get_rank()

    assert parlab.launch(fn, 2) == [0, 1]
    err = capsys.readouterr().err
    assert "2/2 ranks started" in err
    assert "step 3/3" in err.splitlines()[-1]  # the last line: the slowest rank is done too
