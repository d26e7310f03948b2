"""DeepSpeed-MoE, the baseline of ``+strategy=moe`` under ``engine=deepspeed``.

The model is composed as for every engine (memopt's ``MoE`` in the ``mlp`` slots, materialised and
initialised by name); then each memopt MoE layer is replaced by ``deepspeed.moe.layer.MoE`` holding
the same weights (router -> ``gate.wg``, this rank's experts -> ``deepspeed_experts``), so both
engines start from identical weights and differ only in DeepSpeed's gating, dispatch and
expert-parallel communication.

Translation (``strategy.moe`` -> ``deepspeed.moe.layer.MoE``):

    num_experts, capacity_factor,       the same arguments
    eval_capacity_factor, min_capacity,
    drop_tokens
    top_k                               k (DeepSpeed gates with k = 1 or 2 only)
    parallel.ep                         ep_size; DeepSpeed builds its own expert-parallel groups of
                                        consecutive ranks and expert-data-parallel groups across
                                        them, the layout of memopt's mesh
    (deterministic gating)              noisy_gate_policy=None, use_rts=False,
                                        top2_2nd_expert_sampling=False, use_residual=False
    aux_loss_coef                       times DeepSpeed's l_aux: E * sum_e f_e P_e with f from the
                                        first choices before dropping, the formula memopt uses
    z_loss_coef                         DeepSpeed has no router z-loss: the adapter adds
                                        mean logsumexp(x W_g^T)^2 from the gate's weight (one more
                                        (tokens x E) product per layer)

Gating differences that remain: when an expert is over capacity memopt keeps its first assignments
in token order (all first choices before second choices); DeepSpeed keeps ``capacity`` assignments
chosen by ``torch.topk`` over a 0/1 mask, whose order among equal values is unspecified, so the
dropped tokens may differ (the trajectories agree when nothing is dropped: a large
``capacity_factor`` or ``drop_tokens=false``). DeepSpeed dispatches with dense one-hot einsums
(tokens x E x capacity), memopt with index copies: more temporary bytes on DeepSpeed's side, counted
as they happen. DeepSpeed asserts at least ``min_capacity`` tokens per micro-batch (refused here first).

Routing statistics (``moe`` in the run records) come from the same places as memopt's: DeepSpeed's
l_aux, the adapter's z-loss, and the per-expert assignment counts of the gate's top-k (the dropped
fraction is sum_e max(0, load_e - capacity) / (tokens x k), exact for either drop order).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from memopt.errors import ConfigError
from memopt.models.moe import AuxLossPart, MoE, capacity, router_logits, z_loss


def validate(cfg) -> None:
    """What DeepSpeed-MoE cannot run as ``strategy.moe`` defines it."""
    o = cfg.strategy.moe
    if o is None:
        return
    if o.top_k not in (1, 2):
        raise ConfigError(f"strategy.moe.top_k={o.top_k} with engine=deepspeed: DeepSpeed-MoE gates with top_k 1 or 2 "
                          "only; use top_k=1 or 2, or engine=memopt")
    from memopt.strategies.zero import selected_stage

    if selected_stage(cfg)[1] == 3:
        raise ConfigError("strategy moe with zero3 and engine=deepspeed: DeepSpeed-MoE is not supported with ZeRO "
                          "stage 3 (DeepSpeed asserts so); use zero1/zero2 with engine=deepspeed, or engine=memopt")
    tokens = cfg.trainer.micro_batch_size * cfg.model.seq_len
    if o.min_capacity > tokens:
        raise ConfigError(f"strategy.moe.min_capacity={o.min_capacity} is larger than the {tokens} tokens of a "
                          f"micro-batch (trainer.micro_batch_size x model.seq_len): DeepSpeed-MoE asserts on that; "
                          f"lower min_capacity or raise the micro-batch")


class DeepSpeedMoE(AuxLossPart, nn.Module):
    """``deepspeed.moe.layer.MoE`` in memopt's ``mlp`` slot: (B, T, C) -> (B, T, C), with memopt's
    auxiliary-loss and statistics protocol."""

    def __init__(self, src: MoE, ep_size: int):
        super().__init__()
        from deepspeed.moe.layer import MoE as DSMoE

        d_model = src.router.weight.shape[1]
        template = next(iter(src.experts.values()))
        self.moe = DSMoE(d_model, template, num_experts=src.num_experts, ep_size=ep_size, k=src.top_k,
                         capacity_factor=src.capacity_factor, eval_capacity_factor=src.eval_capacity_factor,
                         min_capacity=src.min_capacity, use_residual=False, noisy_gate_policy=None,
                         drop_tokens=src.drop_tokens, use_rts=False, top2_2nd_expert_sampling=False)
        with torch.no_grad():  # the gate's Linear is fp32, as memopt's router computes
            self.gate.weight.copy_(src.router.weight)
            for mine, theirs in zip(self.moe.deepspeed_moe.experts.deepspeed_experts, src.experts.values()):
                mine.load_state_dict(theirs.state_dict())
        self.num_experts, self.top_k = src.num_experts, src.top_k
        self.capacity_factor, self.eval_capacity_factor = src.capacity_factor, src.eval_capacity_factor
        self.min_capacity, self.drop_tokens = src.min_capacity, src.drop_tokens
        self.aux_loss_coef, self.z_loss_coef = src.aux_loss_coef, src.z_loss_coef
        self.ep, self.stats, self.name = src.ep, src.stats, src.name

    @property
    def gate(self) -> nn.Linear:
        return self.moe.deepspeed_moe.gate.wg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, l_aux, _ = self.moe(x)
        if self.training and torch.is_grad_enabled():
            logits = router_logits(x.reshape(-1, x.shape[-1]), self.gate.weight)  # (S, E): the gate's own logits
            zl = z_loss(logits)
            self._aux = self.aux_loss_coef * l_aux + self.z_loss_coef * zl
            self._pending = (l_aux.detach(), zl.detach(), *self._drops(logits.detach()))
        return y.to(x.dtype)

    def _drops(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(dropped fraction, per-expert assignment counts) of this forward's gating."""
        S, E, k = logits.shape[0], self.num_experts, self.top_k
        load = F.one_hot(logits.topk(k, dim=-1).indices, E).sum((0, 1))  # (E,) assignments before dropping
        if self.drop_tokens:
            cap = capacity(S, E, k, self.capacity_factor, self.min_capacity)
        else:
            return torch.zeros(()), load
        return (load - cap).clamp(min=0).sum() / (S * k), load


