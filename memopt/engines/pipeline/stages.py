"""A GPT split into pipeline stages: which blocks each stage runs, the pruning of the meta model to
this rank's stages, and the module each ``PipelineStage`` wraps.

Parameter names stay the single-process ones (``blocks.5.attn.qkv.weight`` on whichever rank holds
block 5): the blocks a rank does not hold are replaced by parameterless ``Identity`` modules instead
of being renumbered, so initialisation (seeded by name), checkpoints and model.pt need no mapping.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from memopt.models.gpt import rope_cache


def stage_ranges(blocks_per_stage: list[int]) -> list[range]:
    """The block indices of each stage, consecutive, in stage order."""
    out, start = [], 0
    for n in blocks_per_stage:
        out.append(range(start, start + n))
        start += n
    return out


def rank_stages(rank: int, pp: int, n_stages: int) -> list[int]:
    """The stages pipeline rank ``rank`` holds: torch's looped placement, stage k on rank k mod pp."""
    return [k for k in range(n_stages) if k % pp == rank]


def prune(model, keep: set[int], first: bool, last: bool) -> dict[str, str]:
    """Drop from the meta ``model`` what this rank's stages do not run; returns the init aliases
    (parameter name -> the single-process name it is initialised as).

    With tied embeddings the last stage holds the output layer's weight without the embedding: in one
    process that tensor is named ``wte.weight`` (the first name of a tied parameter), so it is
    initialised under that name and both stages start from the same values; the engine all-reduces
    their gradients so that they stay equal (Megatron's embedding group)."""
    for i in range(len(model.blocks)):
        if i not in keep:
            model.blocks[i] = nn.Identity()
    tied = model.lm_head.weight is model.wte.weight
    if not first:
        model.wte = None
        model.wpe = None
    if not last:
        model.ln_f = None
        model.lm_head = None
    return {"lm_head.weight": "wte.weight"} if tied and last and not first else {}


class StageModule(nn.Module):
    """One stage's forward: (first) embeddings, its blocks through the model's ``block_runner`` (the
    checkpointing slot), (last) the final norm. The last stage's output is the normed hidden state:
    the schedule's loss function applies the model's ``loss_head`` (output layer and cross-entropy), so
    the loss is computed exactly as in one process.

    Under the memory tracker a training forward is wrapped in ``retained("activations")`` (what autograd
    keeps for the backward, as the memopt engine counts it) and runs under the precision's autocast."""

    def __init__(self, model, blocks: range, first: bool, last: bool, precision, tracker, device):
        super().__init__()
        self.first, self.last, self.cfg = first, last, model.cfg
        self.blocks = nn.ModuleList(model.blocks[i] for i in blocks)
        self.wte = model.wte if first else None
        self.wpe = model.wpe if first else None
        self.drop = model.drop if first else None
        self.ln_f = model.ln_f if last else None
        self.lm_head = model.lm_head if last else None  # used by the loss function; registered for its gradients
        self.__dict__["runner"] = model.block_runner  # a callable (ckpt's SegmentRunner), not a submodule
        self.__dict__["precision"], self.__dict__["tracker"], self.__dict__["device"] = precision, tracker, device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # evaluation: nothing is kept for a backward
            with self.precision.autocast(self.device):
                return self._run(x)
        with self.tracker.retained("activations"), self.precision.autocast(self.device):
            return self._run(x)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        if self.first:  # x: token ids (B, T), as GPT.forward embeds them
            idx = x
            x = self.wte(idx)  # (B, T, C)
            if self.wpe is not None:
                x = x + self.wpe(torch.arange(T, device=idx.device))
            x = self.drop(x)
        c = self.cfg
        rope = None if c.pos_emb == "learned" else rope_cache(T, c.head_dim, x.device, c.rope_theta)
        x = self.runner(list(self.blocks), x, rope)  # (B, T, C)
        if self.last:
            x = self.ln_f(x)
        return x
