"""The device budget holds, dynamic partition beats static, Hybrid Adam uses the margin, and a
budget that cannot hold a moment's chunks fails with a diagnosis (status ``oom``).

gpt_tiny with seq_len 32 and micro-batch 2 in fp32: 13 chunks of 66560 elements (the searched
size), 3.3 MiB of param chunks (the gradients are written over them) and 9.9 MiB of optimizer
chunks, next to ~3 MiB of non-model memory. A 6 MiB device budget is well below the model's
13.2 MiB of chunks.
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from tests.chunk.helpers import train_capture
from tests.conftest import train

MiB = 2**20
BASE = ["model=gpt_tiny", "model.seq_len=32", "trainer.max_steps=4", "trainer.log_every=1", "trainer.eval_every=0",
        "trainer.micro_batch_size=2", "optim.lr=3e-3", "optim.warmup_steps=2"]
D_MIB = 6
BUDGET = [f"strategy.chunk.device_budget_gb={D_MIB / 1024}", "strategy.chunk.warmup_gpu_chunk_mem_ratio=0.4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("budget")
    out = {}
    for name, extra in {"dynamic": ["+strategy=chunk"], "static": ["+strategy=static_partition"]}.items():
        out[name] = train_capture(BASE + extra + BUDGET, str(root / name), mp)
    mp.undo()
    return out


@pytest.mark.parametrize("name", ["dynamic", "static"])
def test_device_chunk_bytes_never_exceed_the_budget(runs, name):
    summary, engine = runs[name]
    assert summary["status"] == "ok"
    D = D_MIB * MiB
    model_chunk_bytes = sum(c.payload_bytes * 2 for c in engine.mgr.chunks) + sum(
        o.payload_bytes for g in engine.optimizer.groups for o in g[1:])
    assert model_chunk_bytes > 2.5 * D  # the budget is well below the model's chunks
    peaks = summary["peak_bytes"]["0"]["cpu"]
    # measured by the tracker (independent of the engine's own accounting), over the whole run
    limit = int(0.4 * D) if name == "static" else D
    assert 0 < peaks["chunks"] <= limit
    assert peaks["chunks"] == engine.mgr.peak_device_bytes  # the engine's accounting is the tracker's
    if name == "dynamic":
        # the warm-up trace sees every allocation, so chunks + non-model memory stay within D too
        assert peaks["total"] <= D
    assert engine.step_metrics()["evictions"] > 0
    assert summary["peak_bytes"]["0"]["host"]["chunks"] > 0  # optimizer chunks (and evicted params) on the host


def test_dynamic_keeps_more_chunks_on_device_than_static(runs):
    dyn, stat = runs["dynamic"][1].history, runs["static"][1].history
    # steady state: after warm-up (step 0) and the first traced step
    d = sum(h["mean_chunks_on_device"] for h in dyn[2:]) / len(dyn[2:])
    s = sum(h["mean_chunks_on_device"] for h in stat[2:]) / len(stat[2:])
    assert d > s + 1, (d, s)
    moves_d = dyn[-1]["fetches"] - dyn[1]["fetches"]
    moves_s = stat[-1]["fetches"] - stat[1]["fetches"]
    assert moves_d < moves_s  # fewer host->device transfers per step


@pytest.mark.slow  # 19 s; Hybrid Adam's parity runs by default (tests/chunk/test_chunk_parity.py)
def test_hybrid_adam_puts_optimizer_chunks_in_the_margin(tmp_path, monkeypatch):
    # 9 MiB: fp16 param chunks (1.7 MiB, gradients written over them) + non-model (~3 MiB) leave a margin
    # of ~4 optimizer groups
    budget = [f"strategy.chunk.device_budget_gb={9 / 1024}", "strategy.chunk.warmup_gpu_chunk_mem_ratio=0.4"]
    summary, engine = train_capture(BASE + ["+strategy=hybrid_adam", "strategy.fp16.init_scale=1024", *budget],
                                    str(tmp_path / "h"), monkeypatch)
    assert summary["status"] == "ok"
    opt, mgr = engine.optimizer, engine.mgr
    n = opt.device_groups
    assert 0 < n < len(opt.groups)  # some on the device, the rest on the host
    D = 9 * MiB
    margin = D - mgr.tracer.max_nonmodel - sum(c.payload_bytes for c in mgr.chunks)  # no gradient bytes of their own
    assert n == int(0.8 * margin) // opt.group_bytes
    assert summary["peak_bytes"]["0"]["cpu"]["chunks"] <= D
    # the same job without hybrid_adam keeps every optimizer chunk on the host
    _, plain = train_capture(BASE + ["+strategy=[chunk,fp16]", "strategy.fp16.init_scale=1024", *budget],
                             str(tmp_path / "p"), monkeypatch)
    assert plain.optimizer.device_groups == 0


def test_step_metrics_report_placement(runs):
    m = runs["dynamic"][1].step_metrics()
    for key in ("chunks_on_device", "chunk_bytes_device", "chunk_bytes_host", "evictions", "fetches",
                "optim_chunks_on_device", "mean_chunks_on_device", "chunk_size"):
        assert key in m
    json.dumps(m)  # loggable as a metrics.jsonl field
    assert m["chunk_bytes_device"] <= D_MIB * MiB and not m["warmup"]


def test_too_small_budget_is_an_oom_with_a_diagnosis(tmp_path):
    d = str(tmp_path / "oom")
    with pytest.raises(torch.OutOfMemoryError) as e:
        train(BASE + ["+strategy=chunk", "strategy.chunk.device_budget_gb=0.001", "strategy.chunk.warmup_gpu_chunk_mem_ratio=0.1"], d)
    msg = str(e.value)
    assert "out of memory" in msg and "forward of wte" in msg  # the moment: the first module's forward
    assert "104857" in msg or "107374" in msg  # the budget in bytes (0.1 x 1 MiB-ish)
    assert "266240 B" in msg  # the bytes needed: one fp32 chunk of 66560 elements
    assert "warmup_gpu_chunk_mem_ratio" in msg  # and the fix
    assert f"at least {math.ceil(100 * 266240 / (0.001 * 2**30)) / 100:.2f}" in msg  # the ratio that holds this moment's chunk
    with open(os.path.join(d, "summary.json")) as f:
        assert json.load(f)["status"] == "oom"


def test_oom_after_warmup_names_the_non_model_memory(tmp_path):
    """Activations that leave no room for a module's chunks after warm-up: the message splits the
    budget into device budget - non-model memory - optimizer chunks at the failing moment."""
    # warm-up budget 0.9 x 3 MiB fits one module's chunks; then ~3 MiB of non-model memory leaves none
    with pytest.raises(torch.OutOfMemoryError) as e:
        train(BASE + ["+strategy=chunk", f"strategy.chunk.device_budget_gb={3 / 1024}",
                      "strategy.chunk.warmup_gpu_chunk_mem_ratio=0.9"], str(tmp_path / "r"))
    msg = str(e.value)
    assert "non-model memory" in msg and "device budget 3.00 MiB (3145728 B)" in msg and " of " in msg
