"""Typed options of a run: one small dataclass per scheme, defaults and validation in one place.

    @dataclass
    class DPOptions(RunOptions):
        batch: int = option(8, "global batch (rows over all ranks)")
        ...
        def validate(self) -> None:
            super().validate()
            if self.batch % self.world_size: raise ValueError(...)

The same class gives the CLI its flags (`add_arguments`), the notebooks their keyword arguments
(`DPOptions(world_size=2, batch=16)`), and the rank code a typed object (no `opts.get("batch", 8)`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from dataclasses import dataclass, field, fields
from typing import Any

from parlab.core.models import DTYPES, RECOMPUTE, GPTConfig
from parlab.core.pace import Pace
from parlab.core.pace import parse as parse_pace

# The most ranks one `run` starts: each rank is a process that imports its scheme and joins the group; far beyond a
# few dozen per core they do not all start before the launch's timeout (999 ranks on 2 cores: 3 minutes, then a
# timeout on every rank).
RANKS_PER_CORE, MIN_MAX_WORLD = 32, 256


def max_world() -> int:
    import os

    return max(MIN_MAX_WORLD, RANKS_PER_CORE * (os.cpu_count() or 1))


def option(
    default: Any, help: str, *, flag: str | None = None, choices=None, parse=None, const=None, bounds: str = ""
) -> Any:
    """A dataclass field that is also a command-line option.

    flag: the option's name on the command line (default: --name-with-dashes). parse: a function from the
    command-line string to the value (its ValueError becomes a clear CLI error). A bool option with default
    False is a --flag; with default True it is a --no-flag. const: the value of the flag given alone (--pace).
    bounds: the interval a number must lie in, as written in mathematics: "(0, 10]", "[1, 1000]". Every float
    option must be finite (nan and inf are refused) whether or not it has bounds.
    """
    if bounds:
        parse_bounds(bounds)  # a typo in the interval is the programmer's error, found at import
    meta = {"help": help, "flag": flag, "choices": choices, "parse": parse, "const": const, "bounds": bounds}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def int_list(text: str) -> list[int]:
    """'3,2,2,1' -> [3, 2, 2, 1] (for options such as a pipeline split)."""
    try:
        return [int(n) for n in text.split(",")]
    except ValueError:
        raise ValueError(f"{text!r} is not a comma-separated list of integers (e.g. 3,2,2,1)") from None


def parse_bounds(bounds: str) -> tuple[float, float, bool, bool]:
    """ "(0, 10]" -> (0.0, 10.0, low open, high closed)."""
    match = re.fullmatch(r"\s*([\[(])\s*([^,]+),\s*([^\])]+)\s*([\])])\s*", bounds)
    if not match:
        raise ValueError(f"bounds {bounds!r}: write an interval such as '(0, 10]'")
    return float(match[2]), float(match[3]), match[1] == "(", match[4] == ")"


def check_number(name: str, value: float, bounds: str = "") -> None:
    """A number option: finite, and inside `bounds` when given."""
    if not math.isfinite(value):
        raise ValueError(f"{name}={value} must be a finite number")
    if bounds:
        low, high, low_open, high_open = parse_bounds(bounds)
        inside = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
        if not inside:
            raise ValueError(f"{name}={value:g} must be in {bounds.strip()}")


def positive(name: str, value: int | float) -> None:
    if value < 1:
        raise ValueError(f"{name}={value} must be >= 1")


def default_of(cls: type, name: str) -> Any:
    """The default value of the option (dataclass field) `name` of `cls`."""
    f = next(f for f in fields(cls) if f.name == name)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


@dataclass
class RunOptions:
    """What every run takes. A scheme's options class adds its own fields and extends `validate`."""

    world_size: int = option(4, "number of ranks", flag="--world")
    dtype: str = option("float64", "float64 (exactness is the lesson) or float32", choices=sorted(DTYPES))
    steps: int = option(3, "training steps")
    seed: int = option(0, "seed of the model's weights and of the data")
    pace: str = option(
        "",
        "emulate a device and a link (parlab.core.pace): alone, the default model; or e.g. "
        "unit=20ms,alpha=1ms,bandwidth=50MB/s (unit: one forward pass); or a GPU: h100, a100 (parlab.core.hardware; "
        "h100,unit=200ms: the same proportions, slower)",
        const="default",
    )

    def validate(self) -> None:
        """Raise a clear ValueError for options that cannot work: called before any process starts."""
        for f in fields(self):  # every number in range, in one place: nan and inf never reach a rank
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                check_number(f.name, value, f.metadata.get("bounds", ""))
        positive("world_size", self.world_size)
        if self.world_size > max_world():
            raise ValueError(
                f"world_size={self.world_size}: more ranks than this machine starts before a launch times out (at "
                f"most {max_world()} here: {RANKS_PER_CORE} per core, {MIN_MAX_WORLD} at least); across machines, "
                "run the rank code under torchrun (README)"
            )
        positive("steps", self.steps)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {sorted(DTYPES)}")

    def check(self) -> RunOptions:
        """Every option checked, before any process starts: `validate` (this class's chain of checks), then the
        pace, last: a hardware profile's pace is computed from the model (its FLOPs), which only the other options,
        once checked, can describe (a zero or negative size would otherwise surface as the pace's error, or as a
        division by zero in its arithmetic). Returns the options."""
        self.validate()
        self.pace_model()
        return self

    def no_effect(self, names: tuple[str, ...], why: str) -> None:
        """Refuse the options of `names` that were set away from their defaults although they would change
        nothing (`why`: what they need): an option silently ignored misleads more than one refused."""
        given = [
            f"{name}={getattr(self, name)!r}" for name in names if getattr(self, name) != default_of(type(self), name)
        ]
        if given:
            raise ValueError(f"{', '.join(given)}: no effect {why}")

    def pace_model(self) -> Pace | None:
        """The emulated device and link of this run (None: not paced)."""
        from parlab.core.hardware import PROFILES

        profile = self.pace.partition(",")[0].strip()  # "h100" of "h100,unit=200ms"
        flops = self.forward_flops() if profile in PROFILES else None  # only a GPU profile needs them
        return parse_pace(self.pace, flops, self.world_size)

    def forward_flops(self) -> float | None:
        """FLOPs of one paced forward span of a rank (sets F under `--pace h100`); None: the run trains no model."""
        return None

    @classmethod
    def make(cls, **values) -> RunOptions:
        """The options with `values` over the defaults; unknown names are a ValueError naming the known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown option(s) {unknown} for {cls.__name__}; known: {sorted(known)}")
        return cls(**values)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, skip=()) -> None:
        """One command-line option per field (but those in `skip`), with the field's default and help."""
        for f in fields(cls):
            if f.name in skip:
                continue
            meta = f.metadata
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            if isinstance(default, dict):  # structured options (e.g. a cost table) are for Python callers only
                continue
            flag = meta.get("flag") or "--" + f.name.replace("_", "-")
            if isinstance(default, bool):
                if default:
                    flag = meta.get("flag") or "--no-" + f.name.replace("_", "-")
                parser.add_argument(
                    flag, dest=f.name, action="store_false" if default else "store_true", help=meta.get("help")
                )
                continue
            parse = meta.get("parse") or _value_type(f.type, default)
            extra = {"nargs": "?", "const": meta["const"]} if meta.get("const") is not None else {}
            parser.add_argument(
                flag,
                dest=f.name,
                type=_argparse_type(parse),
                default=default,
                choices=meta.get("choices"),
                help=meta.get("help"),
                **extra,
            )


