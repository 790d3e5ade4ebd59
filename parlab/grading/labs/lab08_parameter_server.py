"""Lab 08's checks: a synchronous parameter server, a parameter server sharded over three servers by a placement the
student designs, a prediction of the round-robin placement's busiest link, the staleness of the gradients a server
applied (read from its log), and a server with bounded staleness, on live ranks (see parlab/grading).

Every run trains the labs' model (parlab.core.lab_model: Psi = 22,688 float64 parameters in 21 tensors of very
different sizes: the grouped-query K/V projections are half the Q projection, the RMSNorm gains 32 values).

- sync, ssp: rank 0 runs the student's server on the flat parameter vector theta [Psi]; ranks 1..N run parlab's
  worker (parlab.schemes.parameter_server.run_worker: K times pull theta, compute the gradient of its b = B/N rows,
  push it; then one last pull). Worker 3 is a straggler in the SSP check.
- sharded: ranks 0..S-1 run the student's server, each on the tensors the student's placement gives it; ranks
  S..S+N-1 run the student's worker, which pulls every server's shard and pushes each server its part of the
  gradient.

What a server did is read from its process-group calls (parlab.core.probe: every send and receive, in program order,
with its peer and bytes); what it computed is checked against one device (SGD on the whole batch), or, for the
asynchronous server, by replaying the run on one device in the order it applied the gradients. Calls into the
library's parameter server (parlab/schemes/parameter_server.py, lesson 08's helpers) or into this module (the judges'
references) are seen and fail the part (parlab/grading/labs/guard.py).

Every launch stops after LAUNCH["timeout"] seconds: a server that never answers a worker is reported then, with what
each rank was waiting in.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.distributed as dist

import parlab
from parlab.core import comm, probe
from parlab.core.check import compare
from parlab.core.lab_model import LabConfig, build_lab_model, lab_batches, lab_loss, train_lab_single_device
from parlab.grading.labs import prediction_lines, run_check
from parlab.grading.labs.guard import library_calls, library_line
from parlab.schemes.data_parallel import shard_batch
from parlab.schemes.parameter_server import (
    grads_to_vector,
    params_to_vector,
    run_worker,
    train_parameter_server,
    vector_to_params,
)

LAUNCH = {"timeout": 15, "echo": False}  # a correct run takes 1-4 s; a server that never answers is stopped at 15 s
# What the answers must not call: lesson 08's servers and helpers, and this module (the judges' own references).
LIBRARY = ("schemes/parameter_server.py", "lessons/parameter_server.py", "grading/labs/lab08_parameter_server.py")
CFG = LabConfig()  # the lab model: float64, Psi = 22,688 parameters in 21 tensors
P, B, STEPS, LR = 4, 6, 3, 0.1  # ranks (rank 0 serves, 3 workers), global batch rows, steps, SGD's learning rate
N = P - 1  # workers
BATCHES = lab_batches(CFG, B, STEPS, seed=0)  # [(x, y)], x, y: [B, T]: a worker trains on its b = B/N rows
STRAGGLER, SLOWDOWN = 3, 3.0  # worker 3 takes 3 x its compute time every step
SERVERS = 3  # the sharded server: ranks 0..2 serve, ranks 3..5 work (N = 3 workers)
BALANCE = 0.34  # no server may hold more than 34% of the parameters (an even split: 33.3%)
SSP_STEPS, SSP_BOUNDS = 4, (0, 1)  # the bounded-staleness check: K = 4 steps, at s = 0 and s = 1
SSP_BATCHES = lab_batches(CFG, B, SSP_STEPS, seed=1)

STRUCTURAL = {
    "sync": "3 workers, 3 steps of SGD on the lab model: the server's parameters (a FAIL names the first wrong "
    "tensor), every worker's last pull and the mean loss of each step equal one device on the whole batch "
    "(sync = large-batch SGD); the server sent theta to each worker K+1 times and received K gradients from each, "
    "G bytes each, never sent theta_{v+1} before it had all N gradients of step v, and called no library collective "
    "and nothing of parlab's parameter server",
    "placement": "the placement puts each of the lab model's 21 tensors on one of 3 servers (a FAIL names the first "
    "tensor without one), and no server holds more than 34% of the parameters (a FAIL names the busiest server and "
    "its share); nothing of parlab's parameter server called",
    "sharded": "with the student's placement, 3 servers and 3 workers: every server sends each worker its whole "
    "shard K+1 times and receives K gradients of it, one message each, of exactly its shard's bytes, and no other "
    "messages; no server sends version v+1 before all N gradients of step v; every server's tensors, every worker's "
    "parameters after its last pull and each step's mean loss equal one device (a FAIL names the first wrong "
    "tensor); every message through parlab.core.comm, no library collective, nothing of parlab's parameter server",
    "round_robin": "the predicted bytes through the busiest server's link (exact) and its cut against one server "
    "(within 1%) for the lab model's tensors dealt round-robin over 3 servers, from the tensors' sizes; the "
    "student's own sharded server run with that placement measured beside them (shown, not scored)",
    "staleness": "the staleness of every gradient in the logs of real runs (parlab's synchronous and asynchronous "
    "servers with a straggler) and of three written logs (one with an update between a worker's two pulls, so that "
    "its first and last pulls differ), against the judge's own reading of each log; nothing of parlab's parameter "
    "server or this module called",
    "ssp": "at s = 0 and s = 1 with a straggler: the one-device replay of the run in the server's order equals the "
    "server's final parameters, the loss of every gradient and every worker's last pull; every reply to a worker's "
    "c-th push was sent once, after that push, when every worker had pushed at least c - s gradients, and at the "
    "first receive it could (no reply held longer); N x K gradients applied, K per worker; a server that never "
    "answers is stopped within the 15 s launch timeout, naming what each rank waits in",
}


def run(check: str, *answers) -> None:
    """A check cell: see parlab.grading."""
    run_check(__name__, check, *answers)


def next_token_loss(model, x, y) -> torch.Tensor:
    """The lab model's mean next-token loss of rows x: [b, T] (y: x shifted by one)."""
    return lab_loss(model(x), y)


