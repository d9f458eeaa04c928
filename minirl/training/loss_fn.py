"""The loss function a run trains with: the built-in `decoupled_loss`, or a user's 'module:function' (Config.loss_fn),
and the step-wide top-entropy mask (Config.top_entropy_quantile) the trainer hands to it.

A loss_fn takes one `LossInputs` (a micro-batch) and returns a `LossOut`, or a scalar tensor (then only the loss
is known: the step's clip / IS metrics are 0). The trainer sums `loss.backward()` over micro-batches, so a loss_fn
must aggregate with `weight_B_T` (the step-wide weights) for micro-batching not to change the gradient.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from minirl.config.errors import ConfigError
from minirl.rewards.registry import import_ref
from minirl.training.loss import LossInputs, LossOut, decoupled_loss

LossFn = Callable[[LossInputs], "LossOut | torch.Tensor"]


def resolve_loss_fn(ref: str | None) -> LossFn:
    """The loss_fn `ref` names ('module:function'; None: `decoupled_loss`), or one ConfigError line naming it."""
    if ref is None:
        return decoupled_loss
    try:
        _, fn = import_ref(ref, "loss_fn", "module:function")
    except ValueError as e:
        raise ConfigError(str(e)) from None  # one line: "loss_fn 'm:f' cannot be imported (...); check ..."
    if not callable(fn):
        raise ConfigError(f"loss_fn={ref!r} is a {type(fn).__name__}, not a function: give a function of one "
                          "LossInputs (docs/recipes.md, 'Your own loss')")
    return fn


def run_loss(fn: LossFn, inputs: LossInputs) -> LossOut:
    """`fn(inputs)` as a `LossOut` (a bare scalar tensor gets the micro-batch's token count and no metrics)."""
    out = fn(inputs)
    if isinstance(out, LossOut):
        return out
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return LossOut(loss=out, n_tokens=int(inputs.mask_B_T.sum()))
    raise TypeError(f"loss_fn {getattr(fn, '__name__', fn)!r} returned {type(out).__name__}: return a LossOut or a "
                    "scalar tensor")


def quantile(x_N: torch.Tensor, q: float) -> float:
    """torch.quantile's default ('linear' interpolation) without its input-size limit."""
    v = x_N.flatten().double().sort().values
    pos = q * (v.numel() - 1)
    lo = int(pos)
    hi = min(lo + 1, v.numel() - 1)
    return float(v[lo] + (v[hi] - v[lo]) * (pos - lo))


def top_entropy_masks(entropy_B_T: Sequence[torch.Tensor], mask_B_T: Sequence[torch.Tensor],
                      rho: float) -> list[torch.Tensor]:
    """TRL's top_entropy_quantile over a whole step: for each micro-batch, the loss targets whose entropy is at
    least the (1 - rho) quantile of every target's entropy in the step (TRL's `get_high_entropy_mask` with
    threshold 1 - rho, there per micro-batch gathered over devices)."""
    valid = torch.cat([e[m.bool()].float().cpu() for e, m in zip(entropy_B_T, mask_B_T)])
    if valid.numel() == 0:
        return [torch.zeros_like(m, dtype=torch.bool) for m in mask_B_T]
    t = quantile(valid, 1.0 - rho)
    return [(e.float() >= t) & m.bool() for e, m in zip(entropy_B_T, mask_B_T)]