def _value_type(annotation: Any, default: Any):
    """int, float or str: the default's type, or for a None default the annotation's ("int | None" -> int)."""
    if default is not None:
        return type(default)
    text = str(annotation)
    return int if "int" in text else float if "float" in text else str


def _argparse_type(parse):
    """Wrap a parse function so that argparse reports its ValueError text (not 'invalid <lambda> value')."""

    def convert(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(
                str(exc) if parse not in (int, float) else f"{text!r} is not a valid {parse.__name__}"
            ) from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


@dataclass
class ModelOptions(RunOptions):
    """Runs that train the reference GPT: its size, and the optimizer every rank and the reference use."""

    batch: int = option(8, "global batch: sequences per step over all ranks")
    layers: int = option(2, "transformer blocks")
    hidden: int = option(32, "hidden size H")
    heads: int = option(4, "attention heads nh")
    ffn: int = option(0, "FFN size F (0: 4 x hidden)")
    vocab: int = option(64, "vocabulary size V")
    seq: int = option(16, "sequence length T")
    tied: bool = option(False, "share the embedding matrix with the LM head")
    recompute: str = option(
        "none",
        "activation recomputation: none, selective (attention core) or full (each block)",
        choices=list(RECOMPUTE),
    )
    optimizer: str = option(
        "sgd", "sgd, or adam (compare adam in float64: it turns last-bit noise into steps)", choices=["sgd", "adam"]
    )
    lr: float = option(0.1, "learning rate", bounds="(0, 100]")

    def validate(self) -> None:
        super().validate()
        for name in ("batch", "layers", "hidden", "heads", "vocab", "seq"):
            positive(name, getattr(self, name))
        if self.ffn < 0:
            raise ValueError(f"ffn={self.ffn} must be >= 0 (0 means 4 x hidden)")
        if self.lr <= 0:
            raise ValueError(f"lr={self.lr} must be > 0")
        self.gpt_config()  # the model's own checks: hidden divisible by heads

    @classmethod
    def for_config(cls, cfg: GPTConfig, **values) -> ModelOptions:
        """The options that build the model `cfg` (the inverse of gpt_config), with `values` for the rest."""
        sizes = {"vocab": cfg.vocab_size, "seq": cfg.seq_len, "hidden": cfg.hidden, "heads": cfg.heads}
        values.setdefault("recompute", cfg.recompute)
        return cls.make(**sizes, layers=cfg.layers, ffn=cfg.ffn, tied=cfg.tied, dtype=cfg.dtype, **values)

    def forward_flops(self) -> float | None:
        """One rank's forward: the whole model over its share of the batch (a scheme may say otherwise)."""
        from parlab.core.hardware import gpt_forward_flops

        return gpt_forward_flops(self.gpt_config(), max(self.batch // self.world_size, 1))

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=self.vocab,
            seq_len=self.seq,
            hidden=self.hidden,
            heads=self.heads,
            layers=self.layers,
            ffn=self.ffn,
            tied=self.tied,
            dtype=self.dtype,
            recompute=self.recompute,
        )


# A failure run that is not given --at-step: its rank dies in step 3, the first after the checkpoint of step 2
# (--checkpoint-every 2), so the restart resumes from a checkpoint and loses one step; without --steps the run goes
# on three steps past the failure.
DEFAULT_AT_STEP, DEFAULT_CHECKPOINT_EVERY, STEPS_PAST_FAILURE = 3, 2, 3
# How far --at-step alone may stretch the run (without --steps): a longer run is asked for with --steps itself.
MAX_STRETCHED_STEPS = 100


@dataclass
class FaultOptions:
    """A mixin (before the scheme's base class: `class DPOptions(FaultOptions, ModelOptions)`): inject a failure
    and survive it (parlab/schemes/faults/failures.py, parlab/runs/checkpoint.py). Without --kill-rank the run is
    unchanged, and the other failure options, which would change nothing, are refused."""

    steps: int | None = option(None, "training steps (default 3; with --kill-rank and no --steps: 3 past the failure)")
    kill_rank: int | None = option(None, "the rank that dies (os._exit) in the middle of step --at-step")
    at_step: int | None = option(None, f"the step (1..steps) in which --kill-rank dies (default {DEFAULT_AT_STEP})")
    checkpoint_every: int | None = option(
        None, f"with --kill-rank: save a sharded checkpoint every this many steps (default {DEFAULT_CHECKPOINT_EVERY})"
    )
    keep_checkpoint: str = option("", "with --kill-rank: keep the checkpoints in this new folder (default: removed)")

    def __post_init__(self):
        # Resolved here, at construction, so that every reader sees numbers; validate() says what is wrong with them.
        given_steps = self.steps is not None
        if self.kill_rank is not None and self.at_step is None:
            self.at_step = min(DEFAULT_AT_STEP, self.steps) if given_steps else DEFAULT_AT_STEP
        if not given_steps:
            failure = self.kill_rank is not None and isinstance(self.at_step, int) and self.at_step >= 1
            self.steps = self.at_step + STEPS_PAST_FAILURE if failure else default_of(RunOptions, "steps")
        self.steps_given = given_steps
        if self.kill_rank is not None and self.checkpoint_every is None:
            self.checkpoint_every = DEFAULT_CHECKPOINT_EVERY

    def validate(self) -> None:
        super().validate()
        if self.kill_rank is None:
            given = [
                flag
                for flag, value in (
                    ("at_step", self.at_step),
                    ("checkpoint_every", self.checkpoint_every),
                    ("keep_checkpoint", self.keep_checkpoint or None),
                )
                if value is not None
            ]
            if given:
                raise ValueError(f"{', '.join(given)}: no effect without kill_rank (--kill-rank R: the rank that dies)")
            return
        from parlab.core.scratch import check_folder

        if not 0 <= self.kill_rank < self.world_size:
            last = self.world_size - 1
            raise ValueError(f"kill_rank={self.kill_rank} is not a rank of world_size={self.world_size} (0..{last})")
        if self.world_size < 2:
            raise ValueError("kill_rank needs world_size >= 2: someone must survive")
        if not 1 <= self.at_step <= self.steps:
            raise ValueError(f"at_step={self.at_step} must be a step of the run, 1..steps={self.steps}")
        if not self.steps_given and self.steps > MAX_STRETCHED_STEPS:
            raise ValueError(
                f"at_step={self.at_step} alone would stretch the run to {self.steps} steps; give --steps too "
                f"(at least {self.at_step}) if a run that long is meant"
            )
        positive("checkpoint_every", self.checkpoint_every)
        check_folder(self.keep_checkpoint)
