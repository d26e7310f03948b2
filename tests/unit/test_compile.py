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
