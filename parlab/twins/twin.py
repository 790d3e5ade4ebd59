"""What a twin is: PyTorch's own implementation of a scheme, as rank code and a comparison (see parlab/twins)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from parlab.core.check import Verdict
from parlab.runtime.errors import Results


@dataclass(frozen=True)
class Twin:
    """A scheme's PyTorch twin.

    name:    what it is ("torch DDP"); or a function of the options, when they choose it (ZeRO's stage)
    rank:    rank code, (opts, parlab's value on this rank) -> dict; run right after parlab's own rank code
    compare: parent, (opts, parlab's results, the twins' outputs in rank order) -> verdicts, twin vs parlab
    skip:    (opts) -> why this twin cannot run with these options ("" when it can)
    """

    name: str | Callable[[Any], str]
    rank: Callable[[Any, Any], dict] | None = None
    compare: Callable[[Any, Results, list[dict]], list[Verdict]] | None = None
    skip: Callable[[Any], str] | None = None

    def title(self, opts) -> str:
        return self.name if isinstance(self.name, str) else self.name(opts)


def no_twin(name: str, reason: str) -> Twin:
    """A scheme PyTorch has no implementation of: always skipped, with the reason."""
    return Twin(name, skip=lambda opts: reason)
