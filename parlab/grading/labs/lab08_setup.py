"""What lab 08 hands out for the answers to call: Adam's update on a flat tensor.

The servers of lab 08's parts 1 and 4 train with Adam, kept on the server: its two moments live beside the parameters
they update, and its step count t counts the updates that parameter vector has received. This module is not on the
lab's LIBRARY list (parlab/grading/labs/lab08_parameter_server.py): an answer may call it.
"""

from __future__ import annotations

import torch

BETAS, EPS = (0.9, 0.999), 1e-8  # torch.optim.Adam's defaults


def adam_step(param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int, lr: float) -> None:
    """torch.optim.Adam's update (its defaults, no weight decay), in place, on flat tensors [S] held by one server.

    step: t, this update's number for these parameters (1 for their first update, 2 for the second, ...).

        m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2;  p <- p - lr/(1 - b1^t) * m / (sqrt(v)/sqrt(1 - b2^t) + eps)
    """
    b1, b2 = BETAS
    m.lerp_(grad, 1 - b1)  # the first moment (the same arithmetic as torch's Adam)
    v.mul_(b2).addcmul_(grad, grad, value=1 - b2)  # the second moment
    denom = (v.sqrt() / (1 - b2**step) ** 0.5).add_(EPS)
    param.addcdiv_(m, denom, value=-lr / (1 - b1**step))
