"""``engine=deepspeed`` with ``+strategy=moe`` (DeepSpeed-MoE) planned: the model states by DeepSpeed's
rules per parameter group, the compute bytes from DeepSpeed-MoE's own layer code on fake tensors.

Model states. DeepSpeed's ZeRO stages 1/2 keep the expert parameters in param groups of their own
(``engines/deepspeed_moe.optimizer_groups``), each partitioned over its expert-data-parallel group
(the W / ep ranks holding the same experts) instead of all W ranks, with its own flat buffer, fp32
master partition and moments. A rank holds D dense parameters (router included) and X / ep expert
parameters (X: all experts of all layers), so per rank, b bytes per parameter:

  params  (D + X / ep) b                            (the flat low-precision groups)
  optim   12 (D / W + (X / ep) / (W / ep)) = 12 (D + X) / W  (the expert share is X / W whatever ep)
  grads   the reduction buckets (one per communication dtype, as dense) + stage 2's gradient partition
          b (D + X) / W
  stage 0 params and param.grad of the rank's own D + X / ep, and one flat all-reduce copy of the dense
          or of the expert gradients (DeepSpeed flattens them apart), the larger; optim 8 per parameter
          (fp32 Adam moments, the weights are the masters; 12 with bf16 weights: fp32 masters too). The
          peak is either the backward's compute bytes and the data beside the states and the gradients
          so far (moe_tiny ep=2: 21.04 MB planned, 21.03 measured; accumulating, every gradient), or after it,
          the activations gone, every gradient beside the flat copy or (bf16 weights) the unfused
          optimizer's step: an fp32 copy of every gradient and AdamW's foreach sqrt of the largest of the
          four groups (``group_sizes``; moe_tiny ep=2: 24.72 MB planned, 24.71 measured, 19.20 when the
          step was left out; adding the backward and the end of it was 40% over)
  offload each group's partitions on the host (fp32 master and moments, the fp32 gradient, the b-byte
          staging of the updated weights: 12 + 4 + b per partition element; moe_tiny: host exact)

and the ``params`` peak is at least the swap at build time: the fp32 model (D + X / ep parameters)
plus one MoE layer's DeepSpeed copy (its gate and local experts) before the memopt layer is dropped.

Compute bytes. DeepSpeed-MoE gates, dispatches and combines with its own code (``TopKGate``,
``MOELayer``), which holds other tensors than memopt's index copies. The planner's fake step runs it:
inside ``deepspeed_moe_layers()`` each memopt MoE layer forwards through the same ``DeepSpeedMoE``
adapter a run swaps in, built on ``meta`` and bound to the memopt layer's own parameters (the gate's
weight is the router's, the local experts are the memopt expert modules), so memopt's engine partitions
and reduces the parameters as usual while the layer's activations, temporaries and all-to-all buffers
are DeepSpeed's (its collectives through ``torch.distributed``, the fake process group, instead of
DeepSpeed's comm module). The fake step is memopt's zero1 for a stage-2 run (``rules.fake_step_cfg``). The
gate's capacity is a tensor DeepSpeed reads with ``int()``; from the configured capacity factor
FakeTensorMode propagates it as a constant. Dropless routing (``drop_tokens=false``) takes it from the
largest expert load, a value: the plan takes the worst case, S (``worst_case_capacity``), as memopt's
own MoE does (``planner/routing.py``).
"""
from __future__ import annotations

import contextlib
import math


