"""The chunk engine changes where bytes live, never the math: its loss trajectories follow the
memopt engine's for the same job (same seed, data and precision).

Tolerances (relative, per step, 6 steps of gpt_tiny at lr 3e-3):
- fp32: 1e-5, as test_strategy_parity's fp32 strategies. The forward/backward ops are the same; the
  only difference is the Adam kernel for host-side chunks (CPUAdamW's FMA sequence vs
  torch._fused_adamw_), i.e. one fp32 rounding per update (observed ~1e-7).
- fp16: 5e-3 (10 unit roundoffs, as test_strategy_parity); fp16 weights/grads are rounded exactly as
  in the memopt engine, so the observed gap (~4e-5) is again the Adam kernel's fp32 rounding,
  amplified by fp16 re-rounding of the weights.
- bf16: 4e-2 (10 unit roundoffs).
Small device budgets force evictions during forward, backward and recomputation: the trajectory must
not move (eviction is a copy to the host and back).
"""
from __future__ import annotations

import pytest

from tests.conftest import cases, losses, train

STEPS = 6
BASE = ["model=gpt_tiny", "model.seq_len=64", f"trainer.max_steps={STEPS}", "trainer.log_every=1", "trainer.eval_every=0",
        "trainer.micro_batch_size=4", "optim.lr=3e-3", "optim.warmup_steps=2"]
TOL = {"fp32": 1e-5, "fp16": 5e-3, "bf16": 4e-2}
FP16 = ["strategy.fp16.init_scale=1024"]
BF16 = ["strategy.bf16.params=bf16"]


def tight(mib: float) -> list[str]:
    """A device budget of ``mib`` MiB: chosen per case to leave 1/3 to 1/2 of gpt_tiny's param+grad
    chunks (6.8 MiB fp32, 3.4 MiB fp16 with a gradient companion; half that when gradients reuse the
    parameter chunks, grad_accum 1) next to that case's measured non-model peak (9.7 MiB plain, 4.1
    ckpt, 3.6 ckpt+act_offload, 5.3 with 2 micro-steps of 2, 1.3 fp16+ckpt+act_offload); static
    partition: its budget, 0.3 x that, about half of the param chunks (3.3 MiB fp32, 1.7 fp16)."""
    return [f"strategy.chunk.device_budget_gb={mib / 1024}", "strategy.chunk.warmup_gpu_chunk_mem_ratio=0.3"]


REFS = {"fp32": [], "fp16": ["+strategy=fp16", *FP16], "bf16": ["+strategy=bf16", *BF16]}
CASES = {
    "chunk": (["+strategy=chunk"], "fp32"),
    "chunk_tight": (["+strategy=chunk", *tight(12)], "fp32"),
    # the loss recomputes the logits from the tied weight in its backward: the head's chunk is fetched again
    "chunk_chunked_loss_tight": (["+strategy=[chunk,chunked_loss]", "strategy.chunked_loss.chunk_tokens=64", *tight(12)], "fp32"),
    "chunk_ckpt_tight": (["+strategy=[chunk,ckpt]", *tight(7)], "fp32"),
    "chunk_ckpt_act_offload_tight": (["+strategy=[chunk,ckpt,act_offload]", *tight(6.5)], "fp32"),
    "chunk_grad_accum_tight": (["+strategy=chunk", "trainer.micro_batch_size=2", "trainer.grad_accum=2", *tight(8)], "fp32"),
    "static_partition_tight": (["+strategy=static_partition", *tight(6)], "fp32"),
    "hybrid_adam_fp32_split": (["+strategy=hybrid_adam_fp32", "strategy.hybrid_adam.max_device_chunks=1"], "fp32"),
    "chunk_fp16": (["+strategy=[chunk,fp16]", *FP16], "fp16"),
    "hybrid_adam": (["+strategy=hybrid_adam", *FP16], "fp16"),
    "hybrid_adam_ckpt_offload_accum_tight": (["+strategy=[hybrid_adam,ckpt,act_offload]", *FP16, *tight(3),
                                              "trainer.micro_batch_size=2", "trainer.grad_accum=2"], "fp16"),
    "static_hybrid_fp16_tight": (["+strategy=[static_partition,hybrid_adam]", *FP16, *tight(3)], "fp16"),
    "chunk_bf16": (["+strategy=[chunk,bf16]", *BF16], "bf16"),
    "hybrid_adam_bf16_ckpt_tight": (["+strategy=[hybrid_adam_bf16,ckpt]", *tight(5)], "bf16"),
}


# the default suite keeps each partition, budget, accumulation and precision once; the combinations are slow
SLOW_CASES = {"chunk_ckpt_act_offload_tight", "hybrid_adam_fp32_split", "hybrid_adam_ckpt_offload_accum_tight",
              "static_hybrid_fp16_tight", "hybrid_adam_bf16_ckpt_tight"}


def rel_err(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chunk_refs")
    out = {}
    for name, extra in REFS.items():
        d = str(root / name)
        assert train(BASE + extra, d)["status"] == "ok"
        out[name] = losses(d)
    assert out["fp32"][-1] < out["fp32"][0] - 0.5  # it really learns
    return out


@pytest.mark.parametrize("name", cases(CASES, SLOW_CASES))
def test_chunk_follows_memopt_trajectory(refs, tmp_path, monkeypatch, name):
    from tests.chunk.helpers import train_capture

    extra, dtype = CASES[name]
    summary, engine = train_capture(BASE + extra, str(tmp_path / "r"), monkeypatch)
    assert summary["status"] == "ok"
    got = losses(str(tmp_path / "r"))
    assert len(got) == STEPS
    err = rel_err(got, refs[dtype])
    assert err <= TOL[dtype], f"{name}: max relative loss error {err:.2e} > {TOL[dtype]:.0e}"
    if "tight" in name:
        assert engine.step_metrics()["evictions"] > 0, "the tight budget should force evictions"
    if "split" in name:  # Adam on both sides: one optimizer group on the device, the rest on the host
        assert engine.step_metrics()["optim_chunks_on_device"] == 1
