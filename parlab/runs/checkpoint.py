"""Failures injected and survived: `python -m parlab run dp --world 4 --steps 8 --kill-rank 2 --at-step 5`.

The same for `zero --stage 3` and `ps --mode async`. The schemes' own run modules hand over to this one when
--kill-rank is given (parlab/runs/options.py FaultOptions):

  dp, zero   the launch itself trains the UNINTERRUPTED run (P ranks, the same data order): the comparison.
             The report then runs the story: a launch in which rank k dies in the middle of step s (os._exit),
             parlab.launch stops the others and names a rank; a second launch on the P-1 survivors loads the newest
             complete checkpoint (resharded from P to P-1 ranks) and finishes. Checked: the final parameters against
             one device trained on the same batches (float64, 1e-10), and against the uninterrupted run: equal when
             the survivors keep the global batch B (B divisible by P-1), else they keep their b = B/P rows each and
             the global batch shrinks to b(P-1): a documented difference, and the one-device reference does the same.
  ps async   the launch is the failure: worker k falls silent before its step s; the server notices (no gradient
             for --heartbeat seconds) and goes on with the others. Checked against a one-device replay of the
             updates the server applied.

Checkpoints go to a scratch folder (parlab/core/scratch.py) that is removed afterwards, unless --keep-checkpoint DIR.
"""

from __future__ import annotations

import functools
import json
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from parlab.core import comm
from parlab.core.check import compare
from parlab.core.models import build_model, lm_loss, make_batches, make_optimizer, train_single_device
from parlab.core.scratch import offload_folder
from parlab.runs.report import compare_losses, mean_losses, run_report
from parlab.runtime.errors import RankError, Results
from parlab.runtime.launcher import launch
from parlab.schemes.faults import checkpoint as ckpt
from parlab.schemes.faults.failures import DIED_FILE, FaultPlan, async_server_with_failures, resumable_rank
from parlab.schemes.parameter_server import SERVER, replay_on_one_device, run_worker


@contextmanager
def checkpoint_folder(keep: str = ""):
    """The folder the checkpoints go to: `keep` (created, left behind on purpose), else a scratch folder that is
    removed whatever happens (parlab/core/scratch.py)."""
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        yield Path(keep)
        return
    with offload_folder() as folder:
        yield folder


def _train_kwargs(kind: str, opts) -> dict:
    return {"seed": opts.seed, "optimizer": opts.optimizer, "lr": opts.lr, "stage": getattr(opts, "stage", 0)}


def survivor_rows(batch: int, world_size: int) -> int:
    """The global batch after one of P ranks is lost: B if P-1 ranks can share it, else b = B/P rows each."""
    return batch if batch % (world_size - 1) == 0 else batch // world_size * (world_size - 1)


# ------------------------------------------------------------------------------------------------ dp and zero


def uninterrupted_rank(kind: str, opts) -> dict:
    """Rank code of the launch that `run dp/zero --kill-rank` makes first: the same training, nobody dies."""
    batches = make_batches(opts.gpt_config(), opts.batch, opts.steps, opts.seed, device=comm.device())
    return resumable_rank(kind, opts.gpt_config(), batches, FaultPlan("", every=0), **_train_kwargs(kind, opts))


def survive(kind: str, opts) -> dict:
    """The failure and the restart (two launches); returns what happened, measured."""
    P, K, cfg = opts.world_size, opts.steps, opts.gpt_config()
    batches = make_batches(cfg, opts.batch, K, opts.seed)  # host: sent to the ranks, which move them
    rows = survivor_rows(opts.batch, P)
    kwargs = _train_kwargs(kind, opts)
    with checkpoint_folder(opts.keep_checkpoint) as root:
        plan = FaultPlan(str(root), opts.checkpoint_every, opts.kill_rank, opts.at_step)
        try:
            launch(resumable_rank, P, kind, cfg, batches, plan, echo=False, **kwargs)
            raise RuntimeError(f"rank {opts.kill_rank} was to die in step {opts.at_step}, and the run finished")
        except RankError as exc:
            detected, named = time.time(), exc.rank
        died = json.loads((root / DIED_FILE).read_text())
        newest = ckpt.latest(root)
        resumed = 0 if newest is None else ckpt.Reader(newest).step
        saved = {f.name: sum(g.stat().st_size for g in f.glob("rank*.pt")) for f in root.glob("step-*")}
        plan = FaultPlan(str(root), opts.checkpoint_every, resume=True)
        restart = launch(resumable_rank, P - 1, kind, cfg, batches, plan, rows=rows, echo=False, **kwargs)
    return {
        "died": died,
        "named": named,
        "detected": detected,
        "resumed_from": resumed,
        "restart": restart,
        "rows_after": rows,
        "checkpoint_bytes_on_disk": saved,
    }


