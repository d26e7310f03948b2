"""Checkpointing under bf16 autocast frees the compute-dtype weight copies of the blocks it checkpoints.

Autocast's weight cache would keep the bf16 copy of every fp32 parameter a forward used until the forward
ends: 2 B per block parameter for the whole model, whatever ckpt recomputes (and under ZeRO-3, whose
parameters are gathered one layer at a time, a compute-dtype copy of the whole model per rank). The
reference is the model's own shapes: the bf16 copies of every block's weights."""
from __future__ import annotations

from tests.conftest import train

# weights dominate: 8 blocks of width 256 (6.3M block parameters), 16 tokens a step
SHAPE = ["model=gpt_tiny", "model.d_model=256", "model.n_head=4", "model.n_layer=8", "model.seq_len=16",
         "model.vocab_size=512", "trainer.micro_batch_size=1", "trainer.max_steps=1", "trainer.eval_every=0",
         "data=synthetic", "data.synthetic_tokens=4000"]


def test_ckpt_under_bf16_autocast_holds_no_copy_of_every_block(tmp_path):
    s = train([*SHAPE, "+strategy=[bf16,ckpt]"], str(tmp_path / "run"))
    assert s["status"] == "ok"
    block_params = 8 * (12 * 256 * 256 + 13 * 256)  # qkv, proj, fc, fc2 weights and biases, two LayerNorms
    copies = 2 * block_params  # bf16 copies of every block's weights, what the cache would hold
    act = s["peak_bytes"]["0"]["cpu"]["activations"]
    # one block's copies (recomputed in its backward) and the checkpoints, not all eight blocks' copies
    assert act < copies / 2, (act, copies)
