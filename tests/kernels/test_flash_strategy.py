"""+strategy=flash_attn in the model: loss parity with SDPA, O(N) activations, clear refusal."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from memopt.memory.tracker import MemoryTracker
from memopt.models.gpt import AttentionCore
from memopt.strategies.flash_attn import FlashCore
from tests.conftest import REPO, losses, train

TINY = ["model.n_layer=2", "model.seq_len=32", "model.d_model=64", "model.n_head=2", "trainer.micro_batch_size=2",
        "trainer.max_steps=4", "trainer.log_every=1", "trainer.eval_every=0", "optim.lr=3e-3"]


def _kernel_device() -> str:
    """Where the kernels run in this session: the CPU under Triton's interpreter (the default,
    conftest.py), CUDA when compiled (``TRITON_INTERPRET=0`` on a GPU machine); skip otherwise."""
    from memopt.kernels import flash_attn as fa

    if fa._kernels_interpreted():
        return "cpu"
    if not torch.cuda.is_available():
        pytest.skip("triton compiles the kernels (TRITON_INTERPRET=0) and no CUDA device is present")
    return "cuda"


def test_flash_follows_sdpa_trajectory(tmp_path):
    dev = [f"trainer.device={_kernel_device()}"]
    a, b = str(tmp_path / "sdpa"), str(tmp_path / "flash")
    train(TINY + dev, a)
    s = train(TINY + dev + ["+strategy=flash_attn"], b)
    assert s["strategy"] == ["flash_attn"]
    la, lb = losses(a), losses(b)
    # both are fp32 attention; they differ only in summation order (~1e-6 relative per op)
    assert max(abs(x - y) / y for x, y in zip(lb, la)) < 1e-4


def test_llama_gqa_flash_follows_sdpa_trajectory(tmp_path):
    """model=llama_tiny: 4 query heads on 2 key/value heads; the kernel gets k and v repeated to 4 heads
    (FlashCore), SDPA runs them grouped: the same attention, so the same trajectory."""
    dev = [f"trainer.device={_kernel_device()}"]
    llama = ["model=llama_tiny", "model.seq_len=32", "trainer.micro_batch_size=2", "trainer.max_steps=2",
             "trainer.log_every=1", "trainer.eval_every=0", "optim.lr=3e-3"]
    a, b = str(tmp_path / "sdpa"), str(tmp_path / "flash")
    train(llama + dev, a)
    train(llama + dev + ["+strategy=flash_attn"], b)
    la, lb = losses(a), losses(b)
    assert max(abs(x - y) / y for x, y in zip(lb, la)) < 1e-4


@pytest.mark.parametrize("impl, lo, hi", [("flash", 3.5, 4.5), ("naive", 6.0, 17.0)])
def test_tracker_sees_linear_attention_activations(impl, lo, hi):
    """Retained bytes of one attention core at N=64 and N=256 (head dim 32): x4 for the kernel,
    between x6 and x16 for the explicit score matrix (its O(N) terms weigh at N=64)."""
    core = FlashCore() if impl == "flash" else AttentionCore(impl, 0.0)
    dev = torch.device(_kernel_device() if impl == "flash" else "cpu")
    key = "cpu" if dev.type == "cpu" else f"cuda:{torch.cuda.current_device()}"

    def retained(n: int) -> int:
        g = torch.Generator().manual_seed(n)
        q, k, v = (torch.randn(1, 2, n, 32, generator=g).to(dev).requires_grad_() for _ in range(3))
        tr = MemoryTracker(dev)
        with tr:
            with tr.retained("activations"):
                out = core(q, k, v)
            kept = tr.live[key]["activations"]
        del out
        return kept

    ratio = retained(256) / retained(64)
    assert lo <= ratio <= hi, ratio


@pytest.mark.slow  # the same refusal runs through the CLI by default (tests/e2e/test_statuses.py)
def test_refused_without_cuda_or_interpreter(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=REPO, WANDB_MODE="offline")
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: the kernel runs, so there is nothing to refuse")
    proc = subprocess.run([sys.executable, "-m", "memopt.train", f"hydra.run.dir={tmp_path}/r", "logger=none",
                           "+strategy=flash_attn", "trainer.max_steps=1"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "flash_attn" in proc.stderr and "TRITON_INTERPRET=1" in proc.stderr
    with open(f"{tmp_path}/r/summary.json") as f:
        assert json.load(f)["status"] == "refused"


def test_bad_head_dim_is_refused():
    from memopt.errors import ConfigError
    from tests.conftest import typed

    with pytest.raises(ConfigError, match="head dims"):
        typed(["+strategy=flash_attn", "model.d_model=96", "model.n_head=4"])
