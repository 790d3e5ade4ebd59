"""The errors a launch raises and the results it returns (re-exported by parlab.launch)."""

from __future__ import annotations

from parlab.core.trace import Trace

# ------------------------------------------------------------------------------------------------------ errors


class RankError(RuntimeError):
    """A rank raised (or died). `rank` is the first rank that failed; `remote_traceback` is its traceback.

    `reason`, when set, says what went wrong outside the rank's own code (e.g. a return value that cannot be
    sent back to the parent, naming the part of the value at fault)."""

    def __init__(self, rank: int, remote_traceback: str, stdout: str = "", reason: str = ""):
        self.rank, self.remote_traceback, self.stdout, self.reason = rank, remote_traceback, stdout, reason
        text = f"rank {rank} failed; the other ranks were stopped.\n"
        if reason:
            text += reason.rstrip() + "\n"
        text += f"\n--- traceback on rank {rank} ---\n" + remote_traceback.rstrip()
        if stdout.strip():
            text += f"\n--- rank {rank} printed ---\n{stdout.rstrip()}"
        super().__init__(text)


class LaunchTimeout(TimeoutError):
    """Some ranks had not finished when the timeout expired (a hang: e.g. mismatched collectives).

    `unfinished`: those ranks; `calls`: what each rank was doing, in words ("in all_reduce #3 (8 bytes, world)
    for 1.9 s", "computing (not in a traced call)", "returned")."""

    def __init__(self, timeout: float, unfinished: list[int], world_size: int, calls: dict[int, str] | None = None):
        self.unfinished, self.calls = unfinished, calls or {}
        finished = sorted(set(range(world_size)) - set(unfinished))
        text = (
            f"ranks {unfinished} had not finished after {timeout:g} s and were stopped "
            f"(finished: {finished or 'none'}). A hang like this usually means the ranks called "
            "different collectives, or a send without its matching recv."
        )
        if self.calls:
            text += "\nWhat each unfinished rank was doing:" + "".join(
                f"\n  rank {rank}: {self.calls[rank]}" for rank in unfinished if rank in self.calls
            )
        super().__init__(text)


class CollectiveMismatch(LaunchTimeout):
    """Ranks waited in communication calls that can never match, so `launch` stopped them early.

    A subclass of `LaunchTimeout` because it is a hang, diagnosed before the timeout: `except LaunchTimeout`
    catches both. `stuck`: the ranks whose calls can never complete; `calls`: every rank's state, in words;
    `entered`: when (time.monotonic()) the last of the stuck ranks entered its call. `advice`: what to do, when
    the hang is no mismatch between ranks (e.g. a second wait() on a finished handle); else the general advice.
    """

    def __init__(
        self, what: str, stuck: list[int], waited: float, entered: float, calls: dict[int, str], advice: str = ""
    ):
        self.stuck, self.entered, self.calls = stuck, entered, calls
        self.unfinished = sorted(r for r, state in calls.items() if state != "returned")
        returned = sorted(r for r, state in calls.items() if state == "returned")
        parts = [f"rank {stuck[0]} is {calls[stuck[0]]}"] + [f"rank {r} {calls[r]}" for r in stuck[1:]]
        parts += [f"rank {r} had returned" for r in returned]
        text = f"{what}: " + ", ".join(parts) + "."
        if advice:
            text += f"\nThis can never complete (the ranks waited {waited:.1f} s and were stopped). {advice}"
        else:
            text += (
                f"\nThese calls can never match (the ranks waited {waited:.1f} s and were stopped): every rank of a "
                "group must make the same collective calls in the same order (same operation, size, group and "
                "root), and each send needs a matching recv."
            )
        others = [r for r in self.unfinished if r not in stuck]
        if others:
            text += "\nThe other ranks:" + "".join(f"\n  rank {r}: {calls[r]}" for r in others)
        TimeoutError.__init__(self, text)


class Results(list):
    """What each rank returned, in rank order, plus the merged `trace` and each rank's printed `stdout`.

    `seed`: the launch's seed (rank r's generators were seeded with seed + r; None when not launched).
    `spares`: how many ranks were spares the rank server prepared ahead (parlab.launch's _spares_wanted).
    `backend`: "gloo" or "nccl" (None when not launched by parlab.launch).
    `phases`: per rank, when it reached each phase of its start, in seconds after the launch handed the job over:
    "rank_start" (its process runs parlab's rank code), "cuda_context" (NCCL only: its GPU set and its CUDA
    context made), "process_group" (torch.distributed ready; under NCCL its communicator made), "fn_done" (the
    function returned). `python -m parlab doctor` prints them."""

    def __init__(
        self,
        values: list,
        trace: Trace,
        stdout: list[str],
        seconds: float,
        seed: int | None = None,
        spares: int = 0,
        backend: str | None = None,
        phases: list[dict[str, float]] | None = None,
    ):
        super().__init__(values)
        self.trace, self.stdout, self.seconds, self.seed, self.spares = trace, stdout, seconds, seed, spares
        self.backend, self.phases = backend, phases

    def derived(self, values: list, trace: Trace | None = None) -> Results:
        """The same launch with other values (and trace): what a report keeps of it, the launch's facts intact."""
        return Results(
            values,
            self.trace if trace is None else trace,
            self.stdout,
            self.seconds,
            self.seed,
            self.spares,
            self.backend,
            self.phases,
        )
