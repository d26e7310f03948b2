"""+strategy=compile: refusals before anything is built, and compile inside a checkpoint (the tracker
still counts the compiled region's saved tensors through the checkpoint's hooks). The parity with the
eager fp32 run and the bytes the rematerialization saves are checked in
``test_strategy_effects.py::check_compile``; the other compositions are in the slow suite here."""
from __future__ import annotations

import pytest

from memopt.errors import ConfigError
from tests.conftest import losses, train, typed

B, T, C, L = 2, 64, 64, 2
SMALL = ["model=gpt_tiny", f"model.n_layer={L}", f"model.seq_len={T}", f"model.d_model={C}", "model.n_head=2",
         "data=synthetic", "trainer.max_steps=3", "trainer.eval_every=0", "trainer.log_every=1",
         f"trainer.micro_batch_size={B}"]


def rel(a, b) -> float:
    assert len(a) == len(b) > 0
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("overrides, names", [
    (["+strategy=[flash_attn,compile]"], ["flash_attn", "Triton", "sdpa"]),
    (["+strategy=compile", "trainer.mode=plan"], ["not planned", "without +strategy=compile", "trainer.mode=train"]),
    (["+strategy=compile", "strategy.compile.remat=all"], ["strategy.compile.remat='all'", "pointwise"]),
    (["+strategy=compile", "strategy.compile.mode=fast"], ["strategy.compile.mode='fast'", "default"]),
    (["+strategy=compile", "strategy.compile.mode=reduce-overhead"], ["CUDA graphs", "mode=default"]),
])
def test_compile_refuses_what_it_cannot_do_naming_the_way_out(overrides, names):
    with pytest.raises(ConfigError) as e:
        typed(overrides)
    for n in names:
        assert n in str(e.value)


def test_compile_inside_full_checkpointing_keeps_one_block_fewer_pointwise_outputs(tmp_path):
    """Under ckpt=full the peak is the block inputs plus one recomputed block's saved tensors; compiled,
    that block keeps its two LayerNorm outputs (B T C) and GELU output (B T 4C) fewer."""
    ck = train(SMALL + ["+strategy=ckpt"], str(tmp_path / "ckpt"))
    cc = train(SMALL + ["+strategy=[ckpt,compile]"], str(tmp_path / "ckpt_compile"))
    assert ck["status"] == cc["status"] == "ok"
    assert rel(losses(str(tmp_path / "ckpt_compile")), losses(str(tmp_path / "ckpt"))) < 1e-5

    def act(s):
        return s["peak_bytes"]["0"]["cpu"]["activations"]
    assert act(ck) - act(cc) == (C + C + 4 * C) * B * T * 4


@pytest.mark.parametrize("overrides, names", [
    (["+strategy=[chunk,compile]"], ["chunk engine", "hooks on every Linear", "zero3"]),
    (["engine=deepspeed", "+strategy=[zero3,compile]"], ["every sub-module", "engine=fsdp2"]),
])
def test_compile_refuses_engines_whose_hooks_break_the_block(overrides, names):
    with pytest.raises(ConfigError) as e:
        typed(overrides)
    for n in names:
        assert n in str(e.value)


TWO_RANK = {"zero1": ["+strategy=zero1"], "zero3": ["+strategy=zero3"], "fsdp2": ["engine=fsdp2", "+strategy=zero3"],
            "deepspeed": ["engine=deepspeed", "+strategy=zero2"], "tp": ["parallel.tp=2", "+strategy=tp"]}


@pytest.mark.slow
def test_compile_composes_with_zero_fsdp2_deepspeed_and_tp_on_two_ranks(tmp_path):
    """Each engine's run with and without compile: the same losses, and each rank keeps the point-wise
    outputs of every block fewer (the block hooks of ZeRO-3 and FSDP2 stay outside the graph; under
    tp a rank's GELU output has 4C/2 columns, the LayerNorm outputs all C)."""
    from memopt.api import run_jobs_on_ranks

    jobs, names = [], []
    for name, extra in TWO_RANK.items():
        plus = [o for o in extra if o.startswith("+strategy=")][0]
        with_compile = [o for o in extra if o != plus] + [f"+strategy=[{plus.split('=')[1]},compile]"]
        for tag, ov in (("eager", extra), ("compile", with_compile)):
            jobs.append((SMALL + ov + ["logger=none", "trainer.progress_bar=false", "trainer.save_checkpoint=false"],
                         str(tmp_path / f"{name}_{tag}")))
            names.append(f"{name}_{tag}")
    out = dict(zip(names, run_jobs_on_ranks(2, jobs)))
    for name in TWO_RANK:
        e, c = out[f"{name}_eager"], out[f"{name}_compile"]
        assert e["status"] == c["status"] == "ok", (name, e, c)
        assert rel(losses(str(tmp_path / f"{name}_compile")), losses(str(tmp_path / f"{name}_eager"))) < 1e-5, name
        gelu = 4 * C // 2 if name == "tp" else 4 * C
        want = L * (C + C + gelu) * B * T * 4
        # known (docs/design.md, "Compile"): under FSDP2 and tp a rank, at random, counts one buffer more as
        # activations, in the eager run as in the compiled one (FSDP2: one block's gathered weights; tp: B T 4C
        # fp32), so eager - compile is the formula, or off by that buffer either way
        extra = {"fsdp2": 4 * _block_numel(), "tp": B * T * 4 * C * 4}.get(name, 0)
        for rank in ("0", "1"):
            act = [s["peak_bytes"][rank]["cpu"]["activations"] for s in (e, c)]
            assert act[0] - act[1] - want in {-extra, 0, extra}, (name, rank, act, want)


def _block_numel() -> int:
    """One GPT block's parameters at the SMALL shape, from the model's own shapes (on meta)."""
    import torch

    from memopt.models.gpt import GPT

    with torch.device("meta"):
        return sum(p.numel() for p in GPT(typed(SMALL).model).blocks[0].parameters())