def _library_line(what: str, called: list[str]) -> str:
    # An import runs a module's body (<module>): not a call. A comprehension or lambda inside a function that was
    # called adds nothing to that function's name.
    called = [name for name in called if not name.endswith(": <module>") and ".<locals>.<" not in name]
    return library_line(what, called, "parlab's parameter server or this lab's checks")


def _calls(calls: list[dict]) -> list[list]:
    """A rank's process-group calls as plain data: [op, peer, bytes]."""
    return [[c["op"], int(c["peer"]), int(c["bytes"])] for c in calls]


# ------------------------------------------------------------------------------------------------ one device


def tensor_names() -> list[tuple[str, int]]:
    """The lab model's tensors, in named_parameters() order: (name, numel)."""
    return [(n, p.numel()) for n, p in build_lab_model(CFG).named_parameters()]


def first_wrong_tensor(what: str, got: dict, expected: dict, against: str = "single device") -> str:
    """got and expected by tensor name: one verdict; a FAIL names the first wrong (or missing) tensor."""
    verdict = compare(what, got, expected, against=against)
    if verdict.passed:
        return verdict.line
    for name, want in expected.items():
        have = got.get(name)
        if not isinstance(have, torch.Tensor) or have.shape != want.shape:
            came = "nothing" if have is None else f"shape {list(getattr(have, 'shape', []))}"
            return f"{what}: {name}: expected shape {list(want.shape)}, received {came}: FAIL"
        err = (have.to(torch.float64) - want).abs().max().item()
        if not err <= 1e-10:
            i = int((have.to(torch.float64) - want).abs().flatten().argmax())
            expected_value, received = want.flatten()[i].item(), have.flatten()[i].item()
            return f"{what}: {name}, element {i}: expected {expected_value:.6g}, received {received:.6g}: FAIL"
    return verdict.line


def by_name(vector: torch.Tensor) -> dict[str, torch.Tensor]:
    """A flat [Psi] vector cut into the lab model's tensors (flattened), by name."""
    out, offset = {}, 0
    for name, numel in tensor_names():
        out[name] = vector[offset : offset + numel]
        offset += numel
    return out


def gradient_at(theta: torch.Tensor, batch, worker: int | None = None) -> tuple[torch.Tensor, float]:
    """The gradient [Psi] and the loss of the lab model at parameters theta on a batch's rows (worker w's, or all)."""
    model = build_lab_model(CFG)
    vector_to_params(theta, model)
    x, y = batch
    if worker is not None:
        x, y = shard_batch(x, y, worker - 1, N)  # [b, T]
    loss = next_token_loss(model, x, y)
    loss.backward()
    return grads_to_vector(model), loss.item()


@functools.lru_cache(maxsize=1)  # the same reference for every notebook graded
def one_device() -> tuple[dict[str, torch.Tensor], list[float]]:
    """One device, the whole batch, K steps of SGD: the parameters after them, by name, and the loss of each step."""
    result = train_lab_single_device(CFG, BATCHES, optimizer="sgd", lr=LR)
    return result.params, result.losses


