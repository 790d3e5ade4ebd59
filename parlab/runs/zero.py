"""Run and check ZeRO (parlab/schemes/zero/stages.py): `python -m parlab run zero --stage {1,2,3} [--mixed-precision]
--world N`.

The ranks train with our ZeRO (traced), then with PyTorch's own sharded training on the same data (untraced):
torch.distributed.optim.ZeroRedundancyOptimizer for stage 1, FSDP2 (torch.distributed.fsdp.fully_shard) with
reshard_after_forward=False for stage 2 and True for stage 3. The parent trains one device on the whole batch
(the same mixed-precision recipe under --mixed-precision) and compares; it also sets the bytes each rank held
beside the paper's formulas, and the bytes it communicated beside one DP all-reduce.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from parlab.core.check import check_equal, compare
from parlab.core.comm import device
from parlab.core.models import GPT, build_model, lm_loss, make_batches
from parlab.runs.options import FaultOptions, ModelOptions, option
from parlab.runs.registry import Scheme, launch_scheme
from parlab.runs.report import compare_losses, mean_losses, model_fields, run_report, single_device_run
from parlab.runtime.errors import Results
from parlab.schemes.zero.stages import STAGES, check_reducible, train_zero
from parlab.schemes.zero.theory import zero_comm_theory, zero_memory
from parlab.twins.data import mixed_precision_verdicts, reference_note, train_torch_reference

COMPONENTS = ("params", "grads", "optimizer")


def param_count(cfg) -> int:
    """Psi of the reference GPT for `cfg`, without allocating it (built on the meta device)."""
    with torch.device("meta"):
        model = GPT(cfg)
    return sum(p.numel() for p in model.parameters())


@dataclass
class ZeROOptions(FaultOptions, ModelOptions):
    stage: int = option(1, "ZeRO stage: 1 (optimizer states), 2 (+ gradients), 3 (+ parameters)")
    mixed_precision: bool = option(False, "compute copy in --compute-dtype, fp32 master weights and Adam states")
    compute_dtype: str = option(
        "bfloat16", "the compute copy under --mixed-precision: bfloat16, or float16", choices=["bfloat16", "float16"]
    )
    loss_scale: float = option(
        1024.0, "float16 only: the initial loss scale (halved on overflow)", bounds="(0, 16777216]"
    )
    prefetch: bool = option(False, "stage 3: all-gather the next layer's parameters one layer early")
    reference: bool = option(True, "also train with PyTorch's own (ZeroRedundancyOptimizer / FSDP2) and compare")
    optimizer: str = option("adam", "ZeRO shards Adam's states: adam only", choices=["adam"])
    lr: float = option(1e-3, "learning rate", bounds="(0, 100]")

    def validate(self) -> None:
        super().validate()
        if self.stage not in STAGES:
            raise ValueError(f"stage={self.stage!r} must be one of {STAGES}")
        if self.compute_dtype not in ("bfloat16", "float16"):
            raise ValueError(
                f"compute_dtype={self.compute_dtype!r} must be bfloat16 or float16 (a 16-bit compute copy)"
            )
        if self.optimizer != "adam":
            raise ValueError(f"optimizer={self.optimizer!r}: ZeRO here shards Adam's states; use adam")
        if self.batch % self.world_size:
            raise ValueError(f"global batch={self.batch} is not divisible by world_size={self.world_size}")
        psi = param_count(self.gpt_config())
        if self.world_size > psi:
            raise ValueError(f"world_size={self.world_size} is more than the {psi} parameters to shard")
        check_reducible(self.grad_dtype())  # the gradients are reduce-scattered in this dtype
        if self.stage == 3 and self.tied:
            raise ValueError(
                "stage 3 gathers one layer at a time; a weight shared by two layers (--tied) is not supported"
            )
        if self.kill_rank is not None and self.mixed_precision:
            raise ValueError("--kill-rank runs ZeRO in one dtype: leave out --mixed-precision")
        if self.mixed_precision and self.compute_dtype == "float16" and self.loss_scale <= 0:
            raise ValueError(f"loss_scale={self.loss_scale} must be > 0")
        if not self.mixed_precision:
            self.no_effect(("compute_dtype", "loss_scale"), "without mixed_precision (one dtype throughout)")
        elif self.compute_dtype != "float16":
            self.no_effect(("loss_scale",), f"with compute_dtype {self.compute_dtype!r}: only float16 scales the loss")
        if self.stage != 3 and self.prefetch:
            raise ValueError(f"prefetch: no effect at stage {self.stage} (stage 3 gathers each layer's parameters)")

    def grad_dtype(self) -> torch.dtype:
        """The dtype of the compute copy and of the gradients."""
        if not self.mixed_precision:
            return self.gpt_config().torch_dtype
        dtype = getattr(torch, self.compute_dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"compute_dtype={self.compute_dtype!r} is not a torch dtype")
        return dtype

    def gpt_config(self):
        cfg = super().gpt_config()  # mixed precision: the master weights (the model's dtype) are fp32
        return dataclasses.replace(cfg, dtype="float32") if self.mixed_precision else cfg

    def zero_kwargs(self) -> dict:
        fp16 = self.mixed_precision and self.grad_dtype() == torch.float16
        return {
            "stage": self.stage,
            "lr": self.lr,
            "compute_dtype": self.grad_dtype() if self.mixed_precision else None,
            "loss_scale": self.loss_scale if fp16 else None,
            "prefetch": self.prefetch,
        }


# ------------------------------------------------------------------------------------------- the references


def mixed_precision_single_device(model, batches, *, lr, compute_dtype, loss_scale=None, loss_fn=None) -> dict:
    """The same mixed-precision recipe on one device: master weights in the model's dtype, a compute copy in
    `compute_dtype`, Adam (torch.optim.Adam) on the master weights. The reference for mixed-precision ZeRO."""
    loss_fn = loss_fn or (lambda model, x, y: lm_loss(model(x), y))
    master = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.Adam(master, lr=lr)
    model.to(compute_dtype)
    losses = []
    for x, y in batches:
        loss = loss_fn(model, x, y)
        model.zero_grad(set_to_none=True)
        (loss * (loss_scale or 1)).backward()
        for w, p in zip(master, model.parameters(), strict=True):
            w.grad = p.grad.to(w.dtype) / (loss_scale or 1)
        opt.step()
        with torch.no_grad():
            for w, p in zip(master, model.parameters(), strict=True):
                p.copy_(w)
        losses.append(loss.item())
    return {"losses": losses, "params": {n: w for (n, _), w in zip(model.named_parameters(), master, strict=True)}}


def reference_name(opts: ZeROOptions) -> str | None:
    """The PyTorch implementation this run is compared with (None: none applies, see `reference_note`)."""
    if not opts.reference or reference_note(opts):
        return None
    return "torch ZeroRedundancyOptimizer" if opts.stage == 1 else "torch FSDP2 fully_shard"


def zero_rank(opts: ZeROOptions) -> dict:
    """Rank code: our ZeRO (traced), then PyTorch's (untraced) on the same data unless opts.reference is False."""
    cfg, dev = opts.gpt_config(), device()  # dev: this rank's GPU under NCCL, else the CPU
    batches = make_batches(cfg, opts.batch, opts.steps, opts.seed, device=dev)  # global [B, T], the same everywhere
    out = train_zero(build_model(cfg, opts.seed, device=dev), batches, **opts.zero_kwargs())
    if reference_name(opts):
        out["reference"] = train_torch_reference(opts, batches)
    return out


