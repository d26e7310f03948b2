"""``engine=deepspeed`` with MoE (DeepSpeed-MoE) planned (``memopt/planner/engines/deepspeed/moe_rules.py``): the
expert groups' model states by DeepSpeed's rules, the layers' compute bytes from DeepSpeed-MoE's own
layer code on fake tensors. References: the measured DeepSpeed runs (slow matrix: ``params``, ``optim``,
``activations`` and the device total within 3%, as test_accuracy_deepspeed.py), and in the default
suite the optimizer bytes of the expert and dense partitions from the model's parameter count."""
from __future__ import annotations

import pytest

from tests.planner.test_accuracy import assert_plan_bounds, measured, planned
from tests.planner.test_accuracy_deepspeed import compare_deepspeed

MOE = ["model=moe_tiny"]
BF16_WEIGHTS = "strategy.bf16.params=bf16"
# Measured here (device total, rank 0; params and optim agree to 16 B, activations exactly but for fp16's and
# bf16 weights' -2.12%): 1 rank zero2 86.03 MB vs 85.56 MB planned, zero1+fp16 53.52 vs 52.78; 2 ranks zero2
# ep1 76.28 vs 78.44 (+2.83% when the fake step was memopt's zero2, whose flat gradient copies are compute
# bytes; now memopt's zero1: 75.81), zero2 ep2 74.42 vs 73.95, zero1 ep2 48.21 vs 47.73, top-1 72.58 vs 72.12,
# zero2+fp16 ep2 68.73 vs 68.19, ddp ep2 21.03 vs 21.04 (20.56 when the backward's total left out the run's
# data; one run under load: rank 1 21.19, an all-to-all backward output of 164 KB still alive), ddp ep1 30.70 vs
# 30.70 (was 30.22); 1 rank zero2 + bf16 autocast 138.57 vs 138.20 (85.77 before the rules counted
# DeepSpeed's reduction buckets per communication dtype). bf16 weights: 1 rank zero2 79.54 vs 79.00, 2 ranks
# zero2 ep2 68.73 vs 68.19, zero1 ep1 43.77 vs 43.03; ddp + bf16 autocast 2 ranks ep2 20.34 vs 20.35, ep1
# 30.70 vs 30.70. zero2 + cpu_offload (host: exact): 1 rank 66.79 vs 66.32, 2 ranks ep2 64.93 vs 64.46, ep1
# 66.79 vs 68.95 (+3.23% with memopt's zero2 fake step, 66.32 with zero1). ddp + bf16 weights (the peak:
# DeepSpeed's unfused optimizer step), 1 rank 37.18 vs 37.18, 2 ranks ep1 37.18 vs 37.19, ep2 24.71 vs 24.72
# (had been refused: 19.20 planned, the step left out).
CASES = {  # id -> (ranks, overrides)
    "1rank-zero2": (1, ["+strategy=zero2"]),
    "1rank-zero1-fp16": (1, ["+strategy=[zero1,fp16]", "strategy.fp16.init_scale=1024"]),
    "1rank-zero2-bf16": (1, ["+strategy=[zero2,bf16]"]),
    "1rank-zero2-bf16w": (1, ["+strategy=[zero2,bf16]", BF16_WEIGHTS]),
    "1rank-zero2-offload": (1, ["+strategy=[zero2,cpu_offload]"]),
    "2rank-zero1-ep1": (2, ["+strategy=zero1"]),
    "2rank-zero2-ep1": (2, ["+strategy=zero2"]),
    "2rank-zero1-ep2": (2, ["+strategy=zero1", "parallel.ep=2"]),
    "2rank-zero2-ep2": (2, ["+strategy=zero2", "parallel.ep=2"]),
    "2rank-zero2-ep2-top1": (2, ["+strategy=zero2", "parallel.ep=2", "strategy.moe.top_k=1"]),
    "2rank-zero2-ep2-fp16": (2, ["+strategy=[zero2,fp16]", "parallel.ep=2", "strategy.fp16.init_scale=1024"]),
    "2rank-zero2-ep2-bf16w": (2, ["+strategy=[zero2,bf16]", "parallel.ep=2", BF16_WEIGHTS]),
    "2rank-zero1-ep1-bf16w": (2, ["+strategy=[zero1,bf16]", BF16_WEIGHTS]),
    "2rank-ddp-ep2": (2, ["+strategy=ddp", "parallel.ep=2"]),
    "2rank-ddp-ep2-bf16": (2, ["+strategy=[ddp,bf16]", "parallel.ep=2"]),
    "1rank-ddp-bf16w": (1, ["+strategy=[ddp,bf16]", BF16_WEIGHTS]),
    "2rank-ddp-ep1-bf16w": (2, ["+strategy=[ddp,bf16]", BF16_WEIGHTS]),
    "2rank-ddp-ep2-bf16w": (2, ["+strategy=[ddp,bf16]", "parallel.ep=2", BF16_WEIGHTS]),
    "2rank-zero2-ep1-offload": (2, ["+strategy=[zero2,cpu_offload]"]),
    # stage 0 accumulating: each param.grad kept to the last micro-batch's all-reduce (46.16 MB measured, 39.64 planned
    # before, 46.14 now; moe_small bf16 DDP at 4 x 4 went over its budget in its first step, planned 11% under it)
    "2rank-ddp-ep1-bf16-accum": (2, ["+strategy=[ddp,bf16]", "trainer.grad_accum=2", "trainer.micro_batch_size=8"]),
    "2rank-zero2-ep2-offload": (2, ["+strategy=[zero2,cpu_offload]", "parallel.ep=2"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_matrix_deepspeed_moe(case, tmp_path):
    world, ov = CASES[case]
    ov, slack = ["engine=deepspeed", *MOE, *ov], {}
    real = measured(ov, world, tmp_path, slack)  # of gloo's late releases, only the all-to-all's (activations)
    bad = compare_deepspeed(planned(ov, world), real, {"activations": slack.get("activations", 0)})
    assert not bad, f"{ov} on {world} rank(s):\n" + "\n".join(bad)


def test_plan_counts_expert_partitions_over_the_expert_data_parallel_group():
    """zero1, 2 ranks, ep=2: each rank holds 2 of moe_tiny's 4 experts per MoE layer, partitioned over its
    expert-data-parallel group of W / ep = 1 rank, the dense parameters over both: fp32 master + Adam
    moments = 12 bytes x (dense / 2 + the rank's experts / 1). The params peak is the build's: the fp32
    model (dense + the rank's experts) plus one layer's DeepSpeed-MoE copy (its gate and 2 experts).
    Parameter counts from GPT's architecture, written out here."""
    from tests.conftest import typed

    ov = [*MOE, "model.seq_len=64"]
    cfg = typed(ov)
    mc, E = cfg.model, cfg.strategy.moe.num_experts
    C, V, T, L, F = mc.d_model, mc.vocab_size, mc.seq_len, mc.n_layer, mc.ff
    assert mc.bias and mc.tie_embeddings and mc.pos_emb == "learned" and cfg.strategy.moe.every_k_layers == 2
    mlp = C * F + F + F * C + C  # fc, proj with biases: also one expert
    attn = 2 * C + (C * 3 * C + 3 * C) + (C * C + C) + 2 * C  # ln_1, qkv, proj, ln_2
    moe_layers = L // 2  # blocks 1 and 3
    dense = V * C + T * C + L * attn + (L - moe_layers) * mlp + moe_layers * E * C + 2 * C  # routers, ln_f
    experts = moe_layers * E * mlp
    plan = planned(["engine=deepspeed", *ov, "+strategy=zero1", "parallel.ep=2"], 2)
    for rank in ("0", "1"):
        dev = plan[rank]["device"]
        assert abs(dev["optim"] - 12 * (dense // 2 + experts // 2)) <= 12 * 8, dev  # a few elements of alignment
        assert dev["params"] == 4 * (dense + experts // 2 + E * C + (E // 2) * mlp), dev


@pytest.mark.slow
def test_dropless_plan_bounds_the_run(tmp_path):
    """Dropless routing is planned at its worst case (every token of a rank in one expert: the plan's
    capacity S; test_deepspeed_moe_routing.py checks a collapsed router's layer holds exactly that): a run
    holds at most the plan's activations and total, and its model states are the plan's (2 ranks, ep=2:
    DeepSpeed max-reduces the capacity over the expert-parallel group, each rank's bounded by S). Measured:
    activations 7,297,816 B vs 8,442,584 planned, total 75.18 MB vs 76.07."""
    ov = ["engine=deepspeed", *MOE, "+strategy=zero2", "parallel.ep=2", "strategy.moe.drop_tokens=false"]
    plan, real = planned(ov, 2), measured(ov, 2, tmp_path)
    assert_plan_bounds(plan, real, compare_deepspeed(plan, real))


def test_ddp_with_bf16_weights_is_planned_at_the_unfused_optimizer_step():
    """ddp + bf16 weights, 2 ranks, ep=2: the peak is DeepSpeed's unfused optimizer step over the rank's
    dense parameters and its 2 of 4 experts per MoE layer (L): bf16 weights and gradients (2 + 2 bytes), fp32
    masters and Adam moments (12), the fp32 copy of every gradient (4), and the foreach AdamW's sqrt of the
    largest group's second moments (4 bytes x the dense weight-decay group: embeddings, attention and dense
    MLP weights, routers), beside the run's data (``other``, whose peak adds the step's few scalars: 8 KiB here).
    Counts from GPT's architecture, written out."""
    from tests.conftest import typed

    ov = [*MOE, "model.seq_len=64"]
    mc = typed(ov).model
    C, V, T, L, F, E = mc.d_model, mc.vocab_size, mc.seq_len, mc.n_layer, mc.ff, 4
    mlp_w, mlp_b = 2 * C * F, F + C
    attn_w, attn_b = C * 3 * C + C * C, 2 * C + 3 * C + C + 2 * C
    moe_layers = L // 2
    decay = V * C + T * C + L * attn_w + (L - moe_layers) * mlp_w + moe_layers * E * C
    dense = decay + L * attn_b + (L - moe_layers) * mlp_b + 2 * C
    local = dense + moe_layers * (E // 2) * (mlp_w + mlp_b)
    plan = planned(["engine=deepspeed", *ov, "+strategy=[ddp,bf16]", BF16_WEIGHTS, "parallel.ep=2"], 2)
    for rank in ("0", "1"):
        dev = plan[rank]["device"]
        data = dev["total"] - (20 * local + 4 * decay)
        assert 0 <= dev["other"] - data <= 16 * 1024, dev