def swap_in(model, ep_size: int) -> int:
    """Replace every memopt ``MoE`` in the model's ``mlp`` slots by DeepSpeed-MoE with its weights;
    returns how many layers were replaced."""
    n = 0
    for i in range(len(model.blocks)):
        src = model.slot(i, "mlp")
        if isinstance(src, MoE):
            model.set_slot(i, "mlp", DeepSpeedMoE(src, ep_size))
            n += 1
    return n


def memopt_names(model, state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``state`` with DeepSpeed-MoE's parameter names replaced by memopt's (``router.weight``,
    ``experts.<global index>.*``), so ``model.pt`` loads into memopt's model; also returns the expert
    names (this rank's experts)."""
    out, experts = dict(state), []
    for name, mod in model.named_modules():
        if not isinstance(mod, DeepSpeedMoE):
            continue
        pre = f"{name}.moe.deepspeed_moe."
        out[f"{name}.router.weight"] = out.pop(pre + "gate.wg.weight")
        local = mod.num_experts // mod.moe.ep_size
        first = (mod.ep.rank if mod.ep is not None and mod.ep.enabled else 0) * local  # DeepSpeed's groups: consecutive ranks
        inner = pre + "experts.deepspeed_experts."
        for key in [k for k in out if k.startswith(inner)]:
            i, rest = key[len(inner):].split(".", 1)
            new = f"{name}.experts.{first + int(i)}.{rest}"
            out[new] = out.pop(key)
            experts.append(new)
    return out, experts


def optimizer_groups(groups: list[dict]) -> list[dict]:
    """DeepSpeed's ZeRO needs expert parameters in param groups of their own (marked ``moe``); its
    splitter names the new groups after the old ones, so each gets a name first."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    named = [{"name": f"group{i}", **g} for i, g in enumerate(groups)]
    return split_params_into_different_moe_groups_for_optimizer(named)
