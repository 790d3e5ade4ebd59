"""parlab.views.replay: a recorded trace played back; each frame's bars and state are checked against the events."""

import pytest

from parlab.core.trace import Event, Trace
from parlab.lessons.sequence_parallel import ring_demo, ring_steps
from parlab.views.replay import detect, replay, state_at


def _pipeline():
    """Two stages, two micro-batches, 1F1B by hand: F0 F1 B0 B1 on rank 0, F0 B0 F1 B1 on rank 1 (1 s each)."""
    order = {0: [("forward", 0), ("forward", 1), ("backward", 0), ("backward", 1)],
             1: [("forward", 0), ("backward", 0), ("forward", 1), ("backward", 1)]}  # fmt: skip
    events = []
    for rank, actions in order.items():
        for k, (kind, mb) in enumerate(actions):
            start = k + rank
            events.append(Event(rank, kind, start, start + 1, label=f"{kind[0].upper()}{mb}", extra={"mb": mb}))
    events.append(Event(0, "send", 1.0, 1.1, bytes=64, label="F0", peer=1))
    return Trace(events, 2)


def _dp():
    events = [Event(r, "backward", 0.0, 3.0, label="backward") for r in range(2)]
    for r in range(2):
        events += [Event(r, "all_reduce", 1.0 + b, 2.0 + b, bytes=100, label=f"bucket {b}") for b in range(2)]
    return Trace(events, 2)


def test_each_lesson_timeline_kind_is_recognised():
    assert detect(_pipeline()) == "pipeline" and detect(_dp()) == "dp"
    zero = Trace([Event(0, "all_gather", 0, 1, bytes=8, label="fwd blocks.0")], 1)
    offload = Trace([Event(0, "offload", 0, 1, bytes=8, label="grads")], 1)
    ps = Trace([Event(1, "send", 0, 1, bytes=8, label="push grad 0", peer=0)], 2)
    ring = Trace([Event(0, "compute", 0, 1, label="tile q0 k0", extra={"attn": "fwd"})], 1)
    assert [detect(t) for t in (zero, offload, ps, ring)] == ["zero", "offload", "ps", "ring"]
    with pytest.raises(ValueError, match="unknown replay kind"):
        state_at(zero, 0.0, kind="nope")


def test_pipeline_frames_grow_the_bars_up_to_the_moment_and_count_micro_batches_in_flight():
    trace = _pipeline()
    fig = replay(trace, frames=9, unit="s")  # a frame every 0.625 s over the 5 s run
    assert len(fig.frames) == 9 and [f.name for f in fig.frames][:3] == ["0.0", "0.6", "1.2"]
    mid = fig.frames[4]  # t = 2.5 s
    forward = mid.data[0]  # the first kind seen: rank 0's and rank 1's forwards, in time order
    assert list(forward.x) == [1.0, 1.0, 1.0, 0.0]  # rank 0's F0 and F1 and rank 1's F0 done; rank 1's F1 not begun
    assert list(forward.text) == ["F0", "F1", "F0", ""]
    assert mid.layout.shapes[0].x0 == 2.5  # the "now" line
    state = mid.layout.annotations[0].text
    assert "rank 0: 2 micro-batches in flight [0, 1]; 64 payload bytes so far" in state  # F0, F1 done, B0 running
    assert "rank 1: 1 micro-batches in flight [0]; 0 payload bytes so far" in state
    half = {bar.name: list(frame.x) for bar, frame in zip(fig.data, fig.frames[2].data, strict=True)}  # t = 1.25 s
    assert half["forward"] == [1.0, 0.25, 0.25, 0.0] and half["send"] == [pytest.approx(0.1)]  # the send is done
    assert "now: backward B0" in state
    assert state_at(trace, 5.0)[0].startswith("rank 0: 0 micro-batches in flight")  # all drained at the end
    # play at four speeds and pause; a step slider with one step per frame, on the whole run to begin with
    labels = [b.label for b in fig.layout.updatemenus[0].buttons]
    assert labels == ["▶ ½×", "▶ 1×", "▶ 2×", "▶ 4×", "❚❚ pause"]
    durations = [b.args[1]["frame"]["duration"] for b in fig.layout.updatemenus[0].buttons]
    assert durations == [500, 250, 125, 62, 0]
    slider = fig.layout.sliders[0]
    assert [s.args[0][0] for s in slider.steps] == [f.name for f in fig.frames] and slider.active == 8


def test_dp_state_counts_buckets_done_and_in_flight():
    lines = state_at(_dp(), 2.5)
    assert lines[0].startswith("rank 0: buckets all-reduced 1, in flight 1; 100 payload bytes so far")


def test_ring_replay_follows_the_k_v_blocks_of_a_real_run():
    results = ring_demo(4)  # the lesson's own ring attention, 4 ranks
    trace = results.trace
    steps = ring_steps(trace, 4, "contiguous")  # what lesson 04 draws: held[s][r]
    fwd_recvs = {r: [e for e in trace.select(kind="recv", rank=r) if e.label.startswith("kv fwd")] for r in range(4)}
    compared = 0
    for r in range(4):  # each rank at its own pace (on a loaded machine the ranks drift apart)
        for s in range(1, 4):
            got = fwd_recvs[r][s - 1].end - trace.t0  # rank r has just received its s-th block ...
            nxt = fwd_recvs[r][s].start - trace.t0 if s < len(fwd_recvs[r]) else got + 1e-6  # ... not yet the next
            line = state_at(trace, (got + nxt) / 2)[r]
            if "(fwd)" in line:  # (after its last block a rank with fewer causal tiles may be in its backward)
                assert line.startswith(f"rank {r}: holds K/V of rank {steps['held'][s][r]} (fwd)"), (r, s, line)
                compared += 1
    assert compared >= 8  # of the 12 (rank, step) moments
    end = replay(trace, frames=5).frames[-1].layout.annotations[0].text
    assert end.count("score tiles done") == 4


def test_a_saved_trace_loads_as_it_was_and_replays_from_its_file(tmp_path):
    import parlab

    trace = _pipeline()
    trace.events[0].group, trace.events[0].axis, trace.events[0].device = (0, 1), "pp", "cpu"
    path = trace.save(tmp_path / "run.jsonl")
    back = Trace.load(path)
    assert back.world_size == 2 and back.events == trace.events and back.events[0].group == (0, 1)
    figure = parlab.replay(str(path), frames=5)
    assert len(figure.frames) == 5 and figure.layout.sliders[0].currentvalue.xanchor == "right"
    assert [f.name for f in figure.frames] == [f.name for f in replay(trace, frames=5).frames]
    (tmp_path / "other.jsonl").write_text('{"format": "parlab-trace", "version": 2, "world_size": 2, "events": 0}\n')
    with pytest.raises(ValueError, match="version 2"):
        Trace.load(tmp_path / "other.jsonl")
    (tmp_path / "cut.jsonl").write_text("\n".join(path.read_text().splitlines()[:-1]) + "\n")
    with pytest.raises(ValueError, match="promises 9 events, the file holds 8"):
        Trace.load(tmp_path / "cut.jsonl")
    (tmp_path / "notes.txt").write_text("hello\n")
    with pytest.raises(ValueError, match="not a parlab trace"):
        Trace.load(tmp_path / "notes.txt")
    trace.events[0].extra["tensor"] = object()
    with pytest.raises(ValueError, match="JSON cannot keep"):
        trace.save(tmp_path / "bad.jsonl")
