"""Tensor parallelism (+strategy=tp) against the plain single-process fp32 run of the same job.

Reference: the plain run on one process (no tp code at all) on the same seed and data. With
tp x dp on 4 ranks the reference sees the same micro-batches in the same grouping (micro-batch 2 x
grad_accum 2 on one rank = the two data-parallel ranks' micro-batch 2).

Tolerances (fp32): only the order of floating-point sums differs (a row-parallel layer sums two
partial products after its all-reduce instead of inside one matmul; the vocabulary-parallel loss
reduces max / sum-exp over ranks), so losses and gradient norms agree to 1e-5 relative (observed
~1e-7). Final weights: Adam's update m / sqrt(v) is ~lr in size whatever the gradient's magnitude,
so a component whose gradient is as small as the rounding differences can move differently by up to
lr per step; observed max |diff| 5e-6 after 3 steps at lr 3e-3; the bound is 2e-5 (a missing
reduction or a wrong shard gives differences of the order of lr x steps = 9e-3). fp16 / bf16: the suite's 5e-3 / 4e-2 (10 unit roundoffs, tests/unit/test_strategy_parity.py),
against the single process with the same precision strategy.

``optim.grad_clip`` is set low so clipping is active every step, and the logged gradient norm is
compared directly: it catches a split parameter counted once instead of summed over tp (or a
replicated one counted twice).
"""
from __future__ import annotations

import pytest
import torch

from memopt.api import run_job, run_jobs_on_ranks
from memopt.errors import ConfigError
from memopt.models.gpt import count_params
from tests.conftest import losses, typed

STEPS = 3
LR = 3e-3
BASE = ["model=gpt_tiny", "model.seq_len=64", f"trainer.max_steps={STEPS}", "trainer.log_every=1",
        "trainer.eval_every=0", f"optim.lr={LR}", "optim.warmup_steps=1", "optim.grad_clip=0.05", "logger=none",
        "trainer.progress_bar=false", "trainer.save_checkpoint=true", "trainer.micro_batch_size=2"]
TOL = {"fp32": 1e-5, "fp16": 5e-3, "bf16": 4e-2}
W_ATOL = 2e-5


def metric(run_dir: str, key: str) -> list[float]:
    import json
    import os

    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)[key] for line in f]


def rel_err(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def weights(run_dir: str) -> dict:
    return torch.load(f"{run_dir}/model.pt")["state_dict"]


def split_numel(cfg) -> int:
    """Elements of the parameters split over tp (Megatron's layout, from the shapes): the vocabulary
    rows (tied wte / lm_head) and per block qkv (weight, bias), attn.proj weight, mlp.fc (weight,
    bias), mlp.proj weight. LayerNorms, positions and the row-parallel biases are replicated."""
    m = cfg.model
    C, F, V, L = m.d_model, m.ff, m.vocab_size, m.n_layer
    return V * C + L * (3 * C * C + 3 * C + C * C + C * F + F + F * C)


def check_follows(run_dir: str, ref_dir: str, dtype: str = "fp32") -> None:
    got, ref = losses(run_dir), losses(ref_dir)
    assert len(got) == STEPS and rel_err(got, ref) <= TOL[dtype], (got, ref)
    if dtype == "fp32":
        gn, rn = metric(run_dir, "grad_norm"), metric(ref_dir, "grad_norm")
        assert rel_err(gn, rn) <= 1e-5, (gn, rn)
        assert min(rn) > 0.05  # clipping was active at every step
    if dtype == "fp32":  # bf16: a gradient's rounding (2^-8) can flip Adam's step of any element, losses only
        a, b = weights(run_dir), weights(ref_dir)
        assert a.keys() == b.keys()
        for k in b:
            assert a[k].shape == b[k].shape, k
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=W_ATOL, msg=k)