def flat(params: dict[str, torch.Tensor]) -> torch.Tensor:
    """Parameters by name -> one [Psi] vector, in named_parameters() order (params_to_vector's)."""
    return torch.cat([params[n].reshape(-1) for n, _ in tensor_names()])


# ------------------------------------------------------------------------------------ 1 · the synchronous server


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


def run_server_and_workers(server, batches, *args) -> dict:
    """Rank code: rank 0 calls server(theta_0, K, LR, *args) on the flat parameters [Psi] and returns its final
    theta and its calls; ranks 1..N run parlab's worker (worker STRAGGLER slowed by SLOWDOWN when args are given)."""
    rank = dist.get_rank()
    model = build_lab_model(CFG).to(parlab.device())  # theta_0, the same on every rank
    if rank == 0:
        record = recorded(server, params_to_vector(model), len(batches), LR, *args)
        theta = record.pop("out")
        return {**record, "theta": theta.detach().cpu().clone() if isinstance(theta, torch.Tensor) else None}
    slowdown = SLOWDOWN if rank == STRAGGLER and args else 1.0
    batches = [(x.to(parlab.device()), y.to(parlab.device())) for x, y in batches]
    out = run_worker(model, batches, slowdown=slowdown, loss_fn=next_token_loss)
    losses = torch.tensor(out["losses"], dtype=torch.float64)  # host: plain numbers, returned to the parent
    return {"losses": losses, "theta": params_to_vector(model).cpu()}


def collect_sync(sync_server) -> dict:
    return {"ranks": list(parlab.launch(run_server_and_workers, P, sync_server, BATCHES, **LAUNCH))}


def collective_line(what: str, calls_per_rank: list[list]) -> str:
    found = [(r, sorted({op for op, _, _ in calls if op not in probe.P2P})) for r, calls in enumerate(calls_per_rank)]
    found = [f"rank {r} called {ops}" for r, ops in found if ops]
    return (
        f"{what}: only send and recv, no library collective: {'PASS' if not found else '; '.join(found[:2]) + ': FAIL'}"
    )


def traffic_line(what: str, messages: list, workers: list[int], pulls: int, pushes: int, size: int) -> str:
    """A server's messages with each worker: `pulls` sends and `pushes` receives of `size` bytes each, and no message
    with anyone else; a FAIL names the first worker whose messages differ, expected and found."""
    strangers = sorted({peer for _, peer, _ in messages if peer not in workers})
    if strangers:
        return f"{what}: expected messages with workers {workers} only, found some with ranks {strangers}: FAIL"
    for w in workers:
        for op, count, kind in (("send", pulls, "sends"), ("recv", pushes, "receives")):
            sizes = [b for o, peer, b in messages if peer == w and o == op]
            if sizes != [size] * count:
                found = f"{len(sizes)} of {sorted(set(sizes))} bytes" if sizes else "none"
                return f"{what}: worker {w}: expected {count} {kind} of {size} bytes, found {found}: FAIL"
    return f"{what}: PASS"


def synchrony_line(what: str, messages: list, workers: list[int]) -> str:
    """The j-th send to any worker comes after j gradients from every worker (in the server's program order)."""
    pushes, sends = dict.fromkeys(workers, 0), dict.fromkeys(workers, 0)
    for op, peer, _ in messages:
        if op == "recv" and peer in pushes:
            pushes[peer] += 1
        elif op == "send" and peer in sends:
            if min(pushes.values()) < sends[peer]:
                lagging = min(pushes, key=pushes.get)
                return (
                    f"{what}: send {sends[peer]} to worker {peer}: expected after {sends[peer]} gradients from every "
                    f"worker, found it after {pushes[lagging]} from worker {lagging}: FAIL"
                )
            sends[peer] += 1
    return f"{what}: PASS"


def judge_sync(data) -> list[str]:
    ranks = data["ranks"]
    server, workers = ranks[0], ranks[1:]
    params, losses = one_device()
    K, G, theta_k = STEPS, flat(params).numel() * 8, flat(params)
    mean_loss = torch.stack([w["losses"] for w in workers]).mean(dim=0)  # each worker's loss: the mean of b rows
    got = by_name(server["theta"]) if isinstance(server["theta"], torch.Tensor) else {}
    messages, everyone = server["messages"], list(range(1, P))
    return [
        first_wrong_tensor(f"server: parameters after {K} steps", got, by_name(theta_k)),
        compare(
            "loss of each step, the mean over the workers",
            mean_loss,
            torch.tensor(losses, dtype=torch.float64),  # host: the reference on one device
        ).line,
        compare("every worker's last pull", [w["theta"] for w in workers], [theta_k] * N).line,
        collective_line("server", [server["calls"]]),
        through_comm_line("server", server),
        traffic_line(
            "server: theta to each worker K+1 times, a gradient from each K times", messages, everyone, K + 1, K, G
        ),
        synchrony_line("server: no theta_{v+1} sent before all N gradients of step v", messages, everyone),
        _library_line("server", server["library"]),
    ]


