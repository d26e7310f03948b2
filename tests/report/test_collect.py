"""Reading run records that the trainer did not finish: a 2-rank job whose summary.json lacks engine and
strategy, labels from differing overrides, and baselines paired by the other overrides."""
from __future__ import annotations

import json
import os

import yaml

from memopt.report.baseline import pick_baselines, ratios
from memopt.report.collect import collect_runs


def _job(root, name, overrides, summary, config=None):
    d = os.path.join(root, name)
    os.makedirs(os.path.join(d, ".hydra"))
    with open(os.path.join(d, ".hydra", "overrides.yaml"), "w") as f:
        yaml.safe_dump(overrides, f)
    if config is not None:
        with open(os.path.join(d, ".hydra", "config.yaml"), "w") as f:
            yaml.safe_dump(config, f)
    if summary is not None:
        with open(os.path.join(d, "summary.json"), "w") as f:
            json.dump(summary, f)
    return d


def _peaks(total):
    return {"0": {"cpu": {"params": total // 2, "total": total}}, "1": {"cpu": {"params": total // 2, "total": total + 8}}}


def test_failed_two_rank_job_takes_engine_and_strategies_from_its_config(tmp_path):
    cfg = {"engine": {"name": "deepspeed"}, "model": {"name": "gpt_tiny"}, "trainer": {"nproc_per_node": 2},
           "strategy": {"zero1": None, "zero3": {"prefetch": True}, "cpu_offload": {"pin_memory": True}}}
    _job(str(tmp_path), "0", ["engine=deepspeed", "+strategy=[zero3,cpu_offload]", "trainer.nproc_per_node=2"],
         {"status": "failed", "error": "RankFailure: rank 1 failed", "failed_rank": 1}, cfg)
    _job(str(tmp_path), "1", ["engine=deepspeed", "+strategy=zero2", "trainer.nproc_per_node=2"], None,
         {"engine": {"name": "deepspeed"}, "strategy": {"zero2": {"bucket_mb": 25}}})
    a, b = collect_runs([str(tmp_path)])
    assert (a.status, a.engine, sorted(a.strategy), a.world_size) == ("failed", "deepspeed", ["cpu_offload", "zero3"], 2)
    assert (b.status, b.engine, b.strategy) == ("no summary", "deepspeed", ["zero2"])  # crashed before any record


def test_a_damaged_summary_is_a_row_not_the_reports_end(tmp_path, capsys):
    """One torn summary.json had ended the whole report with a bare JSON error naming no file."""
    _job(str(tmp_path), "0", ["+strategy=zero2"], {"status": "ok", "engine": "memopt", "strategy": ["zero2"]})
    d = _job(str(tmp_path), "1", ["+strategy=zero3"], None, {"engine": {"name": "memopt"}, "strategy": {"zero3": {}}})
    with open(os.path.join(d, "summary.json"), "w") as f:
        f.write('{"status": "ok"\n "engine"')
    a, b = collect_runs([str(tmp_path)])
    assert a.status == "ok" and (b.status, b.strategy) == ("unreadable summary", ["zero3"])
    assert os.path.join(d, "summary.json") in capsys.readouterr().err


def test_labels_are_the_differing_overrides_and_baselines_pair_by_the_rest(tmp_path):
    root = str(tmp_path)
    toks = {}
    for i, (engine, stage) in enumerate([(e, s) for s in ("zero2", "zero3") for e in ("memopt", "deepspeed")]):
        toks[(engine, stage)] = 100.0 * (i + 1)
        _job(root, str(i), [f"engine={engine}", f"+strategy={stage}", "trainer.nproc_per_node=2"],
             {"status": "ok", "engine": engine, "strategy": [stage], "tokens_per_s": toks[(engine, stage)],
              "final_loss": 1.0, "peak_bytes": _peaks(1000 * (i + 1))})
    runs = collect_runs([root])
    assert [r.label for r in runs] == ["engine=memopt strategy=zero2", "engine=deepspeed strategy=zero2",
                                       "engine=memopt strategy=zero3", "engine=deepspeed strategy=zero3"]
    assert runs[0].peaks("device")["total"] == 1008  # the largest rank
    base = pick_baselines(runs, "engine=deepspeed")
    assert {r.job: base[r.job].job for r in runs} == {"0": "1", "1": "1", "2": "3", "3": "3"}
    q = {x.run.job: x for x in ratios(runs, base)}
    assert q["0"].tokens_per_s == toks[("memopt", "zero2")] / toks[("deepspeed", "zero2")]
    assert q["2"].peak_device == 3008 / 4008