def test_tp2_with_sequence_parallel_follows_single_process(tmp_path):
    """tp=2 on 2 ranks (sequence parallelism, vocabulary-parallel loss, clipping) vs the plain run:
    losses, gradient norms and final weights; per-rank parameter bytes = replicated + split / 2;
    tokens and FLOPs counted once per data-parallel group (MFU per device = model FLOPs / world)."""
    tp = ["+strategy=tp", "parallel.tp=2", "strategy.tp.sequence_parallel=true", "strategy.tp.loss_parallel=true",
          "trainer.count_comm=true"]
    (s,) = run_jobs_on_ranks(2, [(BASE + tp, str(tmp_path / "tp"))])
    ref = run_job(BASE, str(tmp_path / "ref"))
    assert s["status"] == "ok" and s["parallel"]["tp"] == 2 and s["parallel"]["dp"] == 1
    check_follows(str(tmp_path / "tp"), str(tmp_path / "ref"))
    cfg = typed(BASE + tp + ["trainer.nproc_per_node=2"])
    want = 4 * (count_params(cfg.model) - split_numel(cfg) // 2)  # fp32, one rank's flat group (no padding at W=1)
    for rank in ("0", "1"):
        assert s["peak_bytes"][rank]["cpu"]["params"] == want, (rank, s["peak_bytes"][rank]["cpu"]["params"], want)
    assert s["tokens_per_step"] == ref["tokens_per_step"] == 2 * 64  # both tp ranks see the same tokens
    assert s["flops_per_token"] == ref["flops_per_token"]
    assert s["mfu"] == pytest.approx(s["tflops"] / (s["peak_tflops_per_device"] * 2))
    check_sequence_parallel_comm(s["comm_per_step"]["ops"], cfg)
    check_plan_against_run(cfg, s)


def planned_rank0(cfg) -> dict:
    """The planner's simulation of rank 0 (the rank whose collectives summary.json records)."""
    from memopt.planner.simulate import simulate_rank

    return simulate_rank(cfg, 0, 2)


def bus_bytes(ops: dict, n: int) -> int:
    """nccl-tests' bus bytes from payloads (``trainer.count_comm``'s convention: all-reduce and
    reduce-scatter count their input, all-gather its output): all-reduce x 2(n-1)/n, all-gather /
    reduce-scatter / all-to-all x (n-1)/n."""
    f = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
         "all_to_all": (n - 1) / n, "broadcast": 1.0}
    return sum(int(v["bytes"] * f[k]) for k, v in ops.items())


def executed_flops_per_token(cfg, tp: int, form: str) -> float:
    """One device's matmul FLOPs per token (forward 2 + backward 4 per weight element: Narayanan et
    al. 2021's accounting without its d_ff = 4C assumption), for B x T tokens of its data-parallel rank.
    GEMMs with the weights: qkv 3C^2, proj C^2, fc and proj 2 C F per block, the head V C; split over
    tp in both forms. Attention core: 4 C T per token forward (QK^T, AV) and 10 C T backward (torch's
    count for the fused kernel, which recomputes QK^T; the model's formula has 8, like checkpointing
    its recomputation is executed, not model FLOPs); split by heads in the all_reduce form, computed
    whole on every rank in the all_gather form (its attention runs on all-gathered q, k, v)."""
    m = cfg.model
    C, F, V, L, T = m.d_model, m.ff, m.vocab_size, m.n_layer, m.seq_len
    linear = 6 * (L * (4 * C * C + 2 * C * F) + V * C)
    attn = 14 * L * C * T
    return linear / tp + (attn / tp if form == "all_reduce" else attn)


def check_plan_against_run(cfg, s: dict, check_flops: bool = True) -> None:
    """The planner's simulated rank 0 communicates what the run's rank 0 measured in its first step
    (the same calls and payloads per kind; the plan's bus bytes are the payloads converted as
    nccl-tests do, with n = tp = 2), and computes the FLOPs the Megatron accounting gives one device."""
    from memopt.memory.hardware import HardwareConfig
    from memopt.planner.plan import step_time

    sim = planned_rank0(cfg)
    got, want = sim["comm_per_step"], s["comm_per_step"]
    assert {k: {"count": v["count"], "bytes": v["bytes"]} for k, v in got["ops"].items()} == want["ops"], (got, want)
    assert sim["traffic"]["comm_bytes"] == got["bus_bytes"] == bus_bytes(want["ops"], 2)
    hw = HardwareConfig(name="t", device_memory_gb=1, host_memory_gb=1, peak_tflops={"fp32": 1.0}, host_device_gbps=1.0,
                        device_device_gbps=1.0, devices_per_node=2, device_is_host=True)
    assert step_time(cfg, hw, sim)["comm_s"] == pytest.approx(bus_bytes(want["ops"], 2) / 1e9)
    if check_flops:
        t = cfg.trainer
        tokens = t.micro_batch_size * t.grad_accum * cfg.model.seq_len  # dp = 1: every rank sees the step's tokens
        assert sim["flops"] == executed_flops_per_token(cfg, 2, cfg.strategy.tp.form) * tokens


