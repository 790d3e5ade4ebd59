"""Why a launch did not finish: ranks waiting in calls that can never match (a hang), and a rank's death explained
(gloo's size mismatches seen in its stderr). `parlab.launch` calls these; each rank publishes the call it is in
through `parlab.runtime.rank._CallBoard`."""

from __future__ import annotations

import json
import re
import time

from parlab.runtime import MISMATCH_SECONDS
from parlab.runtime.errors import CollectiveMismatch, RankError

_GLOO_MISMATCH = re.compile(r"(doesn't match expected size|size mismatch|collective mismatch|op mismatch)", re.I)


def _died(rank: int, report: dict, calls: dict[int, str]) -> RankError:
    """The error for a rank that exited without a message: its exit code, the last lines it wrote to its own
    stderr (the rank server captured them), and a collective mismatch if gloo reported one."""
    code = report["exit_codes"].get(rank)
    text = f"the process exited with code {code} before returning a result"
    own = [line for line in report.get("stderr_tails", {}).get(rank, "").splitlines() if line.strip()][-8:]
    if own:
        text += "\n--- the last lines it wrote to its stderr ---\n" + "\n".join(own)
    return RankError(rank, text, "", _mismatch(report, calls))


def _mismatch(report: dict, calls: dict[int, str]) -> str:
    """When gloo said on some rank's stderr that the ranks' calls disagree: a collective mismatch, named with
    gloo's words and what each rank was doing (its traced call); else ''."""
    tails = report.get("stderr_tails", {})
    said = [(r, line.strip()) for r in sorted(tails) for line in tails[r].splitlines() if _GLOO_MISMATCH.search(line)]
    if not said:
        return ""
    where, line = said[0]
    reason = (
        f"Collective mismatch: gloo on rank {where} said: {line[:300]}\n"
        "The ranks of a group called one collective with different sizes or kinds (every rank must make the "
        "same calls in the same order: same operation, size, dtype, group and root)."
    )
    known = {r: state for r, state in sorted(calls.items()) if state and not state.startswith("computing")}
    if known:
        reason += "\nWhat each rank was doing:" + "".join(f"\n  rank {r}: {state}" for r, state in known.items())
    return reason


# ---------------------------------------------------------------------------------------------- hang diagnosis
#
# Each rank publishes its state (see _CallBoard below) as a dict:
#     {"call": the traced call it waits in, or None while it computes,
#      "pending": its asynchronous calls not yet waited for, "done": True once it has returned,
#      "finished": {stream: how many calls of that stream it has finished}}
# where a call is {"i": its index among the rank's traced calls (1-based), "kind", "bytes", "peer", "group",
# "label", "stream" and "k": it is the k-th call of its stream (a group's collectives: "0,1,2"; the sends from
# rank 0 to rank 1: "0>1"), "since": time.monotonic() when the rank entered it, and for the call it is in, "how":
# "call" (in the call itself), "wait" (in wait() on an asynchronous call) or "again" (in a second wait() on a
# handle already waited for: that call has completed, and gloo's wait() on it never returns)}.

P2P = ("send", "recv")


def _members(call: dict, world_size: int) -> tuple[int, ...]:
    return tuple(call["group"]) if call["group"] is not None else tuple(range(world_size))


def _matches(rank: int, call: dict, other_rank: int, other: dict, world_size: int) -> bool:
    """Could `call` on `rank` and `other` on `other_rank` be two halves of one operation?"""
    if call["kind"] in P2P or other["kind"] in P2P:
        if {call["kind"], other["kind"]} != set(P2P):
            return False
        if call["kind"] == "send":
            src, send, dst, recv = rank, call, other_rank, other
        else:
            src, send, dst, recv = other_rank, other, rank, call
        return send["peer"] == dst and recv["peer"] in (src, None) and send["bytes"] == recv["bytes"]
    if (call["kind"], call["peer"]) != (other["kind"], other["peer"]):  # peer: broadcast's src, reduce's dst
        return False
    if _members(call, world_size) != _members(other, world_size):
        return False
    return call["kind"] == "all_to_all" or call["bytes"] == other["bytes"]  # all_to_all chunks may be uneven


def _partners(rank: int, call: dict, world_size: int) -> list[int]:
    """The ranks that `call` on `rank` waits for."""
    if call["kind"] in P2P:
        return [] if call["peer"] is None else [call["peer"]]  # recv from any rank: cannot tell
    return [r for r in _members(call, world_size) if r != rank and 0 <= r < world_size]


def _stuck_ranks(states: list[dict | None], world_size: int) -> list[int]:
    """The ranks waiting in calls that can never complete, from each rank's published state.

    A rank's call may complete if every rank it waits for is computing (it may still come), or is past the
    matching call, or waits in (or has pending) a matching call, or waits in another call that may itself
    complete. Start with every waiting rank
    and drop those whose call may complete until nothing changes: the ranks left wait for each other, or for
    ranks that have returned, in calls that do not match: a deadlock.
    """
    stuck = {r for r, state in enumerate(states) if state and state.get("call")}
    changed = True
    while changed:
        changed = False
        for rank in sorted(stuck):
            call = states[rank]["call"]
            if call.get("how") == "again":
                continue  # a second wait() on a finished handle: no rank can complete it
            partners = _partners(rank, call, world_size)
            if any(not 0 <= p < world_size for p in partners):
                continue  # a send to (or recv from) a rank that does not exist can never complete
            if all(_may_serve(p, states[p], rank, call, stuck, world_size) for p in partners):
                stuck.discard(rank)
                changed = True
    return sorted(stuck)