def failure_report(kind: str, opts, uninterrupted: Results) -> dict:
    """Run the failure and the restart, and compare with one device and with the uninterrupted run."""
    P, K = opts.world_size, opts.steps
    story = survive(kind, opts)
    restart, resumed, rows = story["restart"], story["resumed_from"], story["rows_after"]
    name = "zero" if kind == "zero" else opts.mode
    single, losses_after, verdicts = _versus_one_device(opts, story)
    vs_uninterrupted = compare(
        f"vs the uninterrupted run on {P} ranks: parameters",
        restart[0]["params"],
        uninterrupted[0]["params"],
        against=f"uninterrupted {name}",
    )
    lines = _story_lines(kind, opts, story) + [v.line for v in verdicts]
    if rows == opts.batch:  # the math says: the same updates, only summed by fewer ranks
        verdicts.append(vs_uninterrupted)
        lines.append(vs_uninterrupted.line)
    else:
        lines.append(
            f"vs the uninterrupted run on {P} ranks: parameters differ by {vs_uninterrupted.max_abs_err:.1e}, "
            f"as expected: the survivors' global batch is {rows} rows, not {opts.batch} (give --batch divisible "
            f"by {P} and {P - 1} to keep it)"
        )
    ready = max(r["ready"] for r in restart)
    return run_report(
        name,
        P,
        verdicts,
        passed=story["died"]["rank"] == opts.kill_rank,
        comm={},
        lines=lines,
        killed_rank=story["died"]["rank"],
        named_rank=story["named"],
        at_step=opts.at_step,
        resumed_from=resumed,
        steps_lost=opts.at_step - resumed,  # steps computed again: the completed ones since the checkpoint + 1
        time_to_detect=story["detected"] - story["died"]["time"],
        time_to_restart=ready - story["detected"],  # new processes, rendezvous, reading the checkpoint
        restarted_on=P - 1,
        global_batch_after=rows,
        equal_to_uninterrupted=rows == opts.batch and vs_uninterrupted.passed,
        vs_uninterrupted_max_abs_err=vs_uninterrupted.max_abs_err,
        checkpoint_every=opts.checkpoint_every,
        checkpoint_bytes_per_rank=[r["bytes_read"] for r in restart],  # what each survivor read back
        checkpoint_bytes_on_disk=story["checkpoint_bytes_on_disk"],
        checkpoint_saves=[r["saves"] for r in restart],  # per survivor: each save's step, bytes, seconds
        loss_uninterrupted=mean_losses(uninterrupted, K),
        loss_after_restart=losses_after,
        loss_single=single.losses,
        steps=K,
    )


