"""MoE routing on fake tensors: the planned answer to the two value-dependent sizes of an MoE layer.

A fake step has no router values, so it cannot know how many assignments an expert keeps or, with
dropless routing, how large the fullest expert is. ``planned_routing`` answers both with the case
that bounds the run's bytes from above, so a plan never under-predicts:

- kept assignments A (``memopt.models.moe.kept``): min(S x k, E x N), every slot that can be filled.
  With ``drop_tokens=true`` this is the balanced case too (no expert over its capacity, nothing
  dropped); a real run drops a few assignments (a fresh router is not balanced), so it holds up to
  (S k - A_real) fewer rows of its per-assignment tensors (indices, the gathered expert outputs and
  their combine weights: ``activations`` and ``temp``).
- dropless capacity N (``memopt.models.moe.dropless_capacity``): S, every token of the rank choosing
  the same expert (top-k choices are distinct experts, so no expert can receive more). The balanced
  answer (S k / E) is what a well-trained router needs, but a dropless run's memory is set by its
  fullest expert, and a collapsed router (common early in training) fills one expert with every
  token; a plan that assumed balance would let such a run go out of memory. The dispatch buffers and
  the experts' activations are E x N rows, so this plan is E / k times a balanced run's for them.
"""
from __future__ import annotations

import contextlib

import torch


def planned_kept(keep: torch.Tensor, slots: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``kept`` with A = min(S k, slots) rows: the first A (token, choice) entries, each a new tensor
    (as boolean indexing makes), still in the autograd graph (the combine weights carry gradient)."""
    count = min(keep.numel(), slots)
    out = []
    for t in tensors:
        if t.requires_grad:
            out.append(t.reshape(-1)[:count].clone())
        else:
            out.append(t.new_empty(count))
    return tuple(out)


def planned_dropless_capacity(load: torch.Tensor, ep=None, tokens: int | None = None) -> int:
    """The largest possible expert load: every one of the rank's ``tokens`` (S; a token's top-k choices
    are distinct experts, so no expert can get more)."""
    return max(int(tokens), 1)


@contextlib.contextmanager
def planned_routing():
    """Inside: memopt's MoE layers use the planned routing (see the module docstring)."""
    from memopt.models import moe

    saved = moe.kept, moe.dropless_capacity
    moe.kept, moe.dropless_capacity = planned_kept, planned_dropless_capacity
    try:
        yield
    finally:
        moe.kept, moe.dropless_capacity = saved