def bytes_formula(opts: ZeROOptions, psi: int) -> dict[str, float]:
    """The paper's per-rank bytes for this run: params, grads, optimizer states (K = 3 x the master's bytes:
    master weights, m, v; 12 under mixed precision) and their total."""
    elem = opts.grad_dtype().itemsize
    K = 3 * opts.gpt_config().dtype_bytes
    return zero_memory(psi, opts.world_size, K=K, param_bytes=elem, grad_bytes=elem)[opts.stage]


def zero_report(opts: ZeROOptions, results: Results) -> dict:
    """The single-device reference on the same global batches, the comparisons, the bytes held and moved."""
    single_losses, single_params = _single_device(opts)
    loss_parallel = mean_losses(results, opts.steps)
    verdicts, loss_ref, note = _numerics(opts, results, loss_parallel, single_losses, single_params)
    memory_ok, memory_lines, memory = _memory(opts, results)
    comm_ok, comm_line, comm = _wire(opts, results)
    peak = {k: max(r["peak"][k] for r in results) for k in results[0]["peak"]}
    report = run_report(
        "zero",
        opts.world_size,
        verdicts,
        passed=all(memory_ok) and comm_ok,
        comm={**results.trace.bytes_per_rank(), **comm},
        lines=[v.line for v in verdicts] + note + memory_lines + [comm_line],
        stage=opts.stage,
        mixed_precision=opts.mixed_precision,
        compute_dtype=str(opts.grad_dtype()).removeprefix("torch."),
        **memory,
        peak_bytes=peak,
        **model_fields(opts.gpt_config(), opts, "steps", "batch"),
        loss_single=single_losses,
        loss_parallel=loss_parallel,
        loss_reference=loss_ref,
        reference=reference_name(opts),
        reference_note=reference_note(opts) if opts.reference else "",
        skipped_steps=results[0]["skipped_steps"],
        units=results[0]["units"],
    )
    if opts.stage == 3:
        report["gathered_params_peak"] = peak["gathered params"]
    return report