def check_sequence_parallel_comm(ops: dict, cfg) -> None:
    """One step's collectives (rank 0) against Korthikanti et al.'s sequence-parallel pattern, in bytes:
    each of the 2L+1 split regions (L attention, L MLP, the vocabulary-parallel head or embedding)
    all-gathers its (B, T, C) input and reduce-scatters its output, forward and backward (roles swapped);
    no activation is all-reduced. Besides: the positions' gradient all-gathered once (T, C), the
    LayerNorms' replicated weight and bias gradients all-reduced (2 x (2L+1) vectors of C), the
    vocabulary-parallel loss's 3 all-reduces of B x T values, and the gradient norm's two sums (split
    and replicated parts: ``tp_squared_norm``)."""
    m, B = cfg.model, cfg.trainer.micro_batch_size
    L, T, C, f = m.n_layer, m.seq_len, m.d_model, 4
    act, regions = B * T * C * f, 2 * m.n_layer + 1
    assert ops["reduce_scatter"] == {"count": 2 * regions, "bytes": 2 * regions * act}
    assert ops["all_gather"] == {"count": 2 * regions + 1, "bytes": 2 * regions * act + T * C * f}
    assert ops["all_reduce"] == {"count": 2 * (2 * L + 1) + 3 + 1, "bytes": 2 * (2 * L + 1) * C * f + 3 * B * T * f + 2 * f}


REFUSED = {
    "heads": (["model.n_head=3", "model.d_model=96"], "model.n_head=3 is not divisible by parallel.tp=2.*no tp > 1 divides it "
              "and the world size 2: make model.n_head a multiple of 2"),  # it had offered "a tp among []"
    "d_ff": (["model.d_ff=129"], "model.d_ff=129 is not divisible by parallel.tp=2"),
    "vocab": (["model.vocab_size=257"], "model.vocab_size=257 is not divisible by parallel.tp=2"),
    "world": (["parallel.tp=3"], "does not divide the world size 2"),
    "moe": (["+strategy=[tp,moe]"], "strategies tp and moe are mutually exclusive"),
    "deepspeed": (["engine=deepspeed", "+strategy=[tp,zero2]"], "parallel.tp=2 is not supported by DeepSpeed"),
    "chunk": (["+strategy=[tp,chunk]"], "parallel.tp=2 is not supported by"),
    "fsdp2_no_dp": (["engine=fsdp2", "+strategy=[tp,zero3]"], "needs parallel.dp_shard >= 2"),
    "sp_all_gather": (["strategy.tp.form=all_gather", "strategy.tp.sequence_parallel=true"], "needs strategy.tp.form=all_reduce"),
    "dropout": (["model.dropout=0.1"], "model.dropout=0.1 with strategy tp is not built"),
    "chunked_loss": (["+strategy=[tp,chunked_loss]"], "strategies tp and chunked_loss are mutually exclusive"),
}


SLOW_REFUSALS = {"vocab", "deepspeed", "chunk", "sp_all_gather", "dropout", "chunked_loss"}  # the same checks' other fields


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_REFUSALS else n for n in REFUSED])
def test_refused_before_allocation(name):
    extra, msg = REFUSED[name]
    strategy = [] if any(e.startswith("+strategy") for e in extra) else ["+strategy=tp"]
    with pytest.raises(ConfigError, match=msg.replace("[", r"\[").replace("(", r"\(")):
        typed(["model=gpt_tiny", "trainer.nproc_per_node=2", "parallel.tp=2", *strategy, *extra])


@pytest.mark.slow
def test_tp_without_tp_dimension_refused():
    with pytest.raises(ConfigError, match="strategy tp needs parallel.tp >= 2"):
        typed(["model=gpt_tiny", "trainer.nproc_per_node=2", "+strategy=tp"])