# --------------------------------------------------------------------------------- 2 · the sharded server


def shard_workers() -> list[int]:
    return list(range(SERVERS, SERVERS + N))


def run_sharded(plan: dict[str, int], sharded_server, sharded_worker, batches) -> dict:
    """Rank code: ranks 0..S-1 call sharded_server(shard, workers, K, LR) with the tensors `plan` gives them (name ->
    tensor, in named_parameters order); ranks S..S+N-1 call sharded_worker(model, rows, plan) with their b rows of
    every batch. Returns each rank's record (recorded()), and the server's tensors or the worker's losses and
    parameters after its last pull."""
    rank, workers = dist.get_rank(), shard_workers()
    model = build_lab_model(CFG).to(parlab.device())  # theta_0 on every rank
    if rank < SERVERS:
        shard = {n: p.detach().clone() for n, p in model.named_parameters() if plan[n] == rank}
        record = recorded(sharded_server, shard, workers, len(batches), LR)
        out = record.pop("out")
        tensors = {n: t.detach().cpu().clone() for n, t in out.items()} if isinstance(out, dict) else {}
        return {**record, "tensors": tensors}
    i = workers.index(rank)
    rows = [shard_batch(x.to(parlab.device()), y.to(parlab.device()), i, N) for x, y in batches]  # [b, T] each
    record = recorded(sharded_worker, model, rows, dict(plan))
    losses = record.pop("out")
    return {
        **record,
        "losses": torch.tensor([float(v) for v in losses], dtype=torch.float64),  # host: returned to the parent
        "params": {n: p.detach().cpu().clone() for n, p in model.named_parameters()},
    }


def _plan_of(placement, servers: int) -> tuple[dict | None, list[str]]:
    """The student's placement, called in the kernel under the library hook: (plan or None, the library calls)."""
    sizes = dict(tensor_names())
    with library_calls(LIBRARY) as called:
        plan = placement(dict(sizes), servers)
    try:
        plan = {str(n): int(s) for n, s in dict(plan).items()}
    except (TypeError, ValueError):
        plan = None
    return plan, list(called)


def _valid(plan) -> bool:
    names = {n for n, _ in tensor_names()}
    return isinstance(plan, dict) and set(plan) == names and all(0 <= s < SERVERS for s in plan.values())


def collect_placement(placement) -> dict:
    plan, called = _plan_of(placement, SERVERS)
    return {"plan": plan, "library": called}


def collect_sharded(placement, sharded_server, sharded_worker) -> dict:
    plan, _ = _plan_of(placement, SERVERS)
    data = {"plan": plan, "ranks": None}
    if _valid(plan):  # an invalid plan has nothing to run (the placement check says what is wrong with it)
        world = SERVERS + N
        data["ranks"] = list(parlab.launch(run_sharded, world, plan, sharded_server, sharded_worker, BATCHES, **LAUNCH))
    return data


def placement_lines(plan) -> list[str]:
    names = [n for n, _ in tensor_names()]
    what = f"placement: every tensor of the lab model on one of the {SERVERS} servers"
    if not isinstance(plan, dict):
        return [f"{what}: expected a dict name -> server, received {type(plan).__name__}: FAIL"]
    missing = [n for n in names if n not in plan]
    bad = [(n, s) for n, s in plan.items() if n not in names or not 0 <= s < SERVERS]
    if missing:
        return [f"{what}: expected a server for {missing[0]}, found none ({len(missing)} tensors missing): FAIL"]
    if bad:
        return [
            f"{what}: {bad[0][0]}: expected a tensor of the model on server 0..{SERVERS - 1}, found {bad[0][1]}: FAIL"
        ]
    load = [sum(numel for n, numel in tensor_names() if plan[n] == s) for s in range(SERVERS)]
    total, busiest = sum(load), max(range(SERVERS), key=lambda s: load[s])
    share = f"placement: no server holds more than {BALANCE:.0%} of the parameters"
    if load[busiest] > BALANCE * total:
        return [
            f"{what}: PASS",
            f"{share}: server {busiest} holds {load[busiest]:,} of {total:,} ({load[busiest] / total:.1%}): FAIL",
        ]
    return [f"{what}: PASS", f"{share}: PASS"]


