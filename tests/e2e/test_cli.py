"""The README's train command end to end in a subprocess, its run records, W&B files and sweeps."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO

STEPS = 60
CATEGORIES = {"params", "grads", "optim", "activations", "temp", "chunks", "comm", "other", "total"}


def cli(args: list[str], cwd: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", PYTHONPATH=REPO)
    env.pop("WANDB_API_KEY", None)
    return subprocess.run([sys.executable, "-m", "memopt.train", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """The default job as `make train` runs it (gpt_tiny, embedded corpus, W&B offline), cut to
    STEPS steps (the loss falls from 5.4 to about 2.7 in them; the whole 300 took 105 s of the suite):
    evaluation (every 100 steps and at the end), the checkpoint and the summary are the same code at
    any length."""
    tmp = tmp_path_factory.mktemp("default")
    run_dir = str(tmp / "run")
    proc = cli([f"hydra.run.dir={run_dir}", f"trainer.max_steps={STEPS}"], cwd=str(tmp))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, proc


def test_default_run_trains_and_reports(default_run):
    run_dir, proc = default_run
    assert "memopt run finished" in proc.stderr and "tokens/s" in proc.stderr  # the summary table
    assert "train:" in proc.stderr and "loss=" in proc.stderr  # the progress bar
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    steps = [r["step"] for r in recs]
    assert steps[0] == 0 and steps[-1] == STEPS - 1 and steps == sorted(steps)
    for r in recs:
        assert {"step", "loss", "lr", "tokens_per_s", "step_time_s", "peak_bytes"} <= set(r)
    first, last = sum(r["loss"] for r in recs[:3]) / 3, sum(r["loss"] for r in recs[-3:]) / 3
    assert last < first - 1.5, (first, last)  # byte-level loss starts at ln(256)=5.5
    assert any("val_loss" in r for r in recs)


def test_summary_has_the_design_fields(default_run):
    run_dir, _ = default_run
    with open(os.path.join(run_dir, "summary.json")) as f:
        s = json.load(f)
    assert s["status"] == "ok" and s["engine"] == "memopt" and s["strategy"] == [] and s["world_size"] == 1
    for k in ("final_loss", "tokens_per_s", "tflops", "mfu", "params", "val_loss"):
        assert isinstance(s[k], (int, float)), k
    cats = s["peak_bytes"]["0"]["cpu"]
    assert set(cats) == CATEGORIES
    n = s["params"]
    assert cats["params"] == 4 * n  # fp32 weights, tied embedding counted once
    assert cats["grads"] == 4 * n
    assert cats["optim"] == 8 * n  # Adam's two fp32 moments over the flat groups (no padding with one rank)
    assert cats["activations"] > 0 and cats["total"] >= cats["params"] + cats["optim"]
    assert s["peak_rss_bytes"]["0"] > cats["total"]
    assert s["tflops"] == pytest.approx(s["tokens_per_s"] * s["flops_per_token"] / 1e12)


def test_checkpoint_loads_with_one_call(default_run):
    import memopt
    from memopt.data import DataConfig, TokenBatches, load_tokens

    run_dir, _ = default_run
    model = memopt.load_model(run_dir)
    data = TokenBatches(load_tokens(DataConfig()), model.cfg.seq_len, 0.05, seed=0)
    x, y = data.eval_batches(1, 8)[0]
    with torch.no_grad():
        _, loss = model(x, y)
    with open(os.path.join(run_dir, "summary.json")) as f:
        s = json.load(f)
    assert loss.item() < 3.0 and abs(loss.item() - s["val_loss"]) < 0.3
    assert not [f for f in os.listdir(run_dir) if ".tmp-" in f]  # atomic write left no temp file


def test_wandb_offline_run_is_readable(default_run):
    from memopt.logging import read_wandb_offline

    run_dir, proc = default_run
    assert "wandb sync" in proc.stderr
    w = read_wandb_offline(run_dir)
    assert w["config"]["model"]["name"] == "gpt_tiny" and w["config"]["seed"] == 0
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    logged = [h for h in w["history"] if "loss" in h]
    assert len(logged) == len(recs)
    assert [h["loss"] for h in logged] == pytest.approx([r["loss"] for r in recs])
    assert w["summary"]["status"] == "ok" and w["summary"]["final_loss"] == pytest.approx(recs[-1]["loss"])
    assert "memopt" in w["tags"]


def test_sweep_survives_a_failed_job_and_reports(tmp_path):
    sweep = str(tmp_path / "sweep")
    missing = str(tmp_path / "missing.txt")
    proc = cli(["-m", f"hydra.sweep.dir={sweep}", "logger=none", "trainer.max_steps=3", "trainer.eval_every=0",
                "trainer.progress_bar=false", "data=pydoc,text_file", f"data.path={missing}"], cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    statuses = {}
    for job in sorted(os.listdir(sweep)):
        p = os.path.join(sweep, job, "summary.json")
        if os.path.exists(p):
            with open(p) as f:
                statuses[job] = json.load(f)
    assert sorted(s["status"] for s in statuses.values()) == ["ok", "refused"]
    refused = next(s for s in statuses.values() if s["status"] == "refused")
    assert "data.path" in refused["error"] and "missing.txt" in refused["error"]
    rep = subprocess.run([sys.executable, "-m", "memopt.report", sweep], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO))
    assert rep.returncode == 0, rep.stderr
    assert "refused" in rep.stdout and "ok" in rep.stdout and "params MiB" in rep.stdout


def test_refused_single_run_exits_nonzero_with_message(tmp_path):
    proc = cli([f"hydra.run.dir={tmp_path}/r", "logger=none", "+strategy=[fp16,bf16]"], cwd=str(tmp_path))
    assert proc.returncode == 2
    assert "fp16" in proc.stderr and "bf16" in proc.stderr and "mutually exclusive" in proc.stderr
    with open(f"{tmp_path}/r/summary.json") as f:
        assert json.load(f)["status"] == "refused"


@pytest.mark.slow  # 21 s; the default suite's report sweep (tests/report/test_report_sweep.py) checks the group and tags too
def test_sweep_jobs_share_a_wandb_group(tmp_path):
    from memopt.logging import read_wandb_offline

    sweep = tmp_path / "mysweep"
    proc = cli(["-m", f"hydra.sweep.dir={sweep}", "trainer.max_steps=2", "trainer.eval_every=0", "trainer.progress_bar=false",
                "trainer.save_checkpoint=false", "+strategy=ckpt,bf16"], cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = [read_wandb_offline(str(sweep / j)) for j in sorted(os.listdir(sweep)) if (sweep / j / "wandb").exists()]
    assert len(runs) == 2
    assert {r["group"] for r in runs} == {"mysweep"}
    common = ("gpt_tiny", "memopt", "world_size=1")  # model, engine and world size tag every run
    assert sorted(tuple(sorted(r["tags"])) for r in runs) == [tuple(sorted(("bf16",) + common)), tuple(sorted(("ckpt",) + common))]