# ---- slow: the matrix ------------------------------------------------------------------------------
TWO = {  # 2 ranks, tp=2: name -> (tp run's overrides, reference's overrides, dtype)
    "megatron": (["+strategy=tp"], [], "fp32"),
    "all_gather": (["+strategy=tp", "strategy.tp.form=all_gather"], [], "fp32"),
    "sp_ckpt": (["+strategy=[tp,ckpt]", "strategy.tp.sequence_parallel=true"], [], "fp32"),
    "ckpt_act_offload": (["+strategy=[tp,ckpt,act_offload]"], [], "fp32"),
    "loss_parallel_accum": (["+strategy=tp", "strategy.tp.loss_parallel=true", "trainer.grad_accum=2"],
                            ["trainer.grad_accum=2"], "fp32"),
    "bf16_sp": (["+strategy=[tp,bf16]", "strategy.tp.sequence_parallel=true"], ["+strategy=bf16"], "bf16"),
    "fp16": (["+strategy=[tp,fp16]"], ["+strategy=fp16"], "fp16"),
}
FOUR = {  # 4 ranks, tp=2 x dp_shard=2
    "ddp": ["+strategy=[tp,ddp]"],
    "zero1": ["+strategy=[tp,zero1]"],
    "zero2_sp": ["+strategy=[tp,zero2]", "strategy.tp.sequence_parallel=true", "strategy.zero2.bucket_mb=0.05"],
    "zero3": ["+strategy=[tp,zero3]"],
    "fsdp2_zero2": ["engine=fsdp2", "+strategy=[tp,zero2]", "strategy.tp.sequence_parallel=true"],
    "fsdp2_zero3_lp": ["engine=fsdp2", "+strategy=[tp,zero3]", "strategy.tp.loss_parallel=true"],
    "zero3_ckpt_sp": ["+strategy=[tp,zero3,ckpt]", "strategy.tp.sequence_parallel=true"],
}


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp2")
    out = run_jobs_on_ranks(2, [(BASE + ["parallel.tp=2", "trainer.count_comm=true", *j], str(root / n))
                                for n, (j, _, _) in TWO.items()])
    refs = {}
    for n, (_, r, _) in TWO.items():
        if tuple(r) not in refs:
            refs[tuple(r)] = str(root / f"ref_{n}")
            run_job(BASE + r, refs[tuple(r)])
    return {n: (s, str(root / n), refs[tuple(TWO[n][1])]) for n, s in zip(TWO, out)}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TWO))
def test_tp2_matrix_follows_single_process(two, name):
    s, run_dir, ref_dir = two[name]
    assert s["status"] == "ok" and s["parallel"]["tp"] == 2
    check_follows(run_dir, ref_dir, TWO[name][2])


PLANNED = {"megatron": True, "all_gather": True, "sp_ckpt": False, "loss_parallel_accum": True}  # name -> FLOPs checked
# (checkpointing's recomputation is executed: sp_ckpt checks the traffic, which includes its re-gathers)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANNED))
def test_tp2_plan_traffic_and_flops_equal_the_run(two, name):
    s, _, _ = two[name]
    cfg = typed(BASE + ["parallel.tp=2", *TWO[name][0], "trainer.nproc_per_node=2"])
    check_plan_against_run(cfg, s, check_flops=PLANNED[name])


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp4")
    out = run_jobs_on_ranks(4, [(BASE + ["parallel.tp=2", *j], str(root / n)) for n, j in FOUR.items()])
    run_job(BASE + ["trainer.grad_accum=2"], str(root / "ref"))
    return {n: (s, str(root / n)) for n, s in zip(FOUR, out)}, str(root / "ref")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FOUR))
def test_tp2_x_dp2_follows_single_process(four, name):
    runs, ref_dir = four
    s, run_dir = runs[name]
    assert s["status"] == "ok" and s["parallel"]["tp"] == 2 and s["parallel"]["dp_shard"] == 2
    check_follows(run_dir, ref_dir)