def workers_line(what: str, got: list[dict], reference: dict) -> str:
    """Every worker's parameters against one device; a FAIL names the first wrong worker and tensor."""
    verdict = compare(what, got, [reference] * len(got))
    if verdict.passed:
        return verdict.line
    for w, params in zip(shard_workers(), got, strict=True):
        line = first_wrong_tensor(f"{what}: worker {w}", params, reference)
        if line.endswith(": FAIL"):
            return line
    return verdict.line


def judge_placement(data) -> list[str]:
    return [*placement_lines(data["plan"]), _library_line("placement", data["library"])]


def judge_sharded(data) -> list[str]:
    plan, ranks = data["plan"], data["ranks"]
    if ranks is None:
        return ["sharded training: not run: your placement is not a valid plan (see the placement check): FAIL"]
    workers, K, lines = shard_workers(), STEPS, []
    servers, trainers = ranks[:SERVERS], ranks[SERVERS:]
    reference, losses = one_device()
    lines.append(collective_line("every rank", [res["calls"] for res in ranks]))
    unseen = [through_comm_line(f"every rank: rank {r}", res) for r, res in enumerate(ranks)]
    unseen = [line for line in unseen if line.endswith(": FAIL")]
    lines.append(unseen[0] if unseen else "every rank: every message through parlab.core.comm: PASS")
    for j, res in enumerate(servers):
        size = sum(numel for n, numel in tensor_names() if plan[n] == j) * 8
        what = f"server {j}: its shard to each worker K+1 times, its gradient from each K times, one message each"
        lines.append(traffic_line(what, res["messages"], workers, K + 1, K, size))
        what = f"server {j}: no version v+1 sent before all N gradients of step v"
        lines.append(synchrony_line(what, res["messages"], workers))
    strays = [
        (w, peer) for w, res in zip(workers, trainers, strict=True) for _, peer, _ in res["messages"] if peer >= SERVERS
    ]
    what = "workers: messages with the servers only"
    lines.append(
        f"{what}: PASS"
        if not strays
        else f"{what}: worker {strays[0][0]}: expected servers, found rank {strays[0][1]}: FAIL"
    )
    held = {n: t for res in servers for n, t in res["tensors"].items()}
    lines.append(first_wrong_tensor(f"servers' tensors after {K} steps", held, reference))
    mean_loss = torch.stack([res["losses"] for res in trainers]).mean(dim=0)
    lines.append(
        compare(
            "loss of each step, the mean over the workers",
            mean_loss,
            torch.tensor(losses, dtype=torch.float64),  # host: the reference on one device
        ).line
    )
    lines.append(
        workers_line("every worker's parameters after its last pull", [res["params"] for res in trainers], reference)
    )
    lines.append(_library_line("servers and workers", [n for res in ranks for n in res["library"]]))
    return lines


# ------------------------------------------------------------------- the prediction: round-robin over 3 servers


def round_robin_plan(servers: int = SERVERS) -> dict[str, int]:
    """Tensor i of named_parameters() on server i mod S."""
    return {name: i % servers for i, (name, _) in enumerate(tensor_names())}


def round_robin_theory() -> dict[str, float]:
    """The busiest server's link over the whole run (its shard to each of N workers K+1 times, K gradients back, 8
    bytes a value) and the factor by which that is less than one server's (part 1's)."""
    plan, sizes = round_robin_plan(), dict(tensor_names())
    load = [sum(sizes[n] for n in sizes if plan[n] == s) for s in range(SERVERS)]
    per_value = N * (2 * STEPS + 1) * 8
    return {"busiest_bytes": per_value * max(load), "cut": sum(load) / max(load)}


THEORY = {"round_robin": round_robin_theory}


def _plain(value):
    try:
        return float(value.item() if hasattr(value, "item") else value) if not isinstance(value, bool) else repr(value)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return repr(value)[:40]


def collect_round_robin(busiest_bytes, cut, sharded_server, sharded_worker) -> dict:
    """The predictions as numbers, and (shown, not scored) the busiest server's link measured in the student's own
    sharded server run with the round-robin placement."""
    data = {"predicted": {"busiest_bytes": _plain(busiest_bytes), "cut": _plain(cut)}, "measured": None, "note": ""}
    try:
        world = SERVERS + N
        ranks = parlab.launch(run_sharded, world, round_robin_plan(), sharded_server, sharded_worker, BATCHES, **LAUNCH)
        data["measured"] = max(sum(b for _, _, b in ranks[j]["messages"]) for j in range(SERVERS))
    except Exception as exc:  # the prediction is graded all the same; only the measurement is missing
        data["note"] = f"your sharded server did not run ({type(exc).__name__}): nothing measured"
    return data


