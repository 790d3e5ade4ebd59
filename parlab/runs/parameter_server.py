"""Run and check the parameter server (parlab/schemes/parameter_server.py): `python -m parlab run ps --mode
{sync,async}`.

The ranks train with a server on rank 0 and workers on ranks 1..P-1 (traced), then - unless --no-dp - the same
workers train with an all-reduce and no server. The parent checks:

  sync:  against one device on the whole batch (float64 <= 1e-10): the loss of every step, the server's and every
         worker's parameters; against the all-reduce DP run of the same workers; staleness 0 everywhere.
  async: against a one-device REPLAY of the run in the order its server applied the updates (which worker, which
         step, which version it had read): the final parameters and the loss of every gradient. The order itself
         depends on timing; what is checked is deterministic: N x K updates, K per worker, every worker's first
         gradient computed on theta_0, hence a largest staleness >= N-1.
  both:  the gradients the server received (N x K) and the updates it applied (sync: K, one averaged update per
         step; async: N x K, one per gradient), each beside its theory.
  both:  the bytes each rank sent and received (parlab.core.comm) against the protocol: server = N x a worker's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from parlab.core import comm
from parlab.core.check import CountCheck, compare, host_values
from parlab.core.models import build_model, lm_loss, make_batches, make_optimizer, synthetic_corpus
from parlab.runs.options import DEFAULT_CHECKPOINT_EVERY, FaultOptions, ModelOptions, option
from parlab.runs.registry import Scheme, launch_scheme
from parlab.runs.report import count_checks, mean_losses, model_fields, one_device_checks, run_report, single_device_run
from parlab.runtime.errors import Results
from parlab.schemes.parameter_server import (
    MODES,
    SERVER,
    check_setup,
    params_to_vector,
    ps_theory,
    replay_on_one_device,
    train_all_reduce_dp,
    train_parameter_server,
    vector_to_params,
)


@dataclass
class PSOptions(FaultOptions, ModelOptions):
    batch: int = option(12, "global batch: sequences per step over all workers (divisible by world - 1)")
    mode: str = option(
        "sync", "sync (wait for every worker) or async (apply each gradient as it arrives)", choices=MODES
    )
    straggler: int | None = option(None, "the worker rank (1..world-1) to slow down (default: none)")
    slowdown: float = option(1.0, "the straggler's step takes this many times its compute time", bounds="[1, 1000]")
    dp: bool = option(True, "also train the same workers with an all-reduce, no server (--no-dp skips it)")
    # At most 1.5 s: launch's hang watch stops ranks stuck for 2 s.
    heartbeat: float = option(
        1.0, "with --kill-rank: seconds without a gradient before a worker is declared dead", bounds="(0, 1.5]"
    )

    def validate(self) -> None:
        super().validate()
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} must be one of {MODES}")
        check_setup(self.world_size, self.straggler, self.slowdown, self.batch)
        if self.kill_rank is not None and (self.mode != "async" or self.kill_rank == SERVER):
            raise ValueError(
                "--kill-rank with ps: a worker (1..world-1) of --mode async (a dead server, or a dead "
                "worker under sync, stops everyone: see dp and zero for restarts)"
            )
        if self.kill_rank is None:
            self.no_effect(("heartbeat",), "without kill_rank (the server declares a silent worker dead)")
        elif self.keep_checkpoint or self.checkpoint_every != DEFAULT_CHECKPOINT_EVERY:
            raise ValueError(
                "checkpoint_every, keep_checkpoint: no effect with ps, which saves no checkpoint (the asynchronous "
                "server carries on without the dead worker)"
            )


def eval_batch(opts: PSOptions, rows: int = 64):
    """A fixed batch of the training corpus, drawn apart from the training batches, on which every version
    theta_v of every mode is measured (the loss curves)."""
    cfg = opts.gpt_config()
    corpus = synthetic_corpus(cfg.vocab_size, seed=opts.seed)
    gen = torch.Generator().manual_seed(10**6)
    starts = torch.randint(len(corpus) - cfg.seq_len - 1, (rows,), generator=gen)  # host: the seeded draw
    x = torch.stack([corpus[s : s + cfg.seq_len] for s in starts])  # [rows, T]
    y = torch.stack([corpus[s + 1 : s + cfg.seq_len + 1] for s in starts])  # [rows, T]
    return x, y


def ps_rank(opts: PSOptions) -> dict:
    """Rank code: the parameter server (traced), then all-reduce DP over the workers (traced, unless opts.dp is
    False). The server also measures the loss of every version theta_v on a fixed batch, after training."""
    cfg, P = opts.gpt_config(), opts.world_size
    # The asynchronous server's any-source receive needs gloo (NCCL has none): under NCCL (one GPU per rank) the
    # ranks talk over gloo groups instead, on the CPU. Every rank takes part in creating a group.
    backend = "gloo" if dist.get_backend() == "nccl" else None
    everyone = dist.new_group(backend="gloo") if backend else None
    workers = dist.new_group(list(range(1, P)), backend=backend) if opts.dp else None
    dev = comm.device(everyone)  # the device of the server's group: the CPU (gloo), whatever the world's backend
    batches = make_batches(cfg, opts.batch, opts.steps, opts.seed, device=dev)  # global [B, T], the same everywhere
    model = build_model(cfg, opts.seed, device=dev)
    optimizer = make_optimizer(model.parameters(), opts.optimizer, opts.lr)
    out = train_parameter_server(
        model,
        optimizer,
        batches,
        mode=opts.mode,
        straggler=opts.straggler,
        slowdown=opts.slowdown,
        group=everyone,
        keep_history=comm.group_rank() == SERVER,
    )
    if out["role"] == "server":
        x, y = (t.to(dev) for t in eval_batch(opts))
        with torch.no_grad():
            evaluator = build_model(cfg, opts.seed, device=dev)
            losses = []
            for theta in out.pop("history"):
                vector_to_params(theta, evaluator)
                losses.append(lm_loss(evaluator(x), y).item())
            out["eval_losses"] = losses  # eval_losses[v]: the loss of theta_v on the fixed batch
    if opts.dp and comm.group_rank() != SERVER:
        dp_model = build_model(cfg, opts.seed, device=dev)
        dp_optimizer = make_optimizer(dp_model.parameters(), opts.optimizer, opts.lr)
        own = opts.slowdown if comm.group_rank() == opts.straggler else 1.0
        out["dp"] = train_all_reduce_dp(dp_model, dp_optimizer, batches, slowdown=own, group=workers)
    return out


def ps_report(opts: PSOptions, results: Results) -> dict:
    """Check against one device (sync) or a one-device replay (async); count the bytes and the updates."""
    P, mode = opts.world_size, opts.mode
    server, workers = results[SERVER], [r for r in results if r["role"] == "worker"]
    numerics = _sync_numerics if mode == "sync" else _async_numerics
    numeric, reference_losses = numerics(opts, server, workers)
    traffic, comm_table, sizes = _traffic(opts, results)
    t0 = server["start"]
    return run_report(
        "ps",
        P,
        numeric + _update_counts(opts, server) + traffic,
        mode=mode,
        workers=P - 1,
        comm=comm_table,
        **sizes,
        staleness=[u["staleness"] for u in server["updates"]],
        updates=server["updates"],  # one record per gradient received (async: each is one update applied)
        updates_applied=server["applied"],
        update_seconds=[t - t0 for t in server["update_times"]],  # when each update was applied (server clock)
        eval_losses=server["eval_losses"],  # the loss of theta_0, theta_1, ... on a fixed batch
        loss_single=reference_losses,
        straggler=opts.straggler,
        slowdown=opts.slowdown,
        **model_fields(opts.gpt_config(), opts, "steps", "batch"),
        ps_seconds=server["end"] - server["start"],
        dp_seconds=max(w["dp"]["end"] for w in workers) - min(w["dp"]["start"] for w in workers) if opts.dp else None,
    )


def _sync_numerics(opts: PSOptions, server: dict, workers: list[dict]) -> tuple[list, list[float]]:
    """sync: the server's and every worker's parameters against one device on the whole batch (and against
    all-reduce DP of the same workers). Returns (verdicts, the one device's loss of each step)."""
    K, N = opts.steps, opts.world_size - 1
    single = single_device_run(opts)
    numeric = one_device_checks(
        single,
        opts.gpt_config().torch_dtype,
        # The loss of a step is the mean over all B rows: the mean of the N workers' means (b rows each).
        loss=(f"sync: loss of each of {K} steps", mean_losses(workers, K)),
        params=(f"sync: server's parameters after {K} steps", server["params"]),
    )
    numeric.append(
        compare("sync: every worker's parameters (last pull)", [w["params"] for w in workers], [single.params] * N)
    )
    if opts.dp:
        numeric += [
            compare(
                f"all-reduce DP over the {N} workers: parameters",
                [w["dp"]["params"] for w in workers],
                [single.params] * N,
            ),
            compare(
                "sync server vs all-reduce DP: parameters",
                server["params"],
                workers[0]["dp"]["params"],
                against="all-reduce DP",
            ),
        ]
    return numeric, single.losses


def _async_numerics(opts: PSOptions, server: dict, workers: list[dict]) -> tuple[list, None]:
    """async: the order of the updates depends on timing, so the reference is one device REPLAYING the order the
    server applied them in: the final parameters and the loss of every gradient. Returns (verdicts, None)."""
    P, K, N, cfg = opts.world_size, opts.steps, opts.world_size - 1, opts.gpt_config()
    dtype, model = cfg.torch_dtype, build_model(cfg, opts.seed)  # host: the parent's reference
    optimizer = make_optimizer(model.parameters(), opts.optimizer, opts.lr)
    batches = make_batches(cfg, opts.batch, K, opts.seed)  # host: the parent's reference
    replay = replay_on_one_device(model, optimizer, batches, server["updates"], N)
    ours = host_values((w["losses"][k] for w in workers for k in range(K)), dtype)
    theirs = host_values((replay["losses"][(w, k)] for w in range(1, P) for k in range(K)), dtype)
    against = "one-device replay of the same update order"
    numeric = [
        compare(
            f"async: server's parameters after {N * K} updates", server["params"], replay["params"], against=against
        ),
        compare(f"async: loss of each of the {N * K} gradients", ours, theirs, against=against),
    ]
    return numeric, None


def _update_counts(opts: PSOptions, server: dict) -> list[CountCheck]:
    """The counts that are deterministic in both modes. Gradients received and updates applied differ in sync
    mode: the server averages the N gradients of a step into ONE update (K in all); async applies each (N x K)."""
    P, K, N, mode = opts.world_size, opts.steps, opts.world_size - 1, opts.mode
    updates = server["updates"]
    staleness = [u["staleness"] for u in updates]
    per_worker = [sum(u["worker"] == w for u in updates) for w in range(1, P)]
    applied_theory, formula = (K, "K") if mode == "sync" else (N * K, "N x K")
    rows = [
        (f"{mode}: updates applied by the server ({formula})", server["applied"], applied_theory),  # counted there
        (f"{mode}: gradients received by the server (N x K)", len(updates), N * K),
    ]
    rows += [(f"{mode}: gradients received from worker {w} (K)", per_worker[w - 1], K) for w in range(1, P)]
    if mode == "sync":
        rows.append(("sync: largest staleness", max(staleness), 0))
    else:
        first_reads = sum(u["read_version"] == 0 for u in updates if u["step"] == 0)
        rows += [
            ("async: workers whose first gradient was computed on theta_0", first_reads, N),
            ("async: largest staleness (the last of those N gradients)", max(staleness), N - 1, ">="),
        ]
    return count_checks(rows)


def _traffic(opts: PSOptions, results: Results) -> tuple[list[CountCheck], dict, dict]:
    """The bytes each rank sent and received against the protocol: every message has the server at one end, so
    the server moves N x a worker's bytes; and the all-reduce DP payload. Returns (checks, comm figures, the
    byte report fields)."""
    P, K, N, cfg = opts.world_size, opts.steps, opts.world_size - 1, opts.gpt_config()
    grad_bytes = params_to_vector(build_model(cfg, opts.seed)).numel() * cfg.dtype_bytes  # host: counted
    table = results.trace.bytes_per_rank()
    sent, received = table.get("send", [0] * P), table.get("recv", [0] * P)
    ps_bytes = [sent[r] + received[r] for r in range(P)]  # the parameter server's traffic, per rank
    server_bytes, worker_bytes = ps_bytes[SERVER], [ps_bytes[w] for w in range(1, P)]
    theory = ps_theory(grad_bytes, P, K)
    rows = [
        (f"worker {w}: bytes sent + received ((2K+1) x G)", worker_bytes[w - 1], theory["theory_worker_bytes"])
        for w in range(1, P)
    ]
    rows.append((f"server: bytes sent + received (N x a worker's, N = {N})", server_bytes, N * worker_bytes[0]))
    comm_table = {
        **table,
        "server_bytes_per_step": 2 * N * grad_bytes,
        "worker_bytes_per_step": 2 * grad_bytes,
        **theory,
    }
    if opts.dp:
        all_reduce = table.get("all_reduce", [0] * P)
        per_step = [all_reduce[w] / K for w in range(1, P)]
        rows += [(f"all-reduce DP, worker {w}: payload per step (G)", per_step[w - 1], grad_bytes) for w in range(1, P)]
        comm_table["all_reduce_per_step"] = per_step
    sizes = {"server_bytes": server_bytes, "worker_bytes": worker_bytes, "grad_bytes": grad_bytes}
    return count_checks(rows), comm_table, sizes


def run_ps(world_size: int = 4, mode: str = "sync", **options) -> tuple[Results, dict]:
    """Run the parameter server on live ranks; returns (results, report), the report being what
    `python -m parlab run ps` prints. options: any PSOptions field (steps, batch, straggler, slowdown, dp, ...)."""
    return launch_scheme("ps", world_size=world_size, mode=mode, **options)


SCHEMES = [
    Scheme(
        "ps",
        "parameter server on rank 0, workers on the others; sync (vs one device) or async (staleness, replayed)",
        PSOptions,
        ps_rank,
        ps_report,
        failure="ps",
    )
]