def _single_device(opts: ZeROOptions) -> tuple[list[float], dict]:
    """(losses, final parameters) of one device on the whole batch: torch's Adam, or under --mixed-precision the
    same recipe as the ranks (a compute copy, fp32 master weights), so that only the sharding is compared."""
    if not opts.mixed_precision:
        single = single_device_run(opts, optimizer="adam")
        return single.losses, single.params
    cfg, zkw = opts.gpt_config(), opts.zero_kwargs()
    single = mixed_precision_single_device(
        build_model(cfg, opts.seed),  # host: the parent's reference
        make_batches(cfg, opts.batch, opts.steps, opts.seed),  # host: the parent's reference
        lr=opts.lr,
        compute_dtype=zkw["compute_dtype"],
        loss_scale=zkw["loss_scale"],
    )
    return single["losses"], single["params"]


def _numerics(opts: ZeROOptions, results: Results, loss_parallel, single_losses, single_params) -> tuple:
    """Ours against one device, then against PyTorch's own sharded training where one applies.
    Returns (verdicts, PyTorch's loss of each step or None, the line that says why it was not compared)."""
    P, ref = opts.world_size, reference_name(opts)
    params = [r["params"] for r in results]
    verdicts = _numeric_verdicts(opts, loss_parallel, single_losses, params, [single_params] * P, "single device")
    loss_ref = None
    if ref:
        refs = [r["reference"] for r in results]
        loss_ref = mean_losses(refs, opts.steps)
        verdicts += _numeric_verdicts(opts, loss_parallel, loss_ref, params, [d["params"] for d in refs], ref)
    note = [f"not compared with PyTorch's own: {reference_note(opts)}"] if opts.reference and not ref else []
    return verdicts, loss_ref, note


def _memory(opts: ZeROOptions, results: Results) -> tuple[list[bool], list[str], dict]:
    """What each rank held just before its optimizer step, beside the paper's formula (padding itemised): every
    rank holds exactly formula(Psi + padding), and that is within 1% of formula(Psi).
    Returns (one pass per component, their lines, the memory report fields)."""
    psi = sum(p.numel() for p in results[0]["params"].values())
    pad = results[0]["padding"]
    formula = bytes_formula(opts, psi)
    formula_padded = bytes_formula(opts, psi + pad)  # the flat buffers hold Psi + padding numbers
    measured = {c: [r["steady"][c] for r in results] for c in COMPONENTS}
    memory_ok, memory_lines = [], []
    for c in COMPONENTS:
        exact = all(check_equal(c, m, formula_padded[c]).passed for m in measured[c])
        off = max(abs(m - formula[c]) for m in measured[c]) / formula[c]
        memory_ok.append(exact and off <= 0.01)
        memory_lines.append(
            f"{c} per rank: measured {measured[c][0]:,} bytes = formula {formula[c]:,.0f} + padding "
            f"{formula_padded[c] - formula[c]:,.0f} ({100 * off:.2f}% off, within 1%): "
            f"{'PASS' if memory_ok[-1] else 'FAIL'}"
        )
    fields = {
        "param_count": psi,
        "padding": pad,
        "bytes_per_rank": measured,
        "bytes_formula": {c: formula[c] for c in COMPONENTS},
        "bytes_formula_padded": {c: formula_padded[c] for c in COMPONENTS},
    }
    return memory_ok, memory_lines, fields