def judge_round_robin(data) -> list[str]:
    theory, predicted = round_robin_theory(), data["predicted"]
    lines = prediction_lines(
        "round-robin over 3 servers: bytes through the busiest server's link in the run",
        predicted["busiest_bytes"],
        theory["busiest_bytes"],
        rtol=0,
    )
    lines += prediction_lines(
        "round-robin over 3 servers: one server's bytes / the busiest server's",
        predicted["cut"],
        theory["cut"],
        rtol=0.01,
    )
    if data.get("measured") is not None:
        lines.append(
            f"measured in your sharded server with the round-robin placement: the busiest link {data['measured']:,.0f} "
            "bytes"
        )
    if data.get("note"):
        lines.append(data["note"])
    return lines


# ---------------------------------------------------------------------------- 4 · staleness, from a server's log


def server_log(messages: list, updates: list[int] | None = None) -> list[tuple[str, int]]:
    """A server's log from its traced messages: ("pull", w) for theta sent to w, ("push", w) for a gradient
    received from w, ("update", 0) where the server applied an update. updates: after how many messages each
    update came (None: one update right after every gradient received, as an asynchronous server does)."""
    log = []
    for i, (kind, peer, _) in enumerate(messages):
        log.append(("pull" if kind == "send" else "push", int(peer)))
        if updates is None and kind == "recv":
            log.append(("update", 0))
        elif updates is not None:
            log += [("update", 0)] * updates.count(i + 1)
    return log


def read_staleness(log: list[tuple[str, int]]) -> list[int]:
    """The judge's reading of a log: for each push, in order, (version it was applied at) - (version pulled last)."""
    version, pulled, waiting, out = 0, {}, [], []
    for what, w in log:
        if what == "pull":
            pulled[w] = version
        elif what == "push":
            waiting.append(len(out))
            out.append(pulled[w])
        elif what == "update":
            for i in waiting:
                out[i] = version - out[i]
            waiting, version = [], version + 1
    return out


WRITTEN_LOGS = {
    "two gradients per update, a pull between them": [
        ("pull", 1),
        ("pull", 2),
        ("push", 2),
        ("pull", 2),
        ("push", 1),
        ("update", 0),
        ("push", 2),
        ("pull", 1),
        ("update", 0),
        ("pull", 2),
        ("push", 1),
        ("update", 0),
    ],
    # Worker 1 pulls version 0, then version 1 after worker 2's update, and only then pushes: its gradient was
    # computed on what it pulled last (version 1), not on the first pull since its last push (version 0).
    "a worker pulls twice, with an update between, before it pushes": [
        ("pull", 1),
        ("pull", 2),
        ("push", 2),
        ("update", 0),
        ("pull", 2),
        ("pull", 1),
        ("push", 2),
        ("update", 0),
        ("pull", 2),
        ("push", 1),
        ("update", 0),
        ("push", 2),
        ("update", 0),
    ],
    "four workers, one slow": [
        *[("pull", w) for w in (1, 2, 3, 4)],
        *[e for w in (1, 2, 3) for e in (("push", w), ("update", 0), ("pull", w))],
        *[e for w in (2, 1, 3, 2) for e in (("push", w), ("update", 0), ("pull", w))],
        ("push", 4),
        ("update", 0),
    ],
}


def _library_runs(batches) -> dict:
    """Rank code: parlab's synchronous then asynchronous server on the lab model, worker STRAGGLER slowed; the
    server's messages and where its updates came."""
    out = {}
    for mode in ("sync", "async"):
        model = build_lab_model(CFG).to(parlab.device())
        start = len(comm.trace_events())
        result = train_parameter_server(
            model,
            torch.optim.SGD(model.parameters(), lr=LR),
            [(x.to(parlab.device()), y.to(parlab.device())) for x, y in batches],
            mode=mode,
            straggler=STRAGGLER,
            slowdown=SLOWDOWN,
            loss_fn=next_token_loss,
        )
        if result["role"] != "server":
            continue
        messages, updates = [], []
        for e in comm.trace_events()[start:]:
            if e.kind in ("send", "recv"):
                messages.append([e.kind, int(e.peer), e.bytes])
            elif e.kind == "optimizer":
                updates.append(len(messages))
        out[mode] = {"messages": messages, "updates": updates if mode == "sync" else None}
    return out