def param_split(cfg, ep: int) -> tuple[int, int, int]:
    """(D dense parameters incl. routers, X expert parameters of the whole model, the largest MoE layer's
    parameters one rank builds: its gate and X_layer / ep experts)."""
    from memopt import compose
    from memopt.models import model_class
    from memopt.strategies.moe import moe_blocks

    o, mc = cfg.strategy.moe, cfg.model
    expert = model_class(mc).mlp_params(mc, o.d_ff)  # an expert is the dense MLP's structure
    layers = len(moe_blocks(o, mc.n_layer))
    X = layers * o.num_experts * expert
    D = compose.num_params(cfg) - X
    return D, X, o.num_experts * mc.d_model + (o.num_experts // ep) * expert


def group_sizes(cfg, world: int) -> list[int]:
    """Elements per rank of the translation's optimizer groups as DeepSpeed-MoE splits them: weight decay
    (ndim >= 2) or not, dense or expert (a rank holds 1 / ep of every MoE layer's experts: ``params.rank_params``)."""
    from memopt.planner.engines.deepspeed.params import rank_params

    sizes = [0, 0, 0, 0]  # dense no decay, dense decay, expert no decay, expert decay
    for n, ndim, _, expert, _ in rank_params(cfg, world):
        sizes[2 * expert + (ndim >= 2)] += n
    return sizes


def model_states(cfg, world: int, ep: int, param_bytes: int, dense_states) -> dict:
    """``rules.deepspeed_model_states``'s result for DeepSpeed-MoE: ``dense_states(P, W)``
    computes the dense rules for P parameters partitioned over W ranks; the expert groups' shares
    are put in (see the module docstring)."""
    from memopt.strategies.zero import selected_stage

    W, b = max(1, world), param_bytes
    D, X, layer = param_split(cfg, ep)
    local = D + X // ep  # parameters this rank holds
    stage = selected_stage(cfg)[1]
    if stage == 0:  # nothing partitioned: the rank's own parameters, its gradients (param.grad) and Adam's
        # moments; DeepSpeed all-reduces the dense and the expert gradients in separate flat copies after the
        # backward, when the activations are gone: the total is the larger of the backward's compute bytes
        # beside the states without gradients (``device_total``, deepspeed_sim adds those bytes) and the
        # states with every gradient and either the larger flat copy or the step (``after_backward``)
        out = dense_states(local, W)
        dev = out["device"]
        flat = max(D, X // ep) * b
        dev["grads"] = local * b + flat
        out["device_total"] = local * b + dev["optim"]
        # the step with bf16 weights: the unfused optimizer's fp32 copy of every gradient beside the foreach
        # AdamW's sqrt of the largest group's second moments (its constructor's priming step holds the same)
        step = (4 * local if b == 2 else 0) + 4 * max(group_sizes(cfg, world))
        out["after_backward"] = out["device_total"] + local * b + max(flat, step)
    else:
        # the dense rules for the rank's own parameters, whose partitions are then corrected: dense ones
        # over W ranks, expert ones over W / ep (the same X / W elements per rank)
        out = dense_states(local, W)
        part_dense = math.ceil(local / W)
        part_moe = math.ceil(D / W) + math.ceil((X // ep) / max(1, W // ep))
        dev, host, extra = out["device"], out["host"], part_moe - part_dense
        if cfg.strategy.cpu_offload is not None:  # each group's partitions on the host: fp32 master and moments,
            # the fp32 gradient the host Adam reads, the b-byte staging of the updated weights
            host["optim"] += 12 * extra
            host["grads"] += 4 * extra
            host["params"] += b * extra
        else:
            dev["optim"] += 12 * extra
            out["device_total"] += 12 * extra
            dev["grads"] += b * extra  # the gradient partition (counted at the reductions' moments)
            red = out["reductions"]
            out["reductions"] = {**red, "gip": red["gip"] + b * extra,
                                 "kept": red["kept"] + (b * extra if red["kept"] else 0)}
    dev = out["device"]
    dev["params"] = max(dev["params"], 4 * (local + layer))  # the fp32 model + one layer's swap
    return out


def _meta_twin(src, ep_size: int):
    """The ``DeepSpeedMoE`` a run swaps in for memopt layer ``src``, bound to ``src``'s parameters."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    from memopt.engines.deepspeed_moe import DeepSpeedMoE
    from memopt.models.moe import MoE

    fc = next(iter(src.experts.values())).fc
    with _disable_current_modes(), torch.device("meta"):
        like = MoE(fc.in_features, fc.out_features, src.num_experts, src.top_k, src.capacity_factor,
                   src.eval_capacity_factor, src.min_capacity, src.drop_tokens, src.aux_loss_coef, src.z_loss_coef,
                   bias=fc.bias is not None, ep=src.ep, stats=src.stats, name=src.name)
        twin = DeepSpeedMoE(like, ep_size)
    inner = twin.moe.deepspeed_moe
    inner.gate.wg.weight = src.router.weight
    first = (src.ep.rank if src.parallel else 0) * src.local
    inner.experts.deepspeed_experts = torch.nn.ModuleList(src.experts[str(first + i)] for i in range(src.local))
    if src.parallel:
        inner._set_ep_group(src.ep.group)
    return twin


class _WorstCaseTorch:
    """``torch`` as DeepSpeed's gating functions see it in a dropless plan: ``torch.max`` of a whole tensor
    (there only the dropless capacity, the largest expert load) answers ``tokens``, a constant the fake
    tensors carry through the gate's arithmetic and ``int()``; everything else is torch's."""

    def __init__(self, tokens: int):
        self.tokens = tokens

    def __getattr__(self, name):
        import torch

        return getattr(torch, name)

    def max(self, t, *args, **kwargs):
        import torch

        if args or kwargs:
            return torch.max(t, *args, **kwargs)
        return torch.tensor(self.tokens, dtype=t.dtype, device=t.device)


@contextlib.contextmanager
def worst_case_capacity():
    """Inside: DeepSpeed-MoE's dropless gate takes its capacity as every token of the rank (S) in one
    expert, the worst case (``planner/routing.py``); its run reads the largest expert load as a value, max-
    reduced over the expert-parallel group, whose ranks hold S tokens each, so S bounds it there too."""
    import torch
    from deepspeed.moe import sharded_moe

    forward = sharded_moe.TopKGate.forward

    def gate(self, input, *args, **kwargs):
        if self.drop_tokens:
            return forward(self, input, *args, **kwargs)
        sharded_moe.torch = _WorstCaseTorch(input.shape[0])
        try:
            return forward(self, input, *args, **kwargs)
        finally:
            sharded_moe.torch = torch

    sharded_moe.TopKGate.forward = gate
    try:
        yield
    finally:
        sharded_moe.TopKGate.forward = forward


@contextlib.contextmanager
def deepspeed_moe_layers(ep_size: int):
    """Inside: memopt's MoE layers forward through DeepSpeed-MoE's layer code (see the module docstring)."""
    import torch.distributed
    from deepspeed.comm import pg_utils
    from deepspeed.moe import sharded_moe

    from memopt.models import moe

    original, comm = moe.MoE.forward, sharded_moe.dist

    def forward(self, x):
        twin = self.__dict__.get("_ds_twin")  # not a submodule: the model's parameters and modules are unchanged
        if twin is None:
            twin = self.__dict__["_ds_twin"] = _meta_twin(self, ep_size)
        twin.train(self.training)
        y = twin(x)
        self._aux, self._pending, twin._aux, twin._pending = twin._aux, twin._pending, None, None
        return y

    # its all-to-all (and the dropless gate's group size and all-reduce) through torch.distributed (the fake
    # process group), which DeepSpeed's comm module calls in a run: the planner never initialises DeepSpeed's
    # communication backend
    moe.MoE.forward, sharded_moe.dist, pg_utils.dist = forward, torch.distributed, torch.distributed
    try:
        with worst_case_capacity():
            yield
    finally:
        moe.MoE.forward, sharded_moe.dist, pg_utils.dist = original, comm, comm