def _may_serve(partner: int, state: dict | None, rank: int, call: dict, stuck: set, world_size: int) -> bool:
    if state is None or not state.get("done") and state.get("call") is None:
        return True  # computing: it may still make the matching call
    if call.get("stream") is not None and state.get("finished", {}).get(call["stream"], 0) >= call["k"]:
        return True  # it is past the matching call (calls match in order): this one will complete
    if state.get("done"):
        return False
    offers = [c for c in (state["call"], *state.get("pending", [])) if c.get("how") != "again"]
    if any(_matches(rank, call, partner, other, world_size) for other in offers):
        return True
    return partner not in stuck  # in another call that may complete, after which it may come


def _describe_call(call: dict, world_size: int) -> str:
    """ "all_reduce #3 (4 bytes, world)", "send #2 (12 bytes to rank 1)", "broadcast #1 (8 bytes, src=1, world)"."""
    kind, parts = call["kind"], []
    if kind == "send":
        parts.append(f"{call['bytes']} bytes to rank {call['peer']}")
    elif kind == "recv":
        parts.append(f"{call['bytes']} bytes from " + ("any rank" if call["peer"] is None else f"rank {call['peer']}"))
    else:
        if kind != "barrier":
            parts.append(f"{call['bytes']} bytes")
        if kind in ("broadcast", "reduce"):
            parts.append(f"{'src' if kind == 'broadcast' else 'dst'}={call['peer']}")
        members = _members(call, world_size)
        parts.append("world" if members == tuple(range(world_size)) else f"group {list(members)}")
    if call.get("label"):
        parts.append(repr(call["label"]))
    text = f"{kind} #{call['i']} ({', '.join(parts)})"
    if call.get("how") == "wait":
        return f"wait() on {text}"
    if call.get("how") == "again":
        return f"a second wait() on {text}, which had already completed"
    return text


class _HangWatch:
    """The parent's view of each rank's published state, and the diagnosis of calls that can never match."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.states: list[dict | None] = [None] * world_size
        self.seen_at = 0.0  # time.monotonic() when the server read the states

    def update(self, raw: list[bytes | None], at: float) -> None:
        self.seen_at = at
        for rank, data in enumerate(raw):
            if data:  # b"": nothing published yet; None: being written, keep the last state
                try:
                    self.states[rank] = json.loads(data)
                except ValueError:
                    pass

    def mismatch(self) -> CollectiveMismatch | None:
        """The error to raise if some ranks have waited MISMATCH_SECONDS in calls that can never match."""
        stuck = _stuck_ranks(self.states, self.world_size)
        if not stuck:
            return None
        entered = max(self.states[r]["call"]["since"] for r in stuck)
        if self.seen_at - entered < MISMATCH_SECONDS:  # not yet seen still there MISMATCH_SECONDS after
            return None
        waited = time.monotonic() - entered
        calls = self.describe(with_time=False)
        again = [r for r in stuck if self.states[r]["call"].get("how") == "again"]
        if again:  # what the rank is blocked in is no communication with a peer: name it first
            stuck = again + [r for r in stuck if r not in again]
            what = "wait() called twice on the same handle"
            advice = (
                f"Rank {again[0]} called wait() on a send or receive it had already waited for: the transfer had "
                "completed, and gloo's wait() on a finished handle never returns. Wait for each handle once "
                "(keep the handles of one step apart from the next step's)."
            )
            return CollectiveMismatch(what, stuck, waited, entered, calls, advice=advice)
        kinds = {self.states[r]["call"]["kind"] for r in stuck}
        hows = {self.states[r]["call"].get("how", "call") for r in stuck}
        what = "send/recv mismatch" if kinds <= set(P2P) else "collective mismatch"
        if kinds == {"send"} and len(stuck) > 1:  # a cycle of sends: nobody is there to receive
            what = "deadlock: each of these ranks waits in a blocking send and none is receiving"
            if hows != {"call"}:  # some wait in wait() on an isend, not in a blocking send
                what = "deadlock: each of these ranks waits for its send to complete and none is receiving"
        return CollectiveMismatch(what, stuck, waited, entered, calls)

    def longest_wait(self) -> str:
        """ "rank 1 waits in all_reduce #3 (8 bytes, world) for 12 s" for the rank waiting longest, if over 2 s."""
        waiting = [
            (state["call"]["since"], rank) for rank, state in enumerate(self.states) if state and state.get("call")
        ]
        if not waiting or time.monotonic() - min(waiting)[0] < MISMATCH_SECONDS:
            return ""
        since, rank = min(waiting)
        call = _describe_call(self.states[rank]["call"], self.world_size)
        verb = "waits in" if self.states[rank]["call"].get("how", "call") == "call" else "is in"
        return f"rank {rank} {verb} {call} for {time.monotonic() - since:.0f} s"

    def describe(self, with_time: bool = True) -> dict[int, str]:
        """Each rank's state in words: "in all_reduce #3 (8 bytes, world) for 1.9 s", "returned", ..."""
        now, words = time.monotonic(), {}
        for rank, state in enumerate(self.states):
            if state is None:
                words[rank] = "computing (no traced call yet)"
            elif state.get("done"):
                words[rank] = "returned"
            elif state.get("call") is None:
                words[rank] = "computing (not in a traced call)"
            else:
                call = state["call"]
                words[rank] = "in " + _describe_call(call, self.world_size)
                if with_time:
                    words[rank] += f" for {now - call['since']:.1f} s"
        return words