def collect_staleness(staleness) -> dict:
    runs = parlab.launch(_library_runs, P, BATCHES, **LAUNCH)[0]
    logs = {
        f"parlab's synchronous server, worker {STRAGGLER} a straggler": server_log(**runs["sync"]),
        f"parlab's asynchronous server, worker {STRAGGLER} a straggler": server_log(**runs["async"]),
        **WRITTEN_LOGS,
    }
    answers, called = {}, []
    for what, log in logs.items():
        entries = [tuple(e) for e in log]
        try:
            with library_calls(LIBRARY) as seen:  # only the student's function inside
                taus = staleness(entries)
            called += seen
            answers[what] = [int(x) for x in taus]
        except Exception as error:  # one log's error fails that log's line, not the others
            answers[what] = f"{type(error).__name__}: {error}"
    return {
        "logs": {what: [list(e) for e in log] for what, log in logs.items()},
        "answers": answers,
        "library": list(called),
    }


def judge_staleness(data) -> list[str]:
    lines = []
    for what, log in data["logs"].items():
        expected, got = read_staleness([tuple(e) for e in log]), data["answers"][what]
        n = len(expected)
        if isinstance(got, str):
            lines.append(f"{what}: the staleness of each of the {n} gradients ({got[:80]}): FAIL")
        elif got == expected:
            lines.append(f"{what}: the staleness of each of the {n} gradients: PASS")
        else:
            first = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), min(len(got), n))
            mine = got[first] if first < len(got) else "none"
            theirs = expected[first] if first < n else "none"
            lines.append(
                f"{what}: the staleness of each of the {n} gradients ({len(got)} given; gradient {first}: "
                f"expected {theirs}, received {mine}): FAIL"
            )
    lines.append(_library_line("staleness", data.get("library", [])))
    return lines


# ------------------------------------------------------------------------------------ 5 · bounded staleness


def run_ssp(ssp_server, batches) -> dict:
    """Rank code: the server with each staleness bound s in SSP_BOUNDS, one run after the other."""
    return {s: run_server_and_workers(ssp_server, batches, s) for s in SSP_BOUNDS}


def collect_ssp(ssp_server) -> dict:
    results = parlab.launch(run_ssp, P, ssp_server, SSP_BATCHES, **LAUNCH)
    return {"runs": {str(s): [r[s] for r in results] for s in SSP_BOUNDS}}


def replay(order: list[int], reads: dict[tuple[int, int], int]) -> dict:
    """The run on one device: gradient u is worker order[u]'s c-th (its rows of batch c), computed at theta_r,
    r = reads[(w, c)], applied to theta_u. Returns every version theta_v and the loss of every gradient."""
    theta, versions, losses, done = params_to_vector(build_lab_model(CFG)), [], {}, {}
    for w in order:
        versions.append(theta)
        c = done.get(w, 0)
        r = reads.get((w, c))
        if r is None or r >= len(versions):
            return {"error": f"worker {w}'s gradient {c} was computed on parameters not yet sent"}
        g, losses[(w, c)] = gradient_at(versions[r], SSP_BATCHES[c], w)
        theta = theta - LR * g
        done[w] = c + 1
    versions.append(theta)
    return {"versions": versions, "losses": losses}


def _applied(order: list[int], reads: dict) -> list[tuple[int, tuple[int, int]]]:
    """(version it was applied at, (worker, its gradient number)) of each gradient, in the server's order."""
    done, out = {}, []
    for v, w in enumerate(order):
        c = done.get(w, 0)
        out.append((v, (w, c)))
        done[w] = c + 1
    return out


