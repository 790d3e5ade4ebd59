"""The twin of pipeline parallelism: torch.distributed.pipelining running parlab's very stages.

parlab writes the schedule as data (parlab/schemes/pipeline/schedules.py) and runs it with its own executor
(parlab/schemes/pipeline/executor.py: receive, compute, send, per action). PyTorch's pipelining has the same two halves:
a `PipelineStage` wraps a module that holds one stage, and a `Schedule*` object runs the micro-batches through the
stages in its order:

    stage = PipelineStage(parlab_stage, stage_index=s, num_stages=p * v, device=parlab.device())
    schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=lm_loss)      # the loss on the last stage
    schedule.step(x)                         # rank holding stage 0: the batch, cut into m micro-batches
    schedule.step(target=y, losses=losses)   # rank holding the last stage: the targets; gets the m losses
    schedule.step()                          # the ranks in between

torch sums the micro-batches' gradients and divides by m (scale_grads), as parlab does: the same step as one
device on the whole batch. The twin is given the same stage modules parlab builds (`build_stages`), so names,
weights and the stage of each block match; losses, step 1's gradients and the final parameters are compared.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parlab.core import comm
from parlab.core.check import Verdict, compare, host_values
from parlab.core.models import build_model, lm_loss, make_batches, make_optimizer
from parlab.twins.twin import Twin

# parlab's schedule name -> torch.distributed.pipelining's class name
TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


def pp_name(opts) -> str:
    return f"torch pipelining {TORCH_SCHEDULES.get(opts.schedule, '(no class for ' + opts.schedule + ')')}"


def pp_skip(opts) -> str:
    if opts.schedule not in TORCH_SCHEDULES:
        return (
            f"schedule {opts.schedule!r} (ZB-H1, one stage per rank) has no torch class: torch's zero-bubble "
            "schedules (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble) need two or more stages per rank"
        )
    return ""


def pp_rank(opts, value) -> dict:
    """Train parlab's stages with torch's schedule of the same name, on the same batches."""
    import torch.distributed.pipelining as pipelining
    from torch.distributed.pipelining import PipelineStage

    from parlab.schemes.pipeline.executor import build_stages

    cfg, schedule, rank, dev = opts.gpt_config(), opts.make_schedule(), dist.get_rank(), comm.device()
    stages = build_stages(build_model(cfg, opts.seed, device=dev), schedule, rank, opts.split or None)
    n = schedule.num_stages
    wrapped = [PipelineStage(stages[k], schedule.stage(rank, k), n, dev) for k in sorted(stages)]
    cls = getattr(pipelining, TORCH_SCHEDULES[opts.schedule])
    one = cls in (pipelining.ScheduleGPipe, pipelining.Schedule1F1B)  # one stage per rank; the others take a list
    runner = cls(wrapped[0] if one else wrapped, n_microbatches=opts.microbatches, loss_fn=lm_loss)
    named = {name: w for stage in stages.values() for name, w in stage.named.items()}
    optimizer = make_optimizer(list(named.values()), opts.optimizer, opts.lr)
    holds = {stage.index for stage in stages.values()}
    losses, grads = [], {}
    for step, (x, y) in enumerate(make_batches(cfg, opts.batch, opts.steps, opts.seed, device=dev)):
        optimizer.zero_grad()
        mb_losses: list[torch.Tensor] = []
        args = (x,) if 0 in holds else ()
        kwargs = {"target": y, "losses": mb_losses} if n - 1 in holds else {}
        runner.step(*args, **kwargs)
        if step == 0:
            grads = {name: w.grad.detach().clone() for name, w in named.items()}
        optimizer.step()
        if mb_losses:  # the step's loss: the mean of the m micro-batches' mean losses
            losses.append(torch.stack(mb_losses).mean().item())
    return {
        "losses": losses or None,
        "grads": grads,
        "params": {name: w.detach().clone() for name, w in named.items()},
    }


def pp_compare(opts, results, outs) -> list[Verdict]:
    """Losses (on the rank with the last stage), step 1's gradients and the final parameters, every stage."""
    schedule, dtype, K = opts.make_schedule(), opts.gpt_config().torch_dtype, opts.steps
    last = schedule.rank_of(schedule.num_stages - 1)
    what = pp_name(opts)

    def merged(rows, key):
        return {name: t for row in rows for name, t in row[key].items()}

    return [
        compare(
            f"parlab's loss of each of {K} steps",
            host_values(results[last]["losses"], dtype),
            host_values(outs[last]["losses"], dtype),
            against=what,
        ),
        compare(
            "parlab's gradients of step 1, every stage",
            merged(results, "grads"),
            merged(outs, "grads"),
            against=what,
        ),
        compare(
            f"parlab's parameters after {K} steps",
            merged(results, "params"),
            merged(outs, "params"),
            against=what,
        ),
    ]


TWINS = {"pp": Twin(pp_name, pp_rank, pp_compare, pp_skip)}
