"""Sharded checkpoints: every rank saves only what it holds, and a small metadata file says who held what.

A checkpoint is a folder:

    step-000004/
        rank0.pt ... rank{P-1}.pt   each rank's pieces, {tensor name: the part of it this rank held}
        rank0.json ...              each rank's own index of those pieces
        metadata.json               written LAST, by rank 0, once every rank has saved: a folder without it is a
                                    checkpoint cut short by a failure, and is never loaded

metadata.json names every tensor of the training state ("model.blocks.0.attn.qkv.weight", and beside it
"optim.<same name>.exp_avg" / ".exp_avg_sq": Adam's m and v), its global shape and dtype, and its pieces:

    {"rank": 2, "flat": [130, 390]}                        ZeRO: elements [130, 390) of the flattened tensor
    {"rank": 1, "offsets": [32, 0], "lengths": [32, 16]}   TP: the box rows [32, 64) x columns [0, 16)

the two ways parlab cuts a tensor. The names are the same whatever the scheme, so a checkpoint saved by ZeRO-3 on
4 ranks loads into ZeRO-3 on 2 ranks, into plain DP on 1, or into TP: a loader asks the `Reader` for the part IT
needs (`flat(name, start, stop)` or `full(name)`), and the Reader opens only the rank files whose pieces overlap
that part (memory-mapped: only the bytes asked for are read). That is resharding.

What each scheme saves (its `*_pieces` function), per rank:
    DP        the one copy: data-parallel rank 0 saves everything, the others nothing (they hold the same)
    ZeRO 1-3  its flat shard [S] of the master weights, Adam m and v, cut back into per-tensor ranges; the compute
              copy (bf16 / the parameters) is not saved: it is the master weights rounded (rebuilt on load)
    TP        its slice of every split tensor (and of its m, v); tp rank 0 saves the replicated ones
    PP        the layers of its own stages, whole (a pipeline loads them into any other split: `load_named`)
The optimizer's step count t (Adam's bias correction needs it) and the training step go into "extra".
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from parlab.core import comm
from parlab.schemes.zero.stages import ZeRO

ADAM_STATES = ("exp_avg", "exp_avg_sq")  # torch.optim.Adam's names for m and v; ZeRO's m, v are saved as these


@dataclass
class Piece:
    """The part of one tensor a rank holds: `data` is either a box of the tensor (offsets, lengths per dim) or
    the elements [flat[0], flat[1]) of the flattened tensor."""

    name: str
    data: torch.Tensor
    shape: tuple[int, ...]  # the whole tensor's shape
    offsets: tuple[int, ...] | None = None
    flat: tuple[int, int] | None = None

    def index(self, rank: int) -> dict:
        where = (
            {"flat": list(self.flat)}
            if self.flat
            else {"offsets": list(self.offsets), "lengths": list(self.data.shape)}
        )
        return {"rank": rank, **where}


def whole(name: str, tensor: torch.Tensor) -> Piece:
    """A tensor held whole (DP, a replicated TP tensor): one box from the origin."""
    return Piece(name, tensor.detach(), tuple(tensor.shape), offsets=(0,) * tensor.dim())


# ------------------------------------------------------------------------------------------------------ saving


def step_folder(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def save(
    root: str | Path, step: int, pieces: list[Piece], *, layout: str, extra: dict | None = None, group=None
) -> Path:
    """Collective over `group` (default all ranks): every rank writes its pieces, then rank 0 the metadata.

    Returns the checkpoint folder. Every rank of the group must call it (a rank that holds nothing passes [])."""
    folder, rank = step_folder(root, step), comm.group_rank(group)
    folder.mkdir(parents=True, exist_ok=True)
    # Host copies (clone: only the piece): a checkpoint saved from GPUs loads on any machine, any device.
    torch.save({p.name: p.data.detach().to("cpu", copy=True) for p in pieces}, folder / f"rank{rank}.pt")
    index = {
        p.name: {"shape": list(p.shape), "dtype": str(p.data.dtype).removeprefix("torch."), "piece": p.index(rank)}
        for p in pieces
    }
    (folder / f"rank{rank}.json").write_text(json.dumps(index))
    comm.barrier(group=group, label="checkpoint: every rank saved")  # no metadata before every piece is on disk
    if rank == 0:
        tensors: dict[str, dict] = {}
        for r in range(comm.group_size(group)):
            for name, entry in json.loads((folder / f"rank{r}.json").read_text()).items():
                tensor = tensors.setdefault(name, {"shape": entry["shape"], "dtype": entry["dtype"], "pieces": []})
                tensor["pieces"].append(entry["piece"])
        meta = {
            "step": step,
            "world_size": comm.group_size(group),
            "layout": layout,
            "extra": extra or {},
            "tensors": tensors,
        }
        tmp = folder / "metadata.json.tmp"
        tmp.write_text(json.dumps(meta, indent=1))
        os.replace(tmp, folder / "metadata.json")  # atomic: the metadata is there whole, or not at all
    # No rank goes on before the checkpoint is complete: else a rank that dies in the next step can take the job
    # down while rank 0 is still writing the metadata, and the restart finds only the checkpoint before this one.
    comm.barrier(group=group, label="checkpoint: complete")
    return folder


def latest(root: str | Path) -> Path | None:
    """The newest COMPLETE checkpoint under root (one with its metadata.json), or None."""
    done = [f for f in Path(root).glob("step-*") if (f / "metadata.json").exists()]
    return max(done, key=lambda f: int(re.sub(r"\D", "", f.name)), default=None)


# ----------------------------------------------------------------------------------------------------- reading


class Reader:
    """Reads parts of the tensors of one checkpoint, opening only the rank files that hold them.

    bytes_read counts the bytes of the pieces actually copied out (what a loader needed)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.meta = json.loads((self.folder / "metadata.json").read_text())
        self.files: dict[int, dict[str, torch.Tensor]] = {}
        self.bytes_read = 0

    @property
    def step(self) -> int:
        return self.meta["step"]

    @property
    def extra(self) -> dict:
        return self.meta["extra"]

    def names(self) -> list[str]:
        return list(self.meta["tensors"])

    def _piece(self, rank: int, name: str) -> torch.Tensor:
        if rank not in self.files:  # mmap: opening a file reads nothing until a tensor's bytes are touched
            path = self.folder / f"rank{rank}.pt"  # read on the host; the loaders copy into their device's tensors
            self.files[rank] = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
        return self.files[rank][name]

    def _entry(self, name: str) -> dict:
        if name not in self.meta["tensors"]:
            raise KeyError(f"{name!r} is not in the checkpoint {self.folder} (it holds {len(self.names())} tensors)")
        return self.meta["tensors"][name]

    def flat(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of the flattened tensor `name` [stop - start]: the overlap of that range with
        every piece, copied in. A ZeRO loader asks for exactly its own shard's range."""
        entry = self._entry(name)
        out = torch.empty(stop - start, dtype=getattr(torch, entry["dtype"]))  # host: read from the files
        filled = 0
        for piece in entry["pieces"]:
            if "flat" not in piece:  # a box (TP): not a range of the flattened tensor; read the whole tensor
                return self.full(name).reshape(-1)[start:stop].clone()
            a, b = max(start, piece["flat"][0]), min(stop, piece["flat"][1])  # the overlap, in tensor elements
            if a < b:
                src = self._piece(piece["rank"], name)  # [piece length]
                out[a - start : b - start] = src[a - piece["flat"][0] : b - piece["flat"][0]]
                filled += b - a
        if filled != stop - start:
            raise ValueError(f"{name}: the checkpoint's pieces cover {filled} of elements [{start}, {stop})")
        self.bytes_read += out.numel() * out.element_size()
        return out

    def full(self, name: str) -> torch.Tensor:
        """The whole tensor `name`, assembled from every piece."""
        entry = self._entry(name)
        out = torch.empty(entry["shape"], dtype=getattr(torch, entry["dtype"]))  # host: read from the files
        if entry["pieces"] and "flat" in entry["pieces"][0]:
            return self.flat(name, 0, out.numel()).view(out.shape)
        for piece in entry["pieces"]:
            box = tuple(slice(o, o + n) for o, n in zip(piece["offsets"], piece["lengths"], strict=True))
            out[box] = self._piece(piece["rank"], name)
        self.bytes_read += out.numel() * out.element_size()
        return out

    def slice(self, name: str, dim: int | None, index: int, parts: int) -> torch.Tensor:
        """Part `index` of `parts` equal parts of tensor `name` along `dim` (TP's cut); dim None: the whole."""
        full = self.full(name)
        return full if dim is None else full.chunk(parts, dim)[index].clone()


# ------------------------------------------------------------------------------------------ DP: one copy is enough


def named_pieces(named: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer) -> list[Piece]:
    """Tensors held whole, by their names in the reference model, with Adam's m and v if it has them."""
    pieces = []
    for name, p in named.items():
        pieces.append(whole(f"model.{name}", p))
        for key in ADAM_STATES:
            if key in optimizer.state.get(p, {}):
                pieces.append(whole(f"optim.{name}.{key}", optimizer.state[p][key]))
    return pieces


def dp_pieces(model: nn.Module, optimizer: torch.optim.Optimizer, group=None) -> list[Piece]:
    """Data-parallel rank 0 of `group` holds what every replica holds: it alone saves it."""
    return named_pieces(dict(model.named_parameters()), optimizer) if comm.group_rank(group) == 0 else []


def pp_pieces(stages: dict, optimizer: torch.optim.Optimizer) -> list[Piece]:
    """A pipeline rank saves the layers of its stages (parlab.schemes.pipeline.executor.Stage.named: the reference
    model's names), whole: every rank a different part of the model, none of them all of it."""
    return named_pieces({n: p for stage in stages.values() for n, p in stage.named.items()}, optimizer)


def optimizer_step(optimizer: torch.optim.Optimizer) -> int:
    """Adam's t (how many updates it made): its bias correction depends on it. 0 for SGD."""
    steps = [int(s["step"]) for s in optimizer.state.values() if "step" in s]
    return max(steps, default=0)


def load_dp(reader: Reader, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank reads the whole model (and Adam's m, v if saved): any checkpoint layout, any world size."""
    load_named(reader, dict(model.named_parameters()), optimizer)


def load_named(reader: Reader, named: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
    """The tensors `named` (reference-model names: a whole model, or a pipeline rank's stages) read whole."""
    with torch.no_grad():
        for name, p in named.items():
            p.copy_(reader.full(f"model.{name}"))
            _set_adam_state(reader, optimizer, p, name, lambda key: reader.full(key))


def _set_adam_state(reader: Reader, optimizer, p, name: str, read) -> None:
    """Adam's state of parameter p from the checkpoint (read(key) -> this rank's part), if it saved one."""
    if f"optim.{name}.exp_avg" not in reader.meta["tensors"]:
        return
    t = reader.extra["optimizer_step"]
    state = {key: read(f"optim.{name}.{key}").to(p.device, p.dtype).view_as(p).clone() for key in ADAM_STATES}
    step = torch.tensor(float(t), dtype=_adam_step_dtype())  # host: where torch.optim.Adam keeps its step count
    optimizer.state[p] = {"step": step, **state}


def _adam_step_dtype() -> torch.dtype:
    """The dtype torch.optim.Adam keeps its step count in (float32, or float64 under a float64 default dtype)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


# ------------------------------------------------------------------------ ZeRO: each rank its flat shard's ranges


def shard_ranges(zero_units, rank: int):
    """For rank `rank`'s flat shard: (unit, parameter name, param, [a, b) in the parameter's flattened elements,
    where that range starts in the rank's flat shard [S]). A shard can span several parameters, and a parameter
    several shards; the padding at a unit's end belongs to no parameter."""
    for u in zero_units:
        lo, hi = rank * u.shard_numel, (rank + 1) * u.shard_numel  # the unit's flat elements rank r owns
        start = 0  # where parameter p starts in the unit's flat buffer
        for name, p in zip(u.names, u.params, strict=True):
            a, b = max(lo, start), min(hi, start + p.numel())
            if a < b:
                yield u, name, p, (a - start, b - start), u.offset + a - lo
            start += p.numel()


def zero_pieces(zero: ZeRO) -> list[Piece]:
    """Rank r's master weights, m and v [S each], cut into ranges of the tensors they belong to."""
    pieces = []
    for _, name, p, (a, b), at in shard_ranges(zero.units, zero.rank):
        n = b - a
        pieces.append(Piece(f"model.{name}", zero.master[at : at + n], tuple(p.shape), flat=(a, b)))
        for key, state in zip(ADAM_STATES, (zero.m, zero.v), strict=True):
            pieces.append(Piece(f"optim.{name}.{key}", state[at : at + n], tuple(p.shape), flat=(a, b)))
    return pieces


def load_zero(reader: Reader, zero: ZeRO) -> None:
    """Fill this rank's shard [S] of the master weights, m and v from any checkpoint (any world size: only the
    ranges of rank r's shard are read), then rebuild the compute copy: stage 3 keeps only its shard, stages 1-2
    all-gather the full parameters (the same all-gather as at the end of a step)."""
    for state in (zero.master, zero.m, zero.v):
        state.zero_()  # the padding stays 0
    for _, name, _, (a, b), at in shard_ranges(zero.units, zero.rank):
        zero.master[at : at + b - a] = reader.flat(f"model.{name}", a, b)
        if f"optim.{name}.exp_avg" in reader.meta["tensors"]:
            zero.m[at : at + b - a] = reader.flat(f"optim.{name}.exp_avg", a, b)
            zero.v[at : at + b - a] = reader.flat(f"optim.{name}.exp_avg_sq", a, b)
    zero.t = reader.extra["optimizer_step"]
    new = zero.master.to(zero.compute_dtype)  # [S] this rank's compute copy
    if zero.stage == 3:
        zero.param_shard.copy_(new)
        return
    for u in zero.units:
        mine = u.shard_of(u.flat, zero.rank)
        mine.copy_(new[u.offset : u.offset + u.shard_numel])
        comm.all_gather_into_tensor(u.flat, mine, group=zero.group, label=f"load: params {u.name}")


# --------------------------------------------------------------------------------------------- TP: its slices


def tp_pieces(model: nn.Module, optimizer: torch.optim.Optimizer, tp_rank: int, holder: bool = True) -> list[Piece]:
    """This TP rank's slices (p.tp_split_dim: the dim split over the tp group, None: replicated, and saved by tp
    rank 0 only). holder=False on data-parallel replicas other than the first: they hold the same slices."""
    if not holder:
        return []
    pieces = []
    for name, p in model.named_parameters():
        dim = p.tp_split_dim
        if dim is None and tp_rank != 0:
            continue
        shape = list(p.shape)
        offsets = [0] * p.dim()
        if dim is not None:
            offsets[dim] = tp_rank * p.shape[dim]  # rank r holds [r*n/T, (r+1)*n/T) along dim
            shape[dim] = p.shape[dim] * model.world_size
        state = optimizer.state.get(p, {})
        for key, tensor in [("model", p)] + [(k, state[k]) for k in ADAM_STATES if k in state]:
            full_name = f"model.{name}" if key == "model" else f"optim.{name}.{key}"
            pieces.append(Piece(full_name, tensor.detach(), tuple(shape), offsets=tuple(offsets)))
    return pieces


def load_tp(reader: Reader, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """This TP rank's slices, cut from the whole tensors whatever layout saved them (ZeRO's flat ranges, another
    TP degree's boxes, or DP's single copy)."""
    T, r = model.world_size, model.rank
    with torch.no_grad():
        for name, p in model.named_parameters():
            dim = p.tp_split_dim
            p.copy_(reader.slice(f"model.{name}", dim, r, T))
            _set_adam_state(reader, optimizer, p, name, lambda key, dim=dim: reader.slice(key, dim, r, T))


# ------------------------------------------------------------------------------------------------ the theory


def checkpoint_bytes(psi: int, world_size: int, layout: str, state_bytes: int = 12) -> float:
    """Bytes a rank writes per checkpoint: the training state (state_bytes per parameter: fp32 master, m, v = 12
    under mixed-precision Adam) divided among the ranks that hold distinct parts. DP: rank 0 writes all of it;
    ZeRO and TP: 1/N each."""
    return psi * state_bytes / (1 if layout == "dp" else world_size)
