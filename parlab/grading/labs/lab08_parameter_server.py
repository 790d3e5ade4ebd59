"""Lab 08's checks: a synchronous server with a backup worker (the first A gradients of each version count, the late
ones are dropped), an asynchronous server that keeps every gradient's staleness within D only by when it replies, a
bounded-staleness (SSP) server that keeps its read guarantee with a staleness-aware learning rate, and sharded
servers that replicate their shards so that a backup takes over a failed server exactly, with a prediction of that
run's traffic; on live ranks (see parlab/grading).

Every run trains the labs' model (parlab.core.lab_model: Psi = 22,688 float64 parameters in 21 tensors of very
different sizes: the grouped-query K/V projections are half the Q projection, the RMSNorm gains 32 values).

- backup: rank 0 runs the student's server on the flat parameters theta [Psi] with Adam; ranks 1..N run this module's
  `backup_worker` (each pull carries theta_v and its version v; v = -1 stops the worker).
- staleness, ssp: rank 0 runs the student's server with SGD; ranks 1..N run parlab's worker (parlab.schemes.
  parameter_server.run_worker: K times pull, gradient of its b = B/N rows, push; then one last pull), worker 3 a
  straggler; each bound in its own launch.
- sharded, failover_bytes: ranks 0..S-1 run the student's server on their shard with Adam, each the backup of the
  shard before its own; ranks S..S+N-1 run the student's worker. A server may fail after a given step.

What a server did is read from its process-group calls (parlab.core.probe) and from parlab.core.comm's trace (every
send and receive, in program order, with its peer and bytes); what it computed is checked against one device (Adam on
the whole batch), or, for a server whose order depends on timing, by replaying on one device the run's own order under
the part's rule. Calls into the library's parameter server (parlab/schemes/parameter_server.py, lesson 08's helpers)
or into this module (the judges' references) are seen and fail the part (parlab/grading/labs/guard.py).

Every launch stops after LAUNCH["timeout"] seconds: a server that never answers a worker is reported then, with what
each rank was waiting in (in parts 2 and 3 as a FAIL line of that bound's run).
"""

from __future__ import annotations

import functools
import re
import time

import torch
import torch.distributed as dist

import parlab
from parlab.core import comm, probe
from parlab.core.check import compare
from parlab.core.lab_model import LabConfig, build_lab_model, lab_batches, lab_loss
from parlab.grading.labs import prediction_lines, run_check
from parlab.grading.labs.guard import library_calls, library_line
from parlab.grading.labs.lab08_setup import adam_step
from parlab.schemes.parameter_server import run_worker, train_parameter_server

LAUNCH = {"timeout": 15, "echo": False}  # a correct run takes 1-4 s; a server that never answers is stopped at 15 s
# What the answers must not call: lesson 08's servers and helpers, and this module (the judges' own references).
LIBRARY = ("schemes/parameter_server.py", "lessons/parameter_server.py", "grading/labs/lab08_parameter_server.py")
CFG = LabConfig()  # the lab model: float64, Psi = 22,688 parameters in 21 tensors
N, B = 3, 6  # workers, global batch rows (b = 2 rows per worker)
ADAM_LR = 0.01  # parts 1 and 4: the servers' Adam (lab08_setup.adam_step)
LR = 0.1  # part 3: SGD's learning rate, before the staleness scaling

# Part 1: A = TAKE of the N gradients computed on a version make its update; U updates in a run.
TAKE = 2
BACKUP_RUNS = {
    "race": {"updates": 6, "late": None, "delay": 0.0, "seed": 3},  # three equal workers: whoever comes third is late
    "straggler": {"updates": 4, "late": 3, "delay": 0.25, "seed": 4},  # worker 3 idles 0.25 s before every push
}

# Parts 2 and 3: worker 3 a straggler, K = 4 steps. Part 2: plain SGD, every gradient at most D updates stale, at
# D = 1 and D = 2. Part 3: SSP at s = 0 and s = 1; lr / (1 + tau).
STRAGGLER, SLOWDOWN = 3, 3.0
DELAY_STEPS, DELAY_BOUNDS = 4, (1, 2)
DELAY_BATCHES = lab_batches(CFG, B, DELAY_STEPS, seed=5)
SSP_STEPS, SSP_BOUNDS = 4, (0, 1)
# Part 3: worker FAILED fails at its step FAILS_AT: that push carries NaN (what a failure detector would report),
# then it stops, pulling nothing more; worker STRAGGLER is slow and alive.
FAILED, FAILS_AT = 2, 2
SSP_BATCHES = lab_batches(CFG, B, SSP_STEPS, seed=1)

# Part 4: S = 3 servers (ranks 0..2), N = 3 workers (ranks 3..5), K = 4 steps. Server j serves shard j and is the
# backup of shard j - 1 (mod S). FAILURES: (server, t): it fails after t steps (its steps 0..t-1 done, replication
# included); then its backup serves its shard. The plan of the check: layer by layer; of the prediction: round-robin.
SERVERS, STEPS = 3, 4
FAILURES = (None, (1, 2), (2, 4))
PREDICTED_FAILURE = (1, 2)
SHARD_BATCHES = lab_batches(CFG, B, STEPS, seed=0)

STRUCTURAL = {
    "backup": "two runs of 3 workers, 2 gradients counted per version (Adam on the server, U = 6 and U = 4 "
    "updates), the second with worker 3 late every time: the server's messages (pulls of (theta, version) to "
    "the workers, gradients back, nothing else), every gradient received and every worker stopped; walked with the "
    "rule in the server's own order: every pull carried the version current when it was sent (-1 once U updates "
    "were made), no pull sent before the worker had a version it had not computed on (a counted gradient's worker "
    "waits for the update), none held past the server's next receive; the server's parameters, every gradient's "
    "loss and every worker's last parameters equal the one-device replay of the updates the rule makes (a FAIL "
    "names the first wrong tensor); no library collective, every message through parlab.core.comm, nothing of "
    "parlab's parameter server or this module called",
    "staleness": "at D = 1 and D = 2 with a straggler (plain SGD, every gradient applied on arrival): walked in the "
    "server's own order, every pull after the worker's previous gradient; every pull safe (whatever order the "
    "gradients then being computed arrive in, none applied more than D updates after the version it was computed "
    "on; a FAIL names the pull, the workers computing and the staleness one can reach); no pull still unsent at a "
    "receive when sending it was safe; every gradient's measured staleness at most D; N x K gradients, K + 1 pulls "
    "a worker; the one-device replay of the run in the server's order equals the server's final parameters, the "
    "loss of every gradient and every worker's last pull; a run that never finishes is reported by a FAIL line "
    "after the 15 s launch timeout; nothing of parlab's parameter server or this module called",
    "ssp": "at s = 0 and s = 1 with a straggler and worker 2 failing at its step 2 (its push carries NaN, then it "
    "stops), lr / (1 + tau): walked in the server's own order, every pull after the worker's previous gradient, "
    "none to the failed worker once its failure came; every pull (the last pull counting as step K) within s clocks "
    "of every worker alive at that moment (a FAIL names the pull and the worker too far behind); no pull still unsent "
    "at a receive once it was allowed; every living worker's K gradients applied and K + 1 pulls, the failed "
    "worker's earlier gradients applied and its NaN never; the one-device replay in the server's order, each "
    "gradient with lr / (1 + tau) (tau from the version the worker was sent), equals the server's final "
    "parameters, the loss of every gradient and every worker's last pull; a run that never finishes (a reply "
    "nobody can release) is reported by a FAIL line after the launch timeout; nothing of parlab's parameter server "
    "or this module called",
    "sharded": "3 servers and 3 workers, the plan layer by layer, 4 steps of Adam, three runs: no failure, server "
    "1 failing after 2 steps, server 2 after 4 (before the last pull): every server's messages with each "
    "worker (one message per shard it serves, each pull and push of exactly that shard's bytes, the failed "
    "server's shard served by its backup from the step after its failure) and with the other servers (to its "
    "backup one message of exactly its shard's bytes a step, none to or from a failed server, nothing else), "
    "synchronous per shard (a FAIL names the server, the peer, the sizes expected and found); every shard's final "
    "parameters on the server that serves it, every worker's parameters after its last pull and each step's mean "
    "loss equal one device's Adam on the whole batch (a FAIL names the run and the first wrong tensor or step); every "
    "message through parlab.core.comm, no library collective, nothing of parlab's parameter server or this module "
    "called",
    "failover_bytes": "the predicted bytes through the busiest server's link and the bytes sent from server to "
    "server, over the run, exact, for the lab model's tensors dealt round-robin over 3 servers, 3 workers, 4 steps "
    "and server 1 failing after 2 steps, from the tensors' sizes; the student's own sharded run of that setting "
    "measured beside them (shown, not scored)",
}


