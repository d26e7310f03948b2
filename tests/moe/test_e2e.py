"""``+strategy=moe`` through ``memopt.api.run_job``: per-step routing metrics in the run record, the
summary's parameter and FLOP counts from the composed model, and the router losses reaching the
gradients (a run without them follows another trajectory) while the logged loss is the LM loss."""
from __future__ import annotations

import json
import os

import pytest

from memopt import compose
from tests.conftest import train, typed

BASE = ["model=moe_tiny", "model.seq_len=32", "trainer.max_steps=2", "trainer.log_every=1", "trainer.eval_every=0",
        "trainer.micro_batch_size=2", "trainer.grad_accum=2", "optim.lr=3e-3", "optim.warmup_steps=0"]


def records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_run_records_routing_metrics_and_active_flops(tmp_path):
    s = train(BASE + ["trainer.save_checkpoint=true", "trainer.eval_every=2"], str(tmp_path / "moe"))
    assert s["status"] == "ok"
    cfg = typed(BASE)
    assert s["params"] == compose.num_params(cfg)
    assert s["flops_per_token"] == compose.flops_per_token(cfg)
    assert s["active_params"] == compose.active_params(cfg) < s["params"]
    recs = records(str(tmp_path / "moe"))
    assert len(recs) == 2
    for r in recs:
        m = r["moe"]
        assert set(m) == {"aux_loss", "z_loss", "dropped_frac", "load"}
        assert m["aux_loss"] > 0
        assert 0.0 <= m["dropped_frac"] < 1.0 and m["z_loss"] > 0
        assert set(m["load"]) == {"block1", "block3"}
        for load in m["load"].values():
            assert set(load) == {"e0", "e1", "e2", "e3"} and sum(load.values()) == pytest.approx(1.0)

    off = train(BASE + ["strategy.moe.aux_loss_coef=0", "strategy.moe.z_loss_coef=0"], str(tmp_path / "off"))
    got, ref = [r["loss"] for r in recs], [r["loss"] for r in records(str(tmp_path / "off"))]
    assert got[0] == ref[0]  # step 0: same weights, and the logged loss is the LM loss alone
    assert got[-1] != ref[-1]  # the router losses changed the gradients
    assert off["status"] == "ok"

    # model.pt records the MoE options: memopt.load_model rebuilds the layers and evaluates the held-out
    # batches to the loss the engine measured at the last step (a fresh model object, eval capacity)
    import torch

    import memopt
    from memopt.data import TokenBatches, load_tokens

    model = memopt.load_model(str(tmp_path / "moe"))
    assert sum(p.numel() for p in model.parameters()) == s["params"]
    data = TokenBatches(load_tokens(cfg.data, cfg.seed), cfg.model.seq_len, cfg.data.val_fraction, cfg.seed)
    with torch.no_grad():
        val = [model(x, y)[1].item() for x, y in data.eval_batches(cfg.trainer.eval_batches, cfg.trainer.micro_batch_size)]
    assert sum(val) / len(val) == pytest.approx(s["val_loss"], rel=1e-6)