def _versus_one_device(opts, story: dict) -> tuple:
    """The survivors against one device trained on the same batches in the same order: the whole global batch
    up to the checkpoint, then the survivors' rows. Returns (the one device's run, the survivors' loss of each
    step after the restart, the verdicts)."""
    P, K, cfg = opts.world_size, opts.steps, opts.gpt_config()
    restart, resumed, rows = story["restart"], story["resumed_from"], story["rows_after"]
    batches = make_batches(cfg, opts.batch, K, opts.seed)  # host: the parent's reference
    same_order = [(x, y) if k < resumed else (x[:rows], y[:rows]) for k, (x, y) in enumerate(batches)]
    single = train_single_device(cfg, same_order, opts.seed, opts.optimizer, opts.lr)
    losses_after = [sum(r["losses"][k] for r in restart) / (P - 1) for k in range(K - resumed)]
    batch_note = (
        f"global batch kept at {opts.batch} rows"
        if rows == opts.batch
        else f"global batch {opts.batch} -> {rows} rows after the failure ({opts.batch // P} per survivor)"
    )
    verdicts = [
        compare(
            f"after the restart on {P - 1} ranks: parameters, every survivor ({batch_note})",
            [r["params"] for r in restart],
            [single.params] * (P - 1),
        ),
        compare_losses(
            f"after the restart: loss of steps {resumed + 1}..{K}",
            losses_after,
            single.losses[resumed:],
            cfg.torch_dtype,
        ),
    ]
    return single, losses_after, verdicts


def _story_lines(kind: str, opts, story: dict) -> list[str]:
    """What happened, in two lines: who died when, and where the survivors restarted from."""
    P, resumed = opts.world_size, story["resumed_from"]
    name = "zero" if kind == "zero" else opts.mode
    what = f"{name}{f' stage {opts.stage}' if kind == 'zero' else ''}"
    return [
        f"{what}: rank {story['died']['rank']} died in step {story['died']['step']} of {opts.steps} (os._exit); "
        "parlab.launch stopped the other ranks",
        f"restarted on {P - 1} ranks from the checkpoint of step {resumed} (resharded from {P} ranks); "
        f"steps lost: {opts.at_step - resumed}",
    ]


# ----------------------------------------------------------------------------------------- ps: carry on without


def ps_failure_rank(opts) -> dict:
    """Rank code: the asynchronous parameter server; worker `kill_rank` falls silent before step at_step.

    It returns instead of os._exit-ing: parlab.launch ends the whole job when a process dies, and here the point is
    that nobody else needs it. To the server it is gone all the same: it never sends again."""
    cfg, P, rank = opts.gpt_config(), opts.world_size, comm.group_rank()
    # The server receives from any worker, which only gloo can (parlab/runs/parameter_server.py): under NCCL the
    # ranks talk over a gloo group, on the CPU.
    group = dist.new_group(backend="gloo") if dist.get_backend() == "nccl" else None
    dev = comm.device(group)
    batches = make_batches(cfg, opts.batch, opts.steps, opts.seed, device=dev)
    model = build_model(cfg, opts.seed, device=dev)
    optimizer = make_optimizer(model.parameters(), opts.optimizer, opts.lr)
    if rank == SERVER:
        return async_server_with_failures(model, optimizer, opts.steps, heartbeat=opts.heartbeat, group=group)
    last = opts.at_step - 1 if rank == opts.kill_rank else opts.steps  # steps this worker completes
    out = run_worker(model, batches[:last], group=group, loss_fn=lambda model, x, y: lm_loss(model(x), y))
    return {"role": "worker", "died_at": opts.at_step if rank == opts.kill_rank else None, **out, "P": P}