def run(check: str, *answers) -> None:
    """A check cell: see parlab.grading."""
    run_check(__name__, check, *answers)


# ------------------------------------------------------------------------------------------- shared helpers


def next_token_loss(model, x, y) -> torch.Tensor:
    """The lab model's mean next-token loss of rows x: [b, T] (y: x shifted by one)."""
    return lab_loss(model(x), y)


def flat_params(model) -> torch.Tensor:
    """The model's parameters side by side, in named_parameters() order: a new tensor [Psi]."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def flat_grads(model) -> torch.Tensor:
    """The model's gradients side by side: a new tensor [Psi]."""
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def set_params(model, vector: torch.Tensor) -> None:
    """Copy a [Psi] vector into the model's parameters (the inverse of flat_params)."""
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(vector[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def rows_of(batch, worker: int, workers: int):
    """Worker w's rows (w = 1..N) of a global batch (x, y) [B, T]: rows [(w-1)b, wb), b = B/N."""
    x, y = batch
    b = x.shape[0] // workers
    return x[(worker - 1) * b : worker * b], y[(worker - 1) * b : worker * b]  # [b, T] each


def _library_line(what: str, called: list[str]) -> str:
    # An import runs a module's body (<module>): not a call. A comprehension or lambda inside a function that was
    # called adds nothing to that function's name.
    called = [name for name in called if not name.endswith(": <module>") and ".<locals>.<" not in name]
    return library_line(what, called, "parlab's parameter server or this lab's checks")


def _calls(calls: list[dict]) -> list[list]:
    """A rank's process-group calls as plain data: [op, peer, bytes]."""
    return [[c["op"], int(c["peer"]), int(c["bytes"])] for c in calls]


@functools.lru_cache(maxsize=1)
def tensor_names() -> tuple[tuple[str, int], ...]:
    """The lab model's tensors, in named_parameters() order: (name, numel)."""
    return tuple((n, p.numel()) for n, p in build_lab_model(CFG).named_parameters())


def by_name(vector: torch.Tensor) -> dict[str, torch.Tensor]:
    """A flat [Psi] vector cut into the lab model's tensors (flattened), by name."""
    out, offset = {}, 0
    for name, numel in tensor_names():
        out[name] = vector[offset : offset + numel]
        offset += numel
    return out


def first_wrong_tensor(what: str, got: dict, expected: dict, against: str = "single device") -> str:
    """got and expected by tensor name: one verdict; a FAIL names the first wrong (or missing) tensor."""
    got = {n: t.reshape(-1) if isinstance(t, torch.Tensor) else t for n, t in got.items()}
    expected = {n: t.reshape(-1) for n, t in expected.items()}
    for name, want in expected.items():
        have = got.get(name)
        if not isinstance(have, torch.Tensor) or have.numel() != want.numel():
            came = "nothing" if have is None else f"{getattr(have, 'numel', lambda: '?')()} values"
            return f"{what}: {name}: expected {want.numel()} values, received {came}: FAIL"
    verdict = compare(what, [got[n] for n in expected], list(expected.values()), against=against)
    if verdict.passed:
        return verdict.line
    for name, want in expected.items():
        diff = (got[name].to(torch.float64) - want).abs()
        if not diff.max().item() <= 1e-10:
            i = int(diff.nan_to_num(float("inf")).argmax())
            return (
                f"{what}: {name}, element {i}: expected {want[i].item():.6g}, received {got[name][i].item():.6g} "
                f"(max |err| {diff.max().item():.1e}): FAIL"
            )
    return verdict.line


def recorded(fn, *args) -> dict:
    """Rank side: fn(*args) with its process-group calls recorded (parlab.core.probe: op, peer, bytes) and its
    library calls watched; its messages as parlab.core.comm traced them, in program order: [kind, peer, bytes]
    (the trace knows the sender of a receive from any rank, which the process group's call does not say)."""
    start = len(comm.trace_events())
    with probe.recording(keep_sent_data=False) as calls, library_calls(LIBRARY) as called:
        out = fn(*args)
    messages = [
        [e.kind, -1 if e.peer is None else int(e.peer), int(e.bytes)]
        for e in comm.trace_events()[start:]
        if e.kind in ("send", "recv")
    ]
    return {"out": out, "calls": _calls(calls), "messages": messages, "library": list(called)}


def through_comm_line(what: str, record: dict) -> str:
    """Every send and receive the rank made went through parlab.core.comm (so the checks can read its messages)."""
    p2p = sum(op in probe.P2P for op, _, _ in record["calls"])
    ok = p2p == len(record["messages"])
    found = f"found {p2p} sends and receives, {len(record['messages'])} of them through parlab.core.comm: FAIL"
    return f"{what}: every message through parlab.core.comm: {'PASS' if ok else found}"


def collective_line(what: str, calls_per_rank: list[list]) -> str:
    found = [(r, sorted({op for op, _, _ in calls if op not in probe.P2P})) for r, calls in enumerate(calls_per_rank)]
    found = [f"rank {r} called {ops}" for r, ops in found if ops]
    return (
        f"{what}: only send and recv, no library collective: {'PASS' if not found else '; '.join(found[:2]) + ': FAIL'}"
    )


def _host(value) -> torch.Tensor | None:
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else None


# ------------------------------------------------------------------------- 1 · a synchronous server with a backup


def backup_worker(model, batches, delay: float = 0.0) -> dict:
    """Part 1's worker (ranks 1..N; rank 0 serves). A pull is one message [Psi + 1]: theta_v, then its version v.
    While v >= 0: the gradient of this worker's b rows of batches[v] at theta_v, `delay` seconds idle (a late
    worker), then the push, one message [Psi]; and the next pull. A pull with v = -1 is the stop: its theta is the
    server's last version, loaded into the model, and the worker returns.

    Returns the versions it pulled (the last one -1), the loss of each gradient it pushed, and its final parameters."""
    rank, workers = dist.get_rank(), dist.get_world_size() - 1
    theta = flat_params(model)  # [Psi]
    pulled = torch.empty(theta.numel() + 1, dtype=theta.dtype, device=theta.device)  # [Psi + 1]: theta_v, v
    versions, losses = [], []
    while True:
        comm.recv(pulled, 0, label="pull")
        set_params(model, pulled[:-1])
        v = int(pulled[-1].item())
        versions.append(v)
        if v == -1:
            break
        if not 0 <= v < len(batches):
            raise ValueError(f"worker {rank} pulled version {v}: a version is 0..{len(batches) - 1}, or -1 to stop")
        x, y = rows_of(batches[v], rank, workers)  # [b, T] each
        model.zero_grad(set_to_none=True)
        loss = next_token_loss(model, x, y)
        loss.backward()
        losses.append(loss.item())
        time.sleep(delay)
        comm.send(flat_grads(model), 0, label=f"push (version {v})")  # g [Psi]
    return {"versions": versions, "losses": losses, "theta": flat_params(model).cpu()}


def _backup_rank(backup_server) -> dict:
    """Rank code: the two runs of BACKUP_RUNS one after the other, each from theta_0."""
    rank, out = dist.get_rank(), {}
    for tag, run_ in BACKUP_RUNS.items():
        batches = lab_batches(CFG, B, run_["updates"], seed=run_["seed"], device=parlab.device())
        model = build_lab_model(CFG, device=parlab.device())
        comm.barrier()  # the runs do not overlap
        if rank == 0:
            workers = list(range(1, N + 1))
            record = recorded(backup_server, flat_params(model), workers, TAKE, run_["updates"], ADAM_LR)
            out[tag] = {**record, "out": _host(record["out"])}
        else:
            out[tag] = backup_worker(model, batches, run_["delay"] if rank == run_["late"] else 0.0)
    return out


def collect_backup(backup_server) -> dict:
    return {"ranks": list(parlab.launch(_backup_rank, N + 1, backup_server, **LAUNCH))}


def backup_rule(messages: list, versions: dict[int, list[int]], updates: int) -> dict:
    """Walk the server's messages in its program order under part 1's rule.

    versions[w]: the versions worker w pulled, in order; its c-th gradient was computed on versions[w][c]. A gradient
    counts when it was computed on the current version and fewer than U updates were made; the TAKE-th counted makes
    the update. A pull becomes due when the worker has a version it has not computed on: at the start, when its
    gradient is dropped, when the update its gradient counted in is made (after U updates: the stop, -1).
    Returns the updates made (each a list of (worker, gradient number)) and the first breach of each property."""
    workers = sorted(versions)
    version, counting, made = 0, [], []
    sent, got = dict.fromkeys(workers, 0), dict.fromkeys(workers, 0)
    due = dict.fromkeys(workers, 0)  # w -> the receives made when its next pull became due; None: not due
    receives, breach = 0, {"version": None, "early": None, "held": None}
    for kind, w, _ in messages:
        if w not in due:
            continue  # not a worker: the traffic line says so
        if kind == "recv":
            late = [u for u in workers if due[u] is not None]
            if late and breach["held"] is None:
                u = late[0]
                breach["held"] = (
                    f"worker {u}'s pull {sent[u]}: due after receive {due[u]}, still unsent at receive {receives + 1}"
                )
            receives += 1
            c = got[w]
            got[w] += 1
            r = versions[w][c] if c < len(versions[w]) else None
            if r == version and version < updates:
                counting.append((w, c))
                if len(counting) == TAKE:
                    made.append(counting)
                    version += 1
                    for u, _ in counting:
                        due[u] = receives
                    counting = []
            else:
                due[w] = receives  # dropped: a newer version (or the stop) is there for it
            continue
        c = sent[w]
        sent[w] += 1
        carried = versions[w][c] if c < len(versions[w]) else None
        expected = version if version < updates else -1
        if due[w] is None and breach["early"] is None:
            why = (
                f"its gradient {got[w] - 1} waited for update {version + 1}"
                if any(u == w for u, _ in counting)
                else f"its gradient {c - 1} had not arrived"
            )
            breach["early"] = f"worker {w}'s pull {c} sent while {why}"
        if carried != expected and breach["version"] is None:
            breach["version"] = f"worker {w}'s pull {c}: expected version {expected}, received {carried}"
        due[w] = None
    unsent = [u for u in workers if due[u] is not None]
    if unsent and breach["held"] is None:
        breach["held"] = f"worker {unsent[0]}'s pull {sent[unsent[0]]}: due after receive {due[unsent[0]]}, never sent"
    return {"made": made, "breach": breach}


def gradient_at(theta: torch.Tensor, rows) -> tuple[torch.Tensor, float]:
    """The gradient [Psi] and the loss of the lab model at parameters theta on rows (x, y) [b, T]."""
    model = build_lab_model(CFG)
    set_params(model, theta)
    loss = next_token_loss(model, *rows)
    loss.backward()
    return flat_grads(model), loss.item()


def replay_backup(made: list, batches) -> list[torch.Tensor]:
    """theta_0, theta_1, ...: one Adam step per update the rule made, with the mean of its counted gradients, each
    computed at the version it counted for on its worker's rows of that version's batch."""
    theta = flat_params(build_lab_model(CFG))
    m, v = torch.zeros_like(theta), torch.zeros_like(theta)
    thetas = [theta.clone()]
    for u, counted in enumerate(made):
        grads = [gradient_at(thetas[u], rows_of(batches[u], w, N))[0] for w, _ in counted]
        adam_step(theta, torch.stack(grads).mean(dim=0), m, v, u + 1, ADAM_LR)
        thetas.append(theta.clone())
    return thetas


def _judge_backup_run(tag: str, ranks: list[dict]) -> list[str]:
    run_, server, workers = BACKUP_RUNS[tag], ranks[0], ranks[1:]
    U, psi = run_["updates"], sum(n for _, n in tensor_names())
    tag = f"{tag} (U = {U})"
    lines = [collective_line(f"{tag}: server", [server["calls"]]), through_comm_line(f"{tag}: server", server)]
    if not lines[-1].endswith(": PASS"):  # the sender of a receive from any rank is known only from parlab's trace
        return [*lines, _library_line(f"{tag}: server", server["library"])]
    messages, ids = server["messages"], list(range(1, N + 1))
    what = f"{tag}: messages: pulls of (theta, version) to the workers, their gradients back, nothing else"
    wrong = next(
        (
            (kind, peer, size)
            for kind, peer, size in messages
            if peer not in ids or size != (psi + 1 if kind == "send" else psi) * 8
        ),
        None,
    )
    if wrong is None:
        lines.append(f"{what}: PASS")
    else:
        kind, peer, size = wrong
        want = f"{(psi + 1) * 8:,} bytes to a worker" if kind == "send" else f"{psi * 8:,} bytes from a worker"
        lines.append(f"{what}: expected a {kind} of {want}, found a {kind} of {size:,} bytes with rank {peer}: FAIL")
    versions = {w: list(res["versions"]) for w, res in zip(ids, workers, strict=True)}
    counts = {
        w: (sum(k == "send" and p == w for k, p, _ in messages), sum(k == "recv" and p == w for k, p, _ in messages))
        for w in ids
    }
    what = f"{tag}: every gradient received, every worker's last pull the stop (-1)"
    bad = [
        (w, sends, recvs)
        for w, (sends, recvs) in counts.items()
        if recvs != len(workers[w - 1]["losses"]) or sends != recvs + 1 or versions[w][-1:] != [-1]
    ]
    if bad:
        w, sends, recvs = bad[0]
        lines.append(
            f"{what}: worker {w}: expected {len(workers[w - 1]['losses'])} gradients received and one more pull, "
            f"the last -1; found {recvs} received, {sends} pulls, the last {versions[w][-1:]}: FAIL"
        )
    else:
        lines.append(f"{what}: PASS")
    rule = backup_rule(messages, versions, U)
    for key, what in (
        ("version", "every pull carried the version current when it was sent (-1 once U updates were made)"),
        ("early", "no pull sent before its worker had a version it had not computed on"),
        ("held", "no pull held past the server's next receive"),
    ):
        found = rule["breach"][key]
        lines.append(f"{tag}: {what}: {'PASS' if found is None else found + ': FAIL'}")
    made, batches = rule["made"], lab_batches(CFG, B, U, seed=run_["seed"])
    if len(made) < U:
        lines.append(f"{tag}: the rule's updates: expected {U}, the server's order makes {len(made)}: FAIL")
        return [*lines, _library_line(f"{tag}: server", server["library"])]
    thetas, against = replay_backup(made, batches), "one-device replay of the rule"
    got = by_name(server["out"]) if isinstance(server["out"], torch.Tensor) else {}
    lines.append(first_wrong_tensor(f"{tag}: server's parameters after {U} updates", got, by_name(thetas[-1]), against))
    ours, theirs = [], []
    for w in ids:
        for c, loss in enumerate(workers[w - 1]["losses"]):
            r = versions[w][c]
            ours.append(loss)
            theirs.append(gradient_at(thetas[r], rows_of(batches[r], w, N))[1] if 0 <= r <= U else float("nan"))
    lines.append(
        compare(
            f"{tag}: the loss of every gradient, as the workers computed it",
            torch.tensor(ours, dtype=torch.float64),  # host: what the workers computed, judged here
            torch.tensor(theirs, dtype=torch.float64),  # host: the reference on one device
            against=against,
        ).line
    )
    lines.append(
        compare(
            f"{tag}: every worker's parameters after its stop",
            [res["theta"] for res in workers],
            [thetas[-1]] * N,
            against=against,
        ).line
    )
    lines.append(_library_line(f"{tag}: server", server["library"]))
    return lines


def judge_backup(data) -> list[str]:
    ranks = data["ranks"]
    lines = []
    for tag in BACKUP_RUNS:
        lines += _judge_backup_run(tag, [r[tag] for r in ranks])
    return lines


# ------------------------------------------------------------------------ 2 · staleness bounded by when you reply


def server_log(messages: list, updates: list[int] | None = None) -> list[tuple[str, int]]:
    """Not graded (the lab's last cell): a server's log from its traced messages: ("pull", w) for theta sent to w,
    ("push", w) for a gradient received from w, ("update", n) where the server applied one update with n gradients.
    updates: after how many messages each update came, each applying every gradient received since the previous one
    (None: one update of one gradient right after every gradient received, as an asynchronous server does)."""
    log, waiting = [], 0
    for i, (kind, peer, _) in enumerate(messages):
        log.append(("pull" if kind == "send" else "push", int(peer)))
        waiting += kind == "recv"
        if updates is None and kind == "recv":
            log.append(("update", 1))
            waiting = 0
        elif updates is not None and i + 1 in updates and waiting:
            log.append(("update", waiting))
            waiting = 0
    return log


def read_staleness(log: list[tuple[str, int]]) -> list[int | None]:
    """Not graded (the lab's last cell): for each push of a server_log, in order, (version it was applied to) -
    (version its worker pulled last before it), or None for a gradient never applied."""
    version, pulled, waiting, read, out = 0, {}, [], {}, []
    for what, x in log:
        if what == "pull":
            pulled[x] = version
        elif what == "push":
            read[len(out)] = pulled[x]
            waiting.append(len(out))
            out.append(None)
        elif what == "update":
            for i in waiting[:x]:
                out[i] = version - read[i]
            waiting, version = waiting[x:], version + 1
    return out


def failing_worker(model, batches, slowdown: float = 1.0, fails_at: int | None = None) -> dict:
    """Part 3's worker (ranks 1..N), parlab's worker with a failure: K times pull theta [Psi] from rank 0, compute
    the gradient of its b rows of batch c, push it [Psi]; then a last pull. With fails_at = c, at its step c it
    pushes NaN instead (the server learns of the failure from that message) and stops: no more pulls."""
    rank, theta, losses = dist.get_rank(), flat_params(model), []
    for c, batch in enumerate(batches):
        comm.recv(theta, 0)  # pull c: theta <- the parameters its step c computes on
        set_params(model, theta)
        if c == fails_at:
            comm.send(torch.full_like(theta, float("nan")), 0)  # the failure, as the server sees it
            return {"losses": losses}
        x, y = rows_of(batch, rank, N)  # [b, T] each
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        loss = next_token_loss(model, x, y)
        loss.backward()
        losses.append(loss.item())
        time.sleep((slowdown - 1) * (time.perf_counter() - start))  # a straggler idles before it pushes
        comm.send(flat_grads(model), 0)  # push c
    comm.recv(theta, 0)  # the last pull
    set_params(model, theta)
    return {"losses": losses}


def run_server_and_workers(server, batches, *args, fails: bool = False) -> dict:
    """Rank code: rank 0 calls server(theta_0, K, LR, *args) on the flat parameters [Psi] and returns its final
    theta and its calls; ranks 1..N run parlab's worker (worker STRAGGLER slowed by SLOWDOWN), or with `fails`
    failing_worker (worker FAILED failing at its step FAILS_AT)."""
    rank = dist.get_rank()
    model = build_lab_model(CFG, device=parlab.device())  # theta_0, the same on every rank
    if rank == 0:
        record = recorded(server, flat_params(model), len(batches), LR, *args)
        return {**record, "theta": _host(record.pop("out"))}
    slowdown = SLOWDOWN if rank == STRAGGLER else 1.0
    batches = [(x.to(parlab.device()), y.to(parlab.device())) for x, y in batches]
    if fails:
        out = failing_worker(model, batches, slowdown, FAILS_AT if rank == FAILED else None)
    else:
        out = run_worker(model, batches, slowdown=slowdown, loss_fn=next_token_loss)
    losses = torch.tensor(out["losses"], dtype=torch.float64)  # host: plain numbers, returned to the parent
    return {"losses": losses, "theta": flat_params(model).cpu()}


def collect_runs(server, batches, bounds, fails: bool = False) -> dict:
    """One launch per bound (a server that hangs at one bound does not cost the other its verdicts): each rank's
    result, or the launch's timeout in words."""
    runs = {}
    for bound in bounds:
        try:
            args = (run_server_and_workers, N + 1, server, batches, bound)
            runs[str(bound)] = list(parlab.launch(*args, fails=fails, **LAUNCH))
        except parlab.LaunchTimeout as stopped:  # what each rank waited in, in words: the FAIL line says it
            calls = getattr(stopped, "calls", {}) or {}
            said = {r: re.sub(r" for [\d.]+ s\b", "", " ".join(str(c).split()))[:70] for r, c in calls.items()}
            waits = "; ".join(f"rank {r} {said[r]}" for r in sorted(said))  # no timings in a verdict line
            runs[str(bound)] = f"stopped, {waits}" if waits else " ".join(str(stopped).split())[:300]
    return {"runs": runs}


def timeout_line(tag: str, stopped: str) -> str:
    """The verdict of a run that never finished (a server holding a reply nobody can release)."""
    return f"{tag}: every worker answered within the lab's {LAUNCH['timeout']} s launch: {stopped}: FAIL"


def replay(order: list[int], reads: dict[tuple[int, int], int], batches, scaled: bool) -> dict:
    """The run on one device: gradient u is worker order[u]'s c-th (its rows of batch c), computed at theta_r,
    r = reads[(w, c)], applied to theta_u with lr (scaled: lr / (1 + tau), tau = u - r). Returns every version
    theta_v and the loss of every gradient."""
    theta, versions, losses, done = flat_params(build_lab_model(CFG)), [], {}, {}
    for u, w in enumerate(order):
        versions.append(theta)
        c = done.get(w, 0)
        r = reads.get((w, c))
        if r is None or r >= len(versions):
            return {"error": f"worker {w}'s gradient {c} was computed on parameters not yet sent"}
        g, losses[(w, c)] = gradient_at(versions[r], rows_of(batches[c], w, N))
        theta = theta - (LR / (1 + u - r) if scaled else LR) * g
        done[w] = c + 1
    versions.append(theta)
    return {"versions": versions, "losses": losses}


def walk(messages: list, K: int, unsafe, *, what_waits: str, fails: dict[int, int] | None = None) -> dict:
    """Walk a server's messages in its program order (ranks 1..N its workers, each K pulls and pushes, then a last
    pull; the reply to a worker's c-th push is its pull c + 1, pull 0 is theta_0).

    unsafe(w, c, state) -> None, or why sending pull c to worker w now breaks the part's guarantee; state: the
    version (gradients applied so far), `computing` (worker -> the version it computes on, for the workers sent
    parameters and not yet heard from), `pushes` (worker -> gradients received from it) and `dead` (the workers
    whose failure came). fails: worker -> c, its push c is its failure (NaN, not applied; nothing more to it).
    Returns the order of the gradients (their workers), reads[(w, c)] (the version pull c of w carried), every
    gradient's staleness, the pulls sent per worker and the first breach of each property: "before" (a reply
    before its push), "safe" (a reply that breaks the guarantee), "held" (a reply the guarantee allowed, still
    unsent at a later receive)."""
    workers = list(range(1, N + 1))
    fails = fails or {}
    state = {"version": 0, "computing": {}, "pushes": dict.fromkeys(workers, 0), "dead": set()}
    sent, due = dict.fromkeys(workers, 0), dict.fromkeys(workers, 0)  # due: receives made when the pull was due
    order, reads, taus, breach = [], {}, [], {"before": None, "safe": None, "held": None}
    for kind, w, _ in messages:
        if w not in sent:
            continue  # not a worker: the traffic lines say so
        if kind == "recv":
            for u in workers:  # before this receive: was a reply the guarantee allowed still unsent?
                alive = u not in state["dead"]
                if alive and due[u] is not None and sent[u] <= K and unsafe(u, sent[u], state) is None:
                    if breach["held"] is None:
                        when = "at the start" if state["version"] == 0 else f"after gradient {state['version']}"
                        breach["held"] = (
                            f"pull {sent[u]} of worker {u}: {what_waits} {when}, still unsent when gradient "
                            f"{state['version'] + 1} came"
                        )
            r = state["computing"].pop(w, None)
            if fails.get(w) == state["pushes"][w]:  # its failure: nothing applied, nothing owed to it
                state["dead"].add(w)
                due[w] = None
                continue
            taus.append(None if r is None else state["version"] - r)
            order.append(w)
            state["version"] += 1
            state["pushes"][w] += 1
            due[w] = state["version"]
            continue
        c = sent[w]
        sent[w] += 1
        reads[(w, c)] = state["version"]
        if w in state["dead"] and breach["safe"] is None:
            breach["safe"] = f"pull {c} of worker {w} sent after its failure came (it pulls nothing more)"
        if due[w] is None and breach["before"] is None and w not in state["dead"]:
            breach["before"] = f"pull {c} of worker {w} sent before its gradient {c - 1} came"
        why = unsafe(w, c, state) if c <= K else f"pull {c} of worker {w}: a worker pulls K + 1 = {K + 1} times"
        if why is not None and breach["safe"] is None:
            breach["safe"] = why
        due[w] = None
        if c < K:
            state["computing"][w] = state["version"]
    return {"order": order, "reads": reads, "taus": taus, "sent": sent, "breach": breach}


def _judge_async_run(
    tag: str, ranks, walked: dict, batches, scaled: bool, lines: list[str], fails: dict[int, int] | None = None
) -> list[str]:
    """The lines every held-reply server shares: pulls answered, then the one-device replay in the server's order.
    fails: worker -> c, its step c was its failure (gradients 0..c-1 applied, pulls 0..c answered)."""
    K, server, order, reads, fails = len(batches), ranks[0], walked["order"], walked["reads"], fails or {}
    done = {w: fails.get(w, K) for w in range(1, N + 1)}  # the gradients each worker computed
    per_worker = [order.count(w) for w in range(1, N + 1)]
    pulls = [done[w] + 1 for w in range(1, N + 1)]  # a failed worker got the pull of the step it failed at
    complete = per_worker == list(done.values()) and [walked["sent"][w] for w in range(1, N + 1)] == pulls
    found = f"expected {list(done.values())} gradients and {pulls} pulls, found {per_worker} gradients, "
    found += f"{list(walked['sent'].values())} pulls: FAIL"
    what = f"every worker's K = {K} gradients applied and K + 1 pulls answered"
    if fails:
        what = "every living worker's K gradients applied and K + 1 pulls answered, the failed one's before it failed"
    lines.append(f"{tag}: {what}: {'PASS' if complete else found}")
    lines.append(_library_line(f"{tag}: server", server["library"]))
    if not complete:
        return lines
    result = replay(order, reads, batches, scaled)
    if "error" in result:
        return [*lines, f"{tag}: one-device replay ({result['error']}): FAIL"]
    versions, against = result["versions"], "one-device replay in the server's order"
    ours = torch.tensor(
        [ranks[w]["losses"][c] for w in range(1, N + 1) for c in range(done[w])], dtype=torch.float64
    )  # host: what the workers computed
    theirs = [result["losses"][(w, c)] for w in range(1, N + 1) for c in range(done[w])]
    theirs = torch.tensor(theirs, dtype=torch.float64)  # host: the reference on one device
    last = [versions[reads[(w, done[w])]] for w in range(1, N + 1)]
    got = by_name(server["theta"]) if isinstance(server["theta"], torch.Tensor) else {}
    step = "lr / (1 + tau)" if scaled else "lr"
    return [
        *lines,
        first_wrong_tensor(
            f"{tag}: server's parameters after {len(order)} gradients, each with {step}",
            got,
            by_name(versions[-1]),
            against,
        ),
        compare(
            f"{tag}: loss of each of the {len(order)} gradients, as the workers computed it",
            ours,
            theirs,
            against=against,
        ).line,
        compare(
            f"{tag}: every worker's last pull", [ranks[w]["theta"] for w in range(1, N + 1)], last, against=against
        ).line,
    ]


def _traffic_lines(tag: str, server: dict) -> list[str]:
    return [collective_line(f"{tag}: server", [server["calls"]]), through_comm_line(f"{tag}: server", server)]


def delay_unsafe(D: int, K: int):
    """Part 2's guarantee as walk's `unsafe`: pull c < K starts a gradient; sending it is safe when, whatever order the
    gradients then being computed arrive in (nothing more sent), none is applied more than D updates after the
    version it was computed on. The last pull starts nothing."""

    def unsafe(w, c, state):
        if c >= K:
            return None
        version, computing = state["version"], dict(state["computing"])
        computing[w] = version
        # Worst case for u: every other gradient being computed is applied before u's.
        worst = {u: version - r + len(computing) - 1 for u, r in computing.items()}
        u = max(worst, key=lambda k: (worst[k], -k))
        if worst[u] <= D:
            return None
        others = ", ".join(f"worker {k} on version {r}" for k, r in sorted(computing.items()) if k != w)
        return (
            f"pull {c} of worker {w} sent at version {version} while {others} computed: worker {u}'s gradient "
            f"can be applied {worst[u]} updates stale, expected at most D = {D}"
        )

    return unsafe


def collect_staleness(bounded_server) -> dict:
    return collect_runs(bounded_server, DELAY_BATCHES, DELAY_BOUNDS)


def _judge_delay_run(D: int, ranks) -> list[str]:
    tag = f"D={D}"
    if isinstance(ranks, str):
        return [timeout_line(tag, ranks)]
    server = ranks[0]
    lines = _traffic_lines(tag, server)
    if not lines[-1].endswith(": PASS"):  # the sender of a receive from any rank is known only from parlab's trace
        return lines
    walked = walk(server["messages"], DELAY_STEPS, delay_unsafe(D, DELAY_STEPS), what_waits="safe to send")
    for key, what in (
        ("before", "every pull after the worker's previous gradient"),
        ("safe", "every pull safe: no arrival order of the gradients being computed makes one staler than D"),
        ("held", "no pull held once sending it was safe"),
    ):
        found = walked["breach"][key]
        lines.append(f"{tag}: {what}: {'PASS' if found is None else found + ': FAIL'}")
    taus = [t for t in walked["taus"] if t is not None]
    worst = max(taus, default=0)
    lines.append(
        f"{tag}: every gradient's measured staleness at most D: "
        + ("PASS" if worst <= D and len(taus) == len(walked["taus"]) else f"found {worst}: FAIL")
    )
    return _judge_async_run(tag, ranks, walked, DELAY_BATCHES, False, lines)


def judge_staleness(data) -> list[str]:
    lines = []
    for D in DELAY_BOUNDS:
        lines += _judge_delay_run(D, data["runs"][str(D)])
    return lines


# ------------------------------------------------------------------------------------ 3 · bounded staleness


def ssp_unsafe(s: int):
    """Part 3's guarantee as walk's `unsafe`: a worker starting its step c (c = K: its last pull) is at most s clocks
    ahead of every worker alive (a clock: the steps a worker has finished, its gradients applied on arrival)."""

    def unsafe(w, c, state):
        behind = [u for u, p in sorted(state["pushes"].items()) if u not in state["dead"] and c - p > s]
        if not behind:
            return None
        u = behind[0]
        return (
            f"pull {c} of worker {w} (starting its step {c}) sent while worker {u}, alive, had finished "
            f"{state['pushes'][u]} steps: {c - state['pushes'][u]} clocks apart, expected at most s = {s}"
        )

    return unsafe


def collect_ssp(ssp_server) -> dict:
    return collect_runs(ssp_server, SSP_BATCHES, SSP_BOUNDS, fails=True)


def _judge_ssp_run(s: int, ranks) -> list[str]:
    tag = f"s={s}"
    if isinstance(ranks, str):
        return [timeout_line(tag, ranks)]
    server = ranks[0]
    lines = _traffic_lines(tag, server)
    if not lines[-1].endswith(": PASS"):
        return lines
    fails = {FAILED: FAILS_AT}
    walked = walk(server["messages"], SSP_STEPS, ssp_unsafe(s), what_waits="allowed", fails=fails)
    for key, what in (
        ("before", "every pull after the worker's previous gradient"),
        ("safe", "every pull within s clocks of every living worker, none to the failed one"),
        ("held", "no pull held once allowed"),
    ):
        found = walked["breach"][key]
        lines.append(f"{tag}: {what}: {'PASS' if found is None else found + ': FAIL'}")
    return _judge_async_run(tag, ranks, walked, SSP_BATCHES, True, lines, fails)


def judge_ssp(data) -> list[str]:
    lines = []
    for s in SSP_BOUNDS:
        lines += _judge_ssp_run(s, data["runs"][str(s)])
    return lines


# ------------------------------------------------------------- 4 · sharded servers that take over a failed one


def layer_plan() -> dict[str, int]:
    """The check's plan: the embedding and block 0 on server 0, block 1 on server 1, the final norm and the head on
    server 2 (three shards of different sizes)."""
    return {
        n: 0 if n.startswith(("embed", "blocks.0.")) else 1 if n.startswith("blocks.1.") else 2
        for n, _ in tensor_names()
    }


def round_robin_plan() -> dict[str, int]:
    """Tensor i of named_parameters() on server i mod S."""
    return {name: i % SERVERS for i, (name, _) in enumerate(tensor_names())}


def served(plan: dict[str, int], failure, step: int) -> dict[int, list[int]]:
    """Which shards each live server serves at `step` (step K: the last pull): its own, and a failed server's once
    that one has failed (its backup, the next server)."""
    F, t = failure if failure else (None, STEPS + 1)
    out = {}
    for j in range(SERVERS):
        if j == F and step >= t:
            continue
        out[j] = [j] + ([F] if F is not None and step >= t and j == (F + 1) % SERVERS else [])
    return out


def expected_messages(plan: dict[str, int], failure) -> dict[int, dict[tuple[str, int], list[int]]]:
    """For every server: (op, peer) -> the sizes in bytes of its messages with that peer, sorted. Workers: every
    shard's pull (K + 1 times) and push (K times) with whichever server serves it; servers: each step, one message of
    its shard's bytes to its backup while both are alive (the fewest that let the backup take over exactly)."""
    sizes = {j: 8 * sum(n for name, n in tensor_names() if plan[name] == j) for j in range(SERVERS)}
    F, t = failure if failure else (None, STEPS + 1)
    out = {j: {} for j in range(SERVERS)}

    def add(j, op, peer, size):
        out[j].setdefault((op, peer), []).append(size)

    for step in range(STEPS + 1):
        for j, shards in served(plan, failure, step).items():
            for w in range(SERVERS, SERVERS + N):
                for k in shards:
                    add(j, "send", w, sizes[k])
                    if step < STEPS:
                        add(j, "recv", w, sizes[k])
        if step == STEPS:
            break
        for j in range(SERVERS):
            backup = (j + 1) % SERVERS
            if (j != F or step < t) and (backup != F or step < t):
                add(j, "send", backup, sizes[j])
                add(backup, "recv", j, sizes[j])
    return {j: {key: sorted(v) for key, v in ops.items()} for j, ops in out.items()}


def _sharded_once(plan, failure, sharded_server, sharded_worker, batches) -> dict:
    """Rank code: one run. Ranks 0..S-1 call sharded_server(shard, backup, S, workers, K, ADAM_LR, failure) with
    their own tensors and a copy of the tensors of the shard before theirs (name -> tensor, in named_parameters
    order, at theta_0); ranks S..S+N-1 call sharded_worker(model, rows, plan, failure) with their b rows of every
    batch."""
    rank, workers = dist.get_rank(), list(range(SERVERS, SERVERS + N))
    model = build_lab_model(CFG, device=parlab.device())  # theta_0 on every rank
    if rank < SERVERS:
        mine = {n: p.detach().clone() for n, p in model.named_parameters() if plan[n] == rank}
        before = (rank - 1) % SERVERS
        backup = {n: p.detach().clone() for n, p in model.named_parameters() if plan[n] == before}
        record = recorded(sharded_server, mine, backup, SERVERS, workers, len(batches), ADAM_LR, failure)
        out = record.pop("out")
        tensors = {str(n): t.detach().cpu().clone() for n, t in out.items()} if isinstance(out, dict) else {}
        return {**record, "tensors": tensors}
    rows = [rows_of((x.to(parlab.device()), y.to(parlab.device())), rank - SERVERS + 1, N) for x, y in batches]
    record = recorded(sharded_worker, model, rows, dict(plan), failure)
    losses = record.pop("out")
    return {
        **record,
        "losses": torch.tensor([float(v) for v in losses], dtype=torch.float64),  # host: returned to the parent
        "params": {n: p.detach().cpu().clone() for n, p in model.named_parameters()},
    }


def run_sharded(plan, failures, sharded_server, sharded_worker, batches) -> dict:
    """Rank code: one run per failure, one after the other."""
    out = {}
    for failure in failures:
        comm.barrier()  # the runs do not overlap
        out[str(failure)] = _sharded_once(plan, failure, sharded_server, sharded_worker, batches)
    return out


def collect_sharded(sharded_server, sharded_worker) -> dict:
    world = SERVERS + N
    ranks = parlab.launch(
        run_sharded, world, layer_plan(), FAILURES, sharded_server, sharded_worker, SHARD_BATCHES, **LAUNCH
    )
    return {"runs": {str(f): [r[str(f)] for r in ranks] for f in FAILURES}}


@functools.lru_cache(maxsize=1)  # the same reference for every notebook graded
def one_device() -> tuple[dict[str, torch.Tensor], list[float]]:
    """One device, the whole batch, K steps of Adam (torch.optim.Adam's arithmetic, lab08_setup.adam_step): the
    parameters after them, by name, and each step's loss."""
    model = build_lab_model(CFG)
    theta = flat_params(model)
    m, v, losses = torch.zeros_like(theta), torch.zeros_like(theta), []
    for step, batch in enumerate(SHARD_BATCHES):
        set_params(model, theta)
        model.zero_grad(set_to_none=True)
        loss = next_token_loss(model, *batch)  # the mean over all B rows
        loss.backward()
        losses.append(loss.item())
        adam_step(theta, flat_grads(model), m, v, step + 1, ADAM_LR)
    set_params(model, theta)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses


def _messages_line(what: str, ranks: list[dict], plan, failure) -> str:
    """Every server's messages with every peer against expected_messages; a FAIL names the first pair that
    differs, expected and found."""
    expected = expected_messages(plan, failure)
    for j in range(SERVERS):
        found = {}
        for kind, peer, size in ranks[j]["messages"]:
            found.setdefault((kind, peer), []).append(size)
        for key in sorted(set(found) | set(expected[j]), key=lambda k: (k[1], k[0])):
            want, have = expected[j].get(key, []), sorted(found.get(key, []))
            kind, peer = key
            if have != want:
                other = f"server {peer}" if peer < SERVERS else f"worker {peer}" if peer >= 0 else "any rank"
                other = f"sends to {other}" if kind == "send" else f"receives from {other}"
                if 0 <= peer < SERVERS and want:  # replication: its size is part 4's question, never printed
                    return f"{what}: server {j}, {other}: {_replication(want, have)}: FAIL"
                return f"{what}: server {j}, {other}: expected {_sizes(want)}, found {_sizes(have)}: FAIL"
    strays = [(r, p) for r in range(SERVERS, SERVERS + N) for _, p, _ in ranks[r]["messages"] if p >= SERVERS]
    if strays:
        worker, peer = strays[0]
        return f"{what}: worker {worker}: expected messages with servers only, found one with rank {peer}: FAIL"
    return f"{what}: PASS"


def _replication(want: list[int], have: list[int]) -> str:
    """What went wrong between a server and its backup, without the size a correct replication has."""
    if len(have) != len(want):
        return f"expected {len(want)} messages (one a step while both are alive), found {len(have)}"
    if sum(have) > sum(want):
        return f"found {_sizes(have)}: more than the least that lets the backup take over exactly"
    return f"found {_sizes(have)}: too few to let the backup take over exactly"


def _sizes(sizes: list[int]) -> str:
    if not sizes:
        return "none"
    counts = {}
    for size in sizes:
        counts[size] = counts.get(size, 0) + 1
    return ", ".join(f"{k} x {size:,} bytes" for size, k in sorted(counts.items()))


def _synchrony_line(what: str, ranks: list[dict], plan, failure) -> str:
    """Per shard, on every server that serves it: the j-th pull of that shard sent to any worker after j pushes
    of it from every worker (its messages with the workers told apart by their size)."""
    sizes = {k: 8 * sum(n for name, n in tensor_names() if plan[name] == k) for k in range(SERVERS)}
    workers = list(range(SERVERS, SERVERS + N))
    for j in range(SERVERS):
        for k in range(SERVERS):
            stream = [(op, p) for op, p, b in ranks[j]["messages"] if p in workers and b == sizes[k]]
            pushes, sends = dict.fromkeys(workers, 0), dict.fromkeys(workers, 0)
            for op, peer in stream:
                if op == "recv":
                    pushes[peer] += 1
                    continue
                if min(pushes.values()) < sends[peer]:
                    return (
                        f"{what}: server {j}, shard {k}: pull {sends[peer]} to worker {peer} sent after "
                        f"{min(pushes.values())} pushes of the slowest worker, expected after {sends[peer]}: FAIL"
                    )
                sends[peer] += 1
    return f"{what}: PASS"


def _judge_sharded_run(failure, ranks: list[dict], plan) -> list[str]:
    tag = "no failure" if failure is None else f"server {failure[0]} fails after {failure[1]} steps"
    reference, losses = one_device()
    lines = [collective_line(f"{tag}: every rank", [res["calls"] for res in ranks])]
    unseen = [through_comm_line(f"{tag}: rank {r}", res) for r, res in enumerate(ranks)]
    unseen = [line for line in unseen if line.endswith(": FAIL")]
    lines.append(unseen[0] if unseen else f"{tag}: every rank: every message through parlab.core.comm: PASS")
    what = f"{tag}: every server's messages: each shard's pulls and pushes where it is served; to its backup"
    lines.append(_messages_line(what, ranks, plan, failure))
    lines.append(
        _synchrony_line(f"{tag}: no version v+1 of a shard sent before all N gradients of step v", ranks, plan, failure)
    )
    final = served(plan, failure, STEPS)
    server_of = {n: j for j, shards in final.items() for n in plan if plan[n] in shards}  # who serves n at the end
    held = {
        f"{n} (server {j})": t
        for j, shards in final.items()
        for n, t in ranks[j]["tensors"].items()
        if plan.get(n) in shards
    }
    reference_held = {f"{n} (server {server_of[n]})": t for n, t in reference.items()}
    lines.append(
        first_wrong_tensor(
            f"{tag}: every shard's parameters after {STEPS} steps, on the server serving it", held, reference_held
        )
    )
    mean_loss = torch.stack([ranks[r]["losses"] for r in range(SERVERS, SERVERS + N)]).mean(dim=0)
    expected_loss = torch.tensor(losses, dtype=torch.float64)  # host: the reference on one device
    verdict = compare(f"{tag}: loss of each step, the mean over the workers", mean_loss, expected_loss)
    if not verdict.passed and mean_loss.shape == expected_loss.shape:  # the first step computed on wrong parameters
        k = int(((mean_loss - expected_loss).abs() > 1e-10).nonzero()[0])
        verdict = (
            f"{verdict.what}: step {k} (the first on wrong parameters): expected {expected_loss[k].item():.6g}, "
            f"received {mean_loss[k].item():.6g}: FAIL"
        )
    lines.append(str(verdict))
    what = f"{tag}: every worker's parameters after its last pull"
    verdict = compare(what, [ranks[r]["params"] for r in range(SERVERS, SERVERS + N)], [reference] * N)
    wrong = [
        first_wrong_tensor(f"{tag}: worker {r}'s parameters after its last pull", ranks[r]["params"], reference)
        for r in range(SERVERS, SERVERS + N)
    ]
    lines.append(verdict.line if verdict.passed else next((x for x in wrong if x.endswith(": FAIL")), verdict.line))
    lines.append(_library_line(f"{tag}: servers and workers", [n for res in ranks for n in res["library"]]))
    return lines


def judge_sharded(data) -> list[str]:
    lines = []
    for failure in FAILURES:
        lines += _judge_sharded_run(failure, data["runs"][str(failure)], layer_plan())
    return lines


# ------------------------------------------------------------------ the prediction: round-robin, server 1 fails


def failover_theory() -> dict[str, float]:
    """Round-robin over 3 servers, N workers, K steps, server 1 failing after 2 steps: the bytes through the busiest
    server's link over the run (sent and received, with workers and servers) and the bytes servers send each other."""
    plan = round_robin_plan()
    link, between = dict.fromkeys(range(SERVERS), 0), 0
    for j, ops in expected_messages(plan, PREDICTED_FAILURE).items():
        for (op, peer), sizes in ops.items():
            link[j] += sum(sizes)
            between += sum(sizes) if op == "send" and peer < SERVERS else 0
    return {"busiest_bytes": max(link.values()), "replication_bytes": between}


THEORY = {"failover_bytes": failover_theory}


def _plain(value):
    try:
        return float(value.item() if hasattr(value, "item") else value) if not isinstance(value, bool) else repr(value)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return repr(value)[:40]


def collect_failover_bytes(busiest_bytes, replication_bytes, sharded_server, sharded_worker) -> dict:
    """The predictions as numbers, and (shown, not scored) what the student's own sharded servers moved in that run."""
    data = {
        "predicted": {"busiest_bytes": _plain(busiest_bytes), "replication_bytes": _plain(replication_bytes)},
        "measured": None,
        "note": "",
    }
    try:
        world, failures = SERVERS + N, (PREDICTED_FAILURE,)
        args = (round_robin_plan(), failures, sharded_server, sharded_worker, SHARD_BATCHES)
        ranks = [r[str(PREDICTED_FAILURE)] for r in parlab.launch(run_sharded, world, *args, **LAUNCH)]
        link = [sum(b for _, _, b in ranks[j]["messages"]) for j in range(SERVERS)]
        between = sum(b for j in range(SERVERS) for k, p, b in ranks[j]["messages"] if k == "send" and 0 <= p < SERVERS)
        data["measured"] = {"busiest_bytes": max(link), "replication_bytes": between}
    except Exception as exc:  # the prediction is graded all the same; only the measurement is missing
        data["note"] = f"your sharded servers did not run ({type(exc).__name__}): nothing measured"
    return data


def judge_failover_bytes(data) -> list[str]:
    theory, predicted = failover_theory(), data["predicted"]
    labels = {
        "busiest_bytes": "round-robin, server 1 failing after 2 steps: bytes through the busiest server's link",
        "replication_bytes": "round-robin, server 1 failing after 2 steps: bytes sent from server to server",
    }
    lines = []
    for key, label in labels.items():
        lines += prediction_lines(label, predicted[key], theory[key], rtol=0)
    measured, right = (
        data.get("measured"),
        all(line.endswith(": PASS") for line in lines if line.endswith("FAIL") or line.endswith("PASS")),
    )
    if measured is not None and right:  # what the student's own servers moved: shown once the predictions are right
        lines.append(
            f"measured in your sharded run of that setting: the busiest link {measured['busiest_bytes']:,.0f} bytes, "
            f"server to server {measured['replication_bytes']:,.0f} bytes"
        )
    if data.get("note"):
        lines.append(data["note"])
    return lines


# ---- not graded: what each mode does about a straggler (the lab's last cell)


def _straggler_rank(ssp_server, s: int, batches, slowdown: float) -> dict:
    out, rank = {}, dist.get_rank()
    batches = [(x.to(parlab.device()), y.to(parlab.device())) for x, y in batches]
    for mode in ("sync", "async", f"ssp s={s}"):
        model = build_lab_model(CFG, device=parlab.device())
        comm.barrier()
        start, first = time.perf_counter(), len(comm.trace_events())
        if mode.startswith("ssp"):
            if rank == 0:
                ssp_server(flat_params(model), len(batches), LR, s)
            else:
                run_worker(model, batches, slowdown=slowdown if rank == STRAGGLER else 1.0, loss_fn=next_token_loss)
        else:
            optimizer = torch.optim.SGD(model.parameters(), lr=LR)
            train_parameter_server(
                model, optimizer, batches, mode=mode, straggler=STRAGGLER, slowdown=slowdown, loss_fn=next_token_loss
            )
        messages, updates = [], []
        for e in comm.trace_events()[first:]:
            if e.kind in ("send", "recv"):
                messages.append([e.kind, int(e.peer), e.bytes])
            elif e.kind == "optimizer":
                updates.append(len(messages))
        log = server_log(messages, updates if mode == "sync" else None)
        out[mode] = {"log": log, "seconds": time.perf_counter() - start}
    return out


def straggler_runs(ssp_server, s: int = 1, steps: int = 6, slowdown: float = 6.0) -> dict:
    """Not graded: parlab's synchronous and asynchronous servers and your ssp_server(s), one after the other, with
    worker STRAGGLER `slowdown` x slower; per mode, the server's log and its seconds (measured, not repeatable)."""
    batches = lab_batches(CFG, B, steps, seed=2)
    return parlab.launch(_straggler_rank, N + 1, ssp_server, s, batches, slowdown, **LAUNCH)[0]
