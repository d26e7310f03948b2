"""Hybrid Adam's placement decided before step 0 (``strategy.hybrid_adam.device_groups``): those optimizer
groups are made on the device at build, so the host never holds them, and the warm-up step checks the
decision (moving back, with a warning that names the bytes, what its measured margin cannot hold).

References: the host peak of a run with k groups placed before step 0 is the peak of the same run
without them minus k groups of 12 B per chunk element (fp32 master, momentum, variance): the host peak
is the build, where every parameter payload and every host-side group is on the host; the losses
follow the warm-up-placed run within fp16's parity tolerance (5e-3, tests/chunk/test_chunk_parity.py:
step 0's update of those k groups runs the device kernel instead of the host one, one fp32 rounding).
"""
from __future__ import annotations

import pytest

from tests.chunk.helpers import records, train_capture
from tests.conftest import losses

BASE = ["model=gpt_tiny", "model.seq_len=32", "trainer.max_steps=3", "trainer.log_every=1", "trainer.eval_every=0",
        "trainer.micro_batch_size=2", "optim.lr=3e-3", "optim.warmup_steps=0", "+strategy=hybrid_adam",
        "strategy.fp16.init_scale=1024"]


def rel_err(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_groups_placed_before_step_0_never_touch_the_host(tmp_path, monkeypatch):
    k = 3
    warm, e0 = train_capture(BASE, str(tmp_path / "warm"), monkeypatch)
    early, e1 = train_capture([*BASE, f"strategy.hybrid_adam.device_groups={k}"], str(tmp_path / "early"), monkeypatch)
    assert warm["status"] == early["status"] == "ok"
    chunk = records(str(tmp_path / "early"))[-1]["chunk"]["chunk_size"]
    assert e1.step_metrics()["optim_chunks_at_start"] == k and e0.step_metrics()["optim_chunks_at_start"] == 0
    # both end with the warm-up's placement (the default budget holds every group)
    assert e1.step_metrics()["optim_chunks_on_device"] == e0.step_metrics()["optim_chunks_on_device"] >= k
    host0, host1 = warm["peak_bytes"]["0"]["host"]["chunks"], early["peak_bytes"]["0"]["host"]["chunks"]
    assert host0 - host1 == k * 12 * chunk, (host0, host1)
    err = rel_err(losses(str(tmp_path / "early")), losses(str(tmp_path / "warm")))
    assert err <= 5e-3, err


def test_the_warm_up_moves_back_what_its_margin_cannot_hold(tmp_path, monkeypatch):
    # 9 MiB: ~3 MiB of non-model memory and the chunks a moment computes with leave room for ~7 groups of
    # 0.8 MB once every other parameter chunk is evicted (the hard margin); 11 placed before step 0 are
    # more than that (and less than the budget, which the build refuses)
    budget = [f"strategy.chunk.device_budget_gb={9 / 1024}", "strategy.chunk.warmup_gpu_chunk_mem_ratio=0.4"]
    with pytest.warns(UserWarning, match=r"device_groups=11: the warm-up measured a device margin of \d+ B .* B short"):
        s, e = train_capture([*BASE, *budget, "strategy.hybrid_adam.device_groups=11"], str(tmp_path / "r"), monkeypatch)
    assert s["status"] == "ok"
    m = e.step_metrics()
    opt, mgr = e.optimizer, e.mgr
    assert m["optim_chunks_at_start"] == 11 and 0 < m["optim_chunks_on_device"] < 11
    # what stays: the most whole groups the hard margin holds, never fewer than PatrickStar's rule places
    soft = int(0.8 * m["placement_margin_bytes"]) // opt.group_bytes
    hard = m["placement_hard_margin_bytes"] // opt.group_bytes
    assert m["optim_chunks_on_device"] == m["optim_groups_device_max"] == max(soft, hard)
    assert mgr.os_device_bytes == m["optim_chunks_on_device"] * opt.group_bytes


def test_a_plans_groups_beyond_patrickstars_margin_stay_within_the_hard_one(tmp_path, monkeypatch):
    """PatrickStar's margin keeps room for every parameter chunk the device may hold at once; groups a
    plan placed before step 0 may use the room those chunks would take (they are evicted instead), up
    to the device budget less the fullest moment with only the chunks it computes with: a moment's
    non-model bytes plus its pinned chunks, written out here from the tracer's trace."""
    budget = [f"strategy.chunk.device_budget_gb={9 / 1024}", "strategy.chunk.warmup_gpu_chunk_mem_ratio=0.4"]
    warm, e0 = train_capture([*BASE, *budget], str(tmp_path / "warm"), monkeypatch)
    m0 = e0.step_metrics()
    soft, most = m0["optim_chunks_on_device"], m0["optim_groups_device_max"]
    assert soft < most  # the case: a plan may place more than the warm-up would
    mgr, opt = e0.mgr, e0.optimizer
    unit = max(c.payload_bytes for c in mgr.chunks)
    need = max(max(a + b for a, b in zip(mgr.tracer.nonmodel, mgr._must)), mgr.tracer.max_nonmodel + unit)
    assert most == min(len(opt.groups), (mgr.device_budget - need) // opt.group_bytes)
    early, e1 = train_capture([*BASE, *budget, f"strategy.hybrid_adam.device_groups={most}"], str(tmp_path / "early"),
                              monkeypatch)
    assert early["status"] == "ok"
    m1 = e1.step_metrics()
    assert m1["optim_chunks_on_device"] == m1["optim_chunks_at_start"] == most
    chunk = m1["chunk_size"]
    assert warm["peak_bytes"]["0"]["host"]["chunks"] - early["peak_bytes"]["0"]["host"]["chunks"] == most * 12 * chunk
    err = rel_err(losses(str(tmp_path / "early")), losses(str(tmp_path / "warm")))
    assert err <= 5e-3, err


def test_groups_over_the_device_budget_are_refused_before_allocation(tmp_path):
    from memopt.errors import ConfigError
    from tests.conftest import train

    # 2 MiB of device budget hold 2 groups of 12 x 66560 B (0.8 MB) at most
    with pytest.raises(ConfigError, match=r"device_groups=5: .* set at most 2 "):
        train([*BASE, f"strategy.chunk.device_budget_gb={2 / 1024}", "strategy.hybrid_adam.device_groups=5"],
              str(tmp_path / "r"))