# ---- slow: activations of one block (Korthikanti et al.'s terms, for what autograd keeps here) ------
# Per token, in units of C fp32 values, a block keeps: ln1 input 1, ln1 output (qkv input) 1, q k v 3,
# attention output (= proj input: sdpa's output is laid out so that the transpose back is contiguous)
# 1, ln2 input 1, ln2 output (fc input) 1, fc output 4, GELU output 4 = 16 (no dropout masks; sdpa keeps
# no T x T scores), plus LayerNorm statistics and sdpa's log-sum-exp (a few values per token: the 3%).
# Tensor parallelism splits the 12 inside the attention and MLP regions (4 + 12/t); sequence
# parallelism also splits the LayerNorm inputs, but the column-parallel layers keep their all-gathered
# (B, T, C) inputs (DTensor's matmul saves its input; Megatron re-gathers it in the backward): 2 + 14/t.
PER_BLOCK = {"single": 16.0, "tp": 4 + 12 / 2, "tp_sp": 2 + 14 / 2}
ACT = ["model=gpt_tiny", "model.seq_len=64", "trainer.max_steps=1", "trainer.eval_every=0", "logger=none",
       "trainer.progress_bar=false", "trainer.save_checkpoint=false", "trainer.micro_batch_size=2"]


@pytest.mark.slow
def test_activations_of_a_block_split_as_predicted(tmp_path):
    tp = {"tp": ["+strategy=tp", "parallel.tp=2"],
          "tp_sp": ["+strategy=tp", "parallel.tp=2", "strategy.tp.sequence_parallel=true"]}
    jobs = [(ACT + [f"model.n_layer={L}"] + o, str(tmp_path / f"{n}{L}")) for n, o in tp.items() for L in (1, 2)]
    out = dict(zip([f"{n}{L}" for n in tp for L in (1, 2)], run_jobs_on_ranks(2, jobs)))
    for L in (1, 2):
        out[f"single{L}"] = run_job(ACT + [f"model.n_layer={L}"], str(tmp_path / f"single{L}"))
    unit = 4 * 128 * 2 * 64  # C fp32 values for each of the B x T tokens
    for name, want in PER_BLOCK.items():
        act = [out[f"{name}{L}"]["peak_bytes"]["0"]["cpu"]["activations"] for L in (1, 2)]
        got = (act[1] - act[0]) / unit
        assert got == pytest.approx(want, rel=0.03), (name, got, want)  # LayerNorm statistics, sdpa's logsumexp


@pytest.mark.slow  # 8 s on an AVX2 CPU; tp=2 parity stays in the default suite (gpt with sequence parallelism)
def test_llama_tp2_splits_grouped_query_heads_and_follows_single_process(tmp_path):
    """Llama (grouped-query attention: 4 query heads sharing 2 key/value heads, SwiGLU, RMSNorm, rope)
    at tp=2, Megatron's form with sequence parallelism and the vocabulary-parallel loss, and the
    all-gather form: each rank holds its 2 query heads' key/value head, its halves of gate/up and of
    down's columns; the plain single-process run is the reference (losses, gradient norms, weights)."""
    llama = [o.replace("model=gpt_tiny", "model=llama_tiny") for o in BASE]
    forms = {"sp": ["strategy.tp.sequence_parallel=true", "strategy.tp.loss_parallel=true"],
             "ag": ["strategy.tp.form=all_gather"]}
    out = run_jobs_on_ranks(2, [([*llama, "+strategy=tp", "parallel.tp=2", *extra], str(tmp_path / n))
                                for n, extra in forms.items()])
    run_job(llama, str(tmp_path / "ref"))
    assert all(s["status"] == "ok" and s["parallel"]["tp"] == 2 for s in out)
    for n in forms:
        check_follows(str(tmp_path / n), str(tmp_path / "ref"))
    m = typed([*llama, "+strategy=tp", "parallel.tp=2", "trainer.nproc_per_node=2"]).model
    C, F, D = m.d_model, m.ff, m.head_dim
    split = m.vocab_size * C * 2 + m.n_layer * (C * (m.n_head + 2 * m.kv_heads) * D + m.n_head * D * C + 3 * C * F)
    replicated = m.n_layer * 2 * C + C  # RMSNorm weights
    assert out[0]["peak_bytes"]["0"]["cpu"]["params"] == 4 * (replicated + split // 2)


def test_llama_tp_needs_the_key_value_heads_divisible():
    with pytest.raises(ConfigError, match=r"model.n_kv_head=2 is not divisible by parallel.tp=4"):
        typed(["model=llama_tiny", "+strategy=tp", "parallel.tp=4", "trainer.nproc_per_node=4"])