def ps_failure_report(opts, results: Results) -> dict:
    P, K, cfg = opts.world_size, opts.steps, opts.gpt_config()
    N, server = P - 1, results[SERVER]
    updates, dead = server["updates"], server["dead"]
    batches = make_batches(cfg, opts.batch, K, opts.seed)  # host: the parent's reference
    model = build_model(cfg, opts.seed)  # host: the parent's reference
    replay = replay_on_one_device(
        model, make_optimizer(model.parameters(), opts.optimizer, opts.lr), batches, updates, N
    )
    expected = N * K - (K - (opts.at_step - 1))
    verdict = compare(
        f"async with a dead worker: server's parameters after {len(updates)} updates",
        server["params"],
        replay["params"],
        against="one-device replay of the same update order",
    )
    ok = verdict.passed and sorted(int(w) for w in dead) == [opts.kill_rank] and len(updates) == expected
    staleness = [u["staleness"] for u in updates]
    lines = [
        f"worker {opts.kill_rank} fell silent before its step {opts.at_step}; the server declared it dead "
        f"after {opts.heartbeat:g} s without a gradient and carried on with {N - 1} workers",
        f"updates applied: {len(updates)} = {N} x {K} - {K - opts.at_step + 1} never sent: "
        f"{'PASS' if len(updates) == expected else 'FAIL'}",
        f"largest staleness {max(staleness)}, mean {sum(staleness) / len(staleness):.2f}",
        verdict.line,
    ]
    worker_losses = {r_: results[r_]["losses"] for r_ in range(1, P)}
    return {
        "scheme": "ps",
        "mode": "async",
        "world_size": P,
        "passed": ok,
        "max_abs_err": verdict.max_abs_err,
        "tol": verdict.tol,
        "comm": results.trace.bytes_per_rank(),
        "verdicts": lines,
        "killed_rank": opts.kill_rank,
        "dead": {int(w): d for w, d in dead.items()},
        "time_to_detect": next(iter(dead.values()))["silent_for"] if dead else None,
        "updates": updates,
        "staleness": staleness,
        "worker_losses": worker_losses,
        "restarted_on": None,  # nothing restarts: the job never stopped
        "steps_lost": K - opts.at_step + 1,  # the dead worker's gradients that never came
    }


# ------------------------------------------------------------------ resharding, beside torch.distributed.checkpoint


def zero_save_rank(cfg, batches, root: str, *, stage: int = 3, lr: float = 1e-3, seed: int = 0) -> dict:
    """Rank code: ZeRO `stage` trains on `batches`, saves its sharded checkpoint under root/parlab, and returns
    the whole training state (gathered) and the bytes this rank wrote."""
    from parlab.core.models import lm_loss
    from parlab.schemes.data_parallel import shard_batch
    from parlab.schemes.zero.stages import ZeRO

    P, rank, dev = comm.group_size(), comm.group_rank(), comm.device()
    zero = ZeRO(build_model(cfg, seed, device=dev), stage, lr=lr)
    for k, (x, y) in enumerate(batches):
        x_r, y_r = (t.to(dev) for t in shard_batch(x, y, rank, P))  # the batches came from the parent (host)
        lm_loss(zero.model(x_r), y_r).backward()
        zero.step(k)
        zero.zero_grad()
    pieces = ckpt.zero_pieces(zero)
    ckpt.save(f"{root}/parlab", len(batches), pieces, layout=f"zero-{stage}", extra={"optimizer_step": zero.t})
    state = zero_state(zero)
    zero.remove()
    return {"state": state, "bytes": sum(p.data.numel() * p.data.element_size() for p in pieces)}


def zero_state(zero) -> dict[str, torch.Tensor]:
    """Rank code (collective): the whole training state of a ZeRO run, by checkpoint name: master weights, m, v."""
    from parlab.schemes.zero.stages import gather_master

    state = {f"model.{n}": t for n, t in zero.full_params().items()}
    for key, shard in zip(ckpt.ADAM_STATES, (zero.m, zero.v), strict=True):
        full = gather_master(shard, zero.units, zero.group)
        state.update({f"optim.{n}.{key}": t for n, t in full.items()})
    return state


