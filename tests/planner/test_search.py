"""+strategy=auto and the largest-model search, against the planner's own fit rule and the run records."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, typed


def small_hw(mib: float):
    from memopt.memory.hardware import HardwareConfig
    from memopt.planner.plan import runtime_bytes

    return HardwareConfig(name="small", device_memory_gb=1.0, host_memory_gb=(runtime_bytes() + mib * 2**20) / 2**30,
                          peak_tflops={"fp32": 1.0}, host_device_gbps=1.0, device_device_gbps=1.0, devices_per_node=1,
                          device_is_host=True)


@pytest.mark.slow
def test_auto_ranks_fitting_candidates_and_drops_the_others():
    from memopt.planner.search import search

    base = ["model=gpt_tiny", "model.seq_len=64", "trainer.micro_batch_size=4", "logger=none", "data=synthetic",
            "trainer.save_checkpoint=false", "trainer.eval_every=0"]
    cfg = typed([*base, "+strategy=auto", "strategy.auto.ckpt=[none,full]", "strategy.auto.micro_batch_size=[4]"])
    # 24 MiB: plain gpt_tiny (about 22 MiB at micro-batch 4 with its 8.5 MiB of activations) fits only just;
    # checkpointing leaves room; both ranked by predicted step time, the recomputing one slower
    rows = search(cfg, small_hw(24), base)
    fits = [r for r in rows if r["fits"]]
    assert fits and all(a["step_s"] <= b["step_s"] for a, b in zip(fits, fits[1:]))
    labels = [r["label"] for r in fits]
    assert any("ckpt" in lab for lab in labels), labels
    tight = search(cfg, small_hw(12), base)  # 12 MiB: only checkpointing (or offload) fits, never the plain run
    assert all("+strategy=[] " not in r["label"] for r in tight if r["fits"]), [r["label"] for r in tight]


@pytest.mark.slow
def test_largest_model_is_the_boundary_of_the_fit():
    from memopt.planner.search import largest_model

    base = ["model=gpt_tiny", "model.seq_len=64", "trainer.micro_batch_size=2", "logger=none", "data=synthetic",
            "trainer.save_checkpoint=false", "trainer.eval_every=0"]
    n, plan, tried = largest_model(base, small_hw(30), lo=1, hi=16)
    assert 1 <= n < 16 and plan["fits"]
    assert any(v == n + 1 and not ok for v, ok, _ in tried) or n + 1 not in [v for v, _, _ in tried]


@pytest.mark.slow
def test_plan_mode_cli_writes_plan_json_png_and_summary(tmp_path):
    env = {**os.environ, "PYTHONPATH": REPO, "WANDB_MODE": "offline"}
    out = subprocess.run([sys.executable, "-m", "memopt.train", "trainer.mode=plan", "logger=none", "model.seq_len=64",
                          "+strategy=zero3", "trainer.nproc_per_node=2", "hardware=v100_patrickstar", f"hydra.run.dir={tmp_path}"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    plan = json.load(open(tmp_path / "plan.json"))
    assert set(plan["peak_bytes"]) == {"0", "1"} and plan["fits"] and plan["step_time"]["dominant"]
    assert os.path.getsize(tmp_path / "plan.png") > 1000
    assert json.load(open(tmp_path / "summary.json"))["status"] == "ok"
    assert "memopt plan:" in out.stdout and "fits, margin" in out.stdout


@pytest.mark.slow
def test_preflight_refuses_gpt_10b_here_with_status_and_exit_code(tmp_path):
    env = {**os.environ, "PYTHONPATH": REPO, "WANDB_MODE": "offline"}
    out = subprocess.run([sys.executable, "-m", "memopt.train", "model=gpt_10b", "logger=none", "hardware.host_memory_gb=24",
                          "hardware.device_memory_gb=null", f"hydra.run.dir={tmp_path}"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 2, out.stderr[-2000:]
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["status"] == "refused" and "params" in summary["error"] and "no composition fits" in summary["error"]