def _wire(opts: ZeROOptions, results: Results) -> tuple[bool, str, dict]:
    """Communication per step: the payloads parlab.core.comm counted (the final check gather left out), turned
    into ring wire bytes, as a multiple of one DP all-reduce, against the stage's theory (1x, 1x, 1.5x).
    Returns (pass, the line, the comm figures)."""
    P, K = opts.world_size, opts.steps
    psi = sum(p.numel() for p in results[0]["params"].values())
    events = [e for e in results.trace.events if not e.is_compute and not e.label.startswith("check")]
    payload = {kind: [0] * P for kind in ("reduce_scatter", "all_gather")}
    for e in events:
        if e.kind in payload:
            payload[e.kind][e.rank] += e.bytes / K
    wire = [payload["reduce_scatter"][r] * (P - 1) / P + payload["all_gather"][r] * (P - 1) for r in range(P)]
    theory = zero_comm_theory(psi, P, opts.grad_dtype().itemsize, opts.stage)
    if P == 1:  # one rank (one GPU): nothing crosses a wire, in ZeRO as in DP, so there is no ratio to check
        ratio, comm_ok = None, wire[0] == 0
        comm_line = f"wire bytes per step (ring): measured {wire[0]:,.0f} = theory 0 on one rank: "
        comm_line += "PASS" if comm_ok else "FAIL"
        return comm_ok, comm_line, {**_wire_fields(payload, wire), **theory, "measured_ratio": ratio}
    ratio = wire[0] / theory["dp_all_reduce_wire_bytes"]
    comm_ok = abs(ratio - theory["theory_ratio"]) <= 0.01 * theory["theory_ratio"]
    comm_line = (
        f"wire bytes per step (ring): measured {wire[0]:,.0f} = {ratio:.3f} x one DP all-reduce "
        f"({theory['dp_all_reduce_wire_bytes']:,.0f}); theory {theory['theory_ratio']:.1f}x: "
        f"{'PASS' if comm_ok else 'FAIL'}"
    )
    return comm_ok, comm_line, {**_wire_fields(payload, wire), **theory, "measured_ratio": ratio}


def _wire_fields(payload: dict, wire: list) -> dict:
    return {
        "reduce_scatter_per_step": payload["reduce_scatter"],
        "all_gather_per_step": payload["all_gather"],
        "wire_bytes_per_step": wire,
    }


def _numeric_verdicts(opts, loss_ours, loss_ref, params_ours, params_ref, against: str) -> list:
    """Loss of each step and parameters after K steps, ours against a reference (one device, or PyTorch's)."""
    K, f64 = opts.steps, torch.float64  # the losses as float64 tensors, held to the tolerances given here
    if not opts.mixed_precision:
        return [
            compare_losses(
                f"loss of each of {K} steps",
                loss_ours,
                loss_ref,
                f64,
                against=against,
                tol=1e-10 if opts.dtype == "float64" else 1e-5,
            ),
            compare(f"parameters after {K} steps, every rank", params_ours, params_ref, against=against),
        ]
    return mixed_precision_verdicts(opts, loss_ours, loss_ref, params_ours, params_ref, against)


def run_zero(world_size: int = 4, **options) -> tuple[Results, dict]:
    """Run ZeRO on live ranks; returns (results, report), the report being what `python -m parlab run zero` prints.

    options: any ZeROOptions field (stage, mixed_precision, compute_dtype, prefetch, reference, steps, batch, ...)."""
    return launch_scheme("zero", world_size=world_size, **options)


SCHEMES = [
    Scheme(
        "zero",
        "ZeRO stages 1-3 (+ mixed precision): memory per rank vs the paper; vs one device and torch's own",
        ZeROOptions,
        zero_rank,
        zero_report,
        failure="zero",
        quick=(("steps", 1), ("layers", 1)),
    )
]