def fsdp_model(cfg, seed: int = 0):
    """The GPT under FSDP2 (torch.distributed.fsdp.fully_shard, one unit per block and the root), and its Adam."""
    from torch.distributed.fsdp import fully_shard

    from parlab.twins.data import world_mesh

    model, mesh = build_model(cfg, seed, device=comm.device()), world_mesh()  # on parlab's device, not FSDP2's pick
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def dcp_save_rank(cfg, batches, root: str, *, lr: float = 1e-3, seed: int = 0) -> dict:
    """Rank code: the same training with FSDP2, saved with torch.distributed.checkpoint (dcp.save) under root/dcp."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from parlab.core.models import lm_loss
    from parlab.schemes.data_parallel import shard_batch

    P, rank, dev = comm.group_size(), comm.group_rank(), comm.device()
    model = fsdp_model(cfg, seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for x, y in batches:
        x_r, y_r = (t.to(dev) for t in shard_batch(x, y, rank, P))  # the batches came from the parent (host)
        opt.zero_grad()
        lm_loss(model(x_r), y_r).backward()
        opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{root}/dcp")
    return {}


def dcp_load_rank(cfg, root: str, *, lr: float = 1e-3, seed: int = 0) -> dict[str, torch.Tensor]:
    """Rank code: FSDP2 on THIS world size loads the dcp checkpoint (torch reshards it); returns the whole state
    (DTensor.full_tensor(), an all-gather) under parlab's checkpoint names."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = fsdp_model(cfg, seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model_sd, optim_sd = get_state_dict(model, opt)  # the shapes to load into (optimizer states created empty)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=f"{root}/dcp")
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    out = {f"model.{n}": full(p).detach().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for key in ckpt.ADAM_STATES:
            out[f"optim.{n}.{key}"] = full(opt.state[p][key]).detach().clone()
    return out


def zero_load_rank(cfg, root: str, *, stage: int = 3, lr: float = 1e-3, seed: int = 0) -> dict[str, torch.Tensor]:
    """Rank code: ZeRO `stage` on THIS world size loads parlab's checkpoint (resharding); returns the whole state."""
    from parlab.schemes.zero.stages import ZeRO

    zero = ZeRO(build_model(cfg, seed, device=comm.device()), stage, lr=lr)
    ckpt.load_zero(ckpt.Reader(ckpt.latest(f"{root}/parlab")), zero)
    state = zero_state(zero)
    zero.remove()
    return state


# -------------------------------------------------------------------------- under torchrun: an elastic restart


def elastic_main(argv: list[str] | None = None) -> None:
    """One rank of `torchrun --nnodes 1:2 --max-restarts 3 ... -m parlab.runs.checkpoint --root DIR ...`.

    Every start resumes from the newest complete checkpoint under --root (none at the first start). Rank
    --kill-rank dies in step --at-step once (the first time: it leaves died.json behind); torchrun's agent sees
    the worker fail, stops the others and starts them all again, which resume and finish. Rank 0 writes
    root/result.pt: the final parameters, the step it resumed from, and torchrun's restart count."""
    import argparse
    import os

    import torch.distributed as dist

    from parlab.core.models import GPTConfig
    from parlab.runtime.launcher import init_from_env

    parser = argparse.ArgumentParser(prog="parlab.runs.checkpoint")
    parser.add_argument("--root", required=True)
    parser.add_argument("--scheme", default="dp", choices=["dp", "zero"])
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--at-step", type=int, default=4)
    parser.add_argument("--checkpoint-every", type=int, default=2)
    args = parser.parse_args(argv)
    init_from_env()
    cfg = GPTConfig(vocab_size=32, seq_len=8, hidden=16, heads=2, layers=2, dtype="float64")
    batches = make_batches(cfg, args.batch, args.steps, 0, device=comm.device())
    once = not Path(args.root, DIED_FILE).exists()  # it fails once: not again after the restart
    plan = FaultPlan(args.root, args.checkpoint_every, args.kill_rank if once else None, args.at_step, resume=True)
    optimizer = "adam" if args.scheme == "zero" else "sgd"
    out = resumable_rank(args.scheme, cfg, batches, plan, optimizer=optimizer, lr=1e-3, stage=args.stage)
    if dist.get_rank() == 0:
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        torch.save({"params": out["params"], "start": out["start"], "restarts": restarts}, Path(args.root, "result.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    elastic_main()


def failure_run(kind: str) -> tuple:
    """(rank code, report) of `python -m parlab run KIND --kill-rank R`, in place of the scheme's own.

    dp, zero: the launch is the uninterrupted run; the report makes the failure and the restart on the survivors
    (two more launches) and compares. ps: the asynchronous server carries on without the silent worker."""
    if kind == "ps":
        return ps_failure_rank, ps_failure_report
    return functools.partial(uninterrupted_rank, kind), functools.partial(failure_report, kind)
