"""``strategy.zero2|zero3.grad_dtype``: with bf16 parameters on 2 ranks, ``param`` keeps each rank's
gradient shard at the ZeRO paper's 2 bytes per parameter / W (Rajbhandari et al. 2020, section 5),
``fp32`` at 4 / W; with one micro-batch per step the two are the same math (the reduce-scatter runs
in bf16 either way), so their loss trajectories are identical."""
from __future__ import annotations

import json
import os

import pytest

from memopt.api import run_jobs_on_ranks
from memopt.errors import ConfigError
from memopt.models.gpt import GPTConfig, count_params
from tests.conftest import typed

W, T, BUCKET_MB = 2, 32, 0.25
BASE = ["model=gpt_tiny", f"model.seq_len={T}", "data=synthetic", "trainer.max_steps=2", "trainer.log_every=1",
        "trainer.micro_batch_size=1", "trainer.eval_every=0", "logger=none", "trainer.progress_bar=false",
        "trainer.save_checkpoint=false", "+strategy=[bf16,zero2]", "strategy.bf16.params=bf16",
        f"strategy.zero2.bucket_mb={BUCKET_MB}"]


@pytest.mark.slow  # 13 s of 2-rank bf16 on AVX2-only CPUs
def test_param_dtype_gradients_are_the_papers_bytes(tmp_path):
    jobs = {gd: BASE + [f"strategy.zero2.grad_dtype={gd}"] for gd in ("param", "fp32")}
    out = dict(zip(jobs, run_jobs_on_ranks(W, [(o, str(tmp_path / gd)) for gd, o in jobs.items()])))
    n = count_params(GPTConfig(n_layer=4, n_head=4, d_model=128, seq_len=T, vocab_size=256))
    largest = 256 * 128  # the tied embedding
    inflight = BUCKET_MB * 2**20 + 2 * largest  # one bucket's bf16 gradients before its reduce-scatter
    for rank in ("0", "1"):
        param = out["param"]["peak_bytes"][rank]["cpu"]["grads"]
        fp32 = out["fp32"]["peak_bytes"][rank]["cpu"]["grads"]
        assert 2 * n / W <= param <= 2 * n / W + inflight, (param, 2 * n / W, inflight)
        assert fp32 >= 4 * n / W, (fp32, 4 * n / W)
    losses = {}
    for gd in jobs:
        with open(os.path.join(tmp_path / gd, "metrics.jsonl")) as f:
            losses[gd] = [json.loads(line)["loss"] for line in f]
    assert len(losses["param"]) == 2 and losses["param"] == losses["fp32"], losses


def test_unknown_grad_dtype_and_other_engines_are_refused():
    with pytest.raises(ConfigError, match="strategy.zero3.grad_dtype='bf16' is not one of: fp32, param"):
        typed(["+strategy=zero3", "strategy.zero3.grad_dtype=bf16"])
    with pytest.raises(ConfigError, match="strategy.zero2.grad_dtype='param' is built for engine=memopt only"):
        typed(["engine=fsdp2", "+strategy=zero2", "strategy.zero2.grad_dtype=param"])