def _judge_ssp_run(s: int, ranks: list[dict]) -> list[str]:
    K, server = SSP_STEPS, ranks[0]
    messages, tag = server["messages"], f"s={s}"
    lines = [collective_line(f"{tag}: server", [server["calls"]]), through_comm_line(f"{tag}: server", server)]
    if not lines[-1].endswith(": PASS"):  # the sender of a receive from any rank is known only from parlab's trace
        return lines
    order = [int(peer) for kind, peer, _ in messages if kind == "recv"]
    per_worker = [order.count(w) for w in range(1, P)]
    verdict = "PASS" if per_worker == [K] * N else f"found {per_worker}: FAIL"
    lines.append(f"{tag}: gradients applied from workers 1..{N}: expected K = {K} each: {verdict}")
    # Replies: the c-th theta sent to w (c = 0: before any push) at the moment of `received` gradients.
    received, pushes, sent = 0, dict.fromkeys(range(1, P), 0), dict.fromkeys(range(1, P), 0)
    reads, broken, late, history = {}, [], [], [dict(pushes)]  # history[i]: pushes per worker after i receives
    for kind, peer, _ in messages:
        if kind == "recv":
            received += 1
            if peer in pushes:
                pushes[peer] += 1
            history.append(dict(pushes))
            continue
        if peer not in sent:
            broken.append(f"a send to rank {peer}, not a worker")
            continue
        c = sent[peer]
        sent[peer] += 1
        reads[(peer, c)] = received
        if c == 0:
            if received != 0:  # theta_0 goes to every worker before any gradient arrives
                broken.append(f"worker {peer}'s theta_0 sent after {received} gradients")
            continue
        if pushes[peer] != c or min(pushes.values()) < c - s:
            broken.append(
                f"reply {c} to worker {peer} sent when it had pushed {pushes[peer]} and the slowest worker "
                f"{min(pushes.values())} (expected {c} and at least {c - s})"
            )
        # the first moment it was allowed: w had pushed c gradients and every worker at least c - s
        first = next((i for i, h in enumerate(history) if h[peer] >= c and min(h.values()) >= c - s), None)
        if first is not None and first < received:
            late.append(f"reply {c} to worker {peer}: allowed after receive {first}, sent after receive {received}")
    what = f"{tag}: every reply after the worker's push and once every worker had pushed c - s gradients"
    lines.append(f"{what}: PASS" if not broken else f"{what}: {broken[0]}: FAIL")
    what = f"{tag}: no reply held past the first receive after which it was allowed"
    lines.append(f"{what}: PASS" if not late else f"{what}: {late[0]}: FAIL")
    complete = all(sent[w] == K + 1 for w in sent) and per_worker == [K] * N
    counts = {w: sent[w] for w in sent}
    lines.append(f"{tag}: each worker's K+1 pulls answered: {'PASS' if complete else f'found {counts}: FAIL'}")
    lines.append(_library_line(f"{tag}: server", server["library"]))
    if not complete:
        return lines
    result = replay(order, reads)
    if "error" in result:
        return [*lines, f"{tag}: one-device replay ({result['error']}): FAIL"]
    versions, against = result["versions"], "one-device replay in the server's order"
    ours = [ranks[w]["losses"][c] for w in range(1, P) for c in range(K)]
    ours = torch.tensor(ours, dtype=torch.float64)  # host: what the workers computed, judged here
    theirs = [result["losses"][(w, c)] for w in range(1, P) for c in range(K)]
    theirs = torch.tensor(theirs, dtype=torch.float64)  # host: the reference on one device
    last = [versions[reads[(w, K)]] for w in range(1, P)]
    tau = [reads_at - reads[(w, c)] for reads_at, (w, c) in _applied(order, reads)]
    bound = (N - 1) * (2 * s + 1)
    got = by_name(server["theta"]) if isinstance(server["theta"], torch.Tensor) else {}
    lines += [
        first_wrong_tensor(f"{tag}: server's parameters after {N * K} gradients", got, by_name(versions[-1]), against),
        compare(
            f"{tag}: loss of each of the {N * K} gradients, as the workers computed it", ours, theirs, against=against
        ).line,
        compare(
            f"{tag}: every worker's last pull", [ranks[w]["theta"] for w in range(1, P)], last, against=against
        ).line,
        f"{tag}: every gradient's staleness within (N-1)(2s+1) = {bound}: "
        + ("PASS" if max(tau) <= bound else f"found {max(tau)}: FAIL"),
    ]
    return lines


def judge_ssp(data) -> list[str]:
    lines = []
    for s in SSP_BOUNDS:
        lines += _judge_ssp_run(s, data["runs"][str(s)])
    return lines


# ---- not graded: what each mode does about a straggler (the lab's last cell)


def _straggler_rank(ssp_server, s: int, batches, slowdown: float) -> dict:
    out, rank = {}, dist.get_rank()
    batches = [(x.to(parlab.device()), y.to(parlab.device())) for x, y in batches]
    for mode in ("sync", "async", f"ssp s={s}"):
        model = build_lab_model(CFG).to(parlab.device())
        comm.barrier()
        start, first = time.perf_counter(), len(comm.trace_events())
        if mode.startswith("ssp"):
            if rank == 0:
                ssp_server(params_to_vector(model), len(batches), LR, s)
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
    return parlab.launch(_straggler_rank, P, ssp_server, s, batches, slowdown, **LAUNCH)[0]
