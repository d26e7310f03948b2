"""Pipeline parallelism in ``+strategy=auto`` and in the preflight's suggestion.

References: the global batch and the pipeline's rules written out here (micro-batch x accumulation x
data-parallel pipelines; 1F1B needs at least pp micro-batches; interleaving needs 2 pp blocks), the
ordinary plan of the same composition made by plan mode (``python -m memopt.train trainer.mode=plan``,
another process), and the fit rule itself (a node limit between two plans' needs).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, typed

BASE = ["model=gpt_tiny", "model.seq_len=64", "trainer.micro_batch_size=2", "logger=none", "data=synthetic",
        "trainer.save_checkpoint=false", "trainer.eval_every=0", "trainer.nproc_per_node=2"]
AXES = ["strategy.auto.ckpt=[none]", "strategy.auto.micro_batch_size=[2]", "strategy.auto.stage=[ddp]",
        "strategy.auto.offload=[false]", "strategy.auto.chunk_budget_gb=[]", "strategy.auto.tp=false"]


def hw_overrides(nbytes: int) -> list[str]:
    """A CPU-only node of 2 ranks with ``nbytes`` of RAM, as command-line overrides (plan mode reads them)."""
    return ["++hardware.name=node", "++hardware.device_memory_gb=1.0", f"++hardware.host_memory_gb={nbytes / 2**30!r}",
            "++hardware.peak_tflops={fp32: 1.0, bf16: 1.0, fp16: 1.0}", "++hardware.host_device_gbps=1.0",
            "++hardware.device_device_gbps=1.0", "++hardware.devices_per_node=2", "++hardware.device_is_host=true"]


def node(nbytes: int):
    import torch

    from memopt.memory.hardware import resolve_hardware

    return resolve_hardware(typed(hw_overrides(nbytes)).hardware, torch.device("cpu"))


def _value(row: list[str], key: str) -> str | None:
    return next((o.split("=", 1)[1] for o in row if o.startswith(key + "=")), None)


def test_pp_candidates_keep_the_global_batch_and_the_pipelines_rules():
    """4 ranks, gpt_tiny (4 blocks), micro-batch 16 x 2 on each data-parallel rank: pp 2 and 4 (both divide
    the ranks and the blocks), the global batch 4 x 16 x 2 = 128 sequences kept by every candidate
    (micro-batch x accumulation x the world / pp pipelines), interleaving only where 2 pp divides the 4
    blocks, 1F1B only with at least pp micro-batches, ddp named when a stage has data-parallel ranks."""
    from memopt.planner.search import candidates

    cmd = ["model=gpt_tiny", "+strategy=auto", "trainer.nproc_per_node=4", "trainer.micro_batch_size=16",
           "trainer.grad_accum=2", "logger=none"]
    rows = [c.overrides() for c in candidates(typed(cmd), node(2**40))]
    pp = [r for r in rows if _value(r, "parallel.pp")]
    assert {int(_value(r, "parallel.pp")) for r in pp} == {2, 4}
    for r in pp:
        size, sched = int(_value(r, "parallel.pp")), _value(r, "strategy.pipeline.schedule")
        mb, accum = int(_value(r, "trainer.micro_batch_size")), int(_value(r, "trainer.grad_accum"))
        assert mb * accum * (4 // size) == 4 * 16 * 2, r
        assert sched in ("1f1b", "gpipe", "interleaved_1f1b") and (sched != "1f1b" or accum >= size), r
        assert sched != "interleaved_1f1b" or 4 % (2 * size) == 0, r
        names = r[0].split("=", 1)[1].strip("[]").split(",")
        assert "pipeline" in names and ("ddp" in names) == (size < 4), r
    assert {_value(r, "strategy.pipeline.schedule") for r in pp if _value(r, "parallel.pp") == "2"} == \
        {"1f1b", "gpipe", "interleaved_1f1b"}
    assert not any(_value(r, "parallel.pp") for r in (c.overrides() for c in candidates(typed([*cmd, "strategy.auto.pp=false"]), node(2**40))))
    assert not any(_value(r, "parallel.pp") for r in (c.overrides() for c in candidates(typed([*cmd, "engine=deepspeed"]), node(2**40))))
    one = [c.overrides() for c in candidates(typed(["model=gpt_tiny", "+strategy=auto", "logger=none"]), node(2**40))]
    assert not any(_value(r, "parallel.pp") for r in one)  # one rank: nothing to split over


def test_auto_pp_schedule_is_checked_before_allocation():
    from memopt.errors import ConfigError

    with pytest.raises(ConfigError, match="strategy.auto.pp_schedule=\\['pipedream'\\].*1f1b"):
        typed(["model=gpt_tiny", "+strategy=auto", "strategy.auto.pp_schedule=[pipedream]", "logger=none"])


@pytest.mark.slow
def test_auto_answers_with_pp_when_only_pp_fits_and_plans_it_as_plan_mode(tmp_path):
    """2 ranks, data parallelism against pp=2 (three schedules): each stage holds half the model states, so
    every pipeline candidate needs less of the node than ddp; with a limit between the largest pipeline need
    and ddp's, ddp no longer fits and the answer is a pipeline. The winner's need and step time are those
    of plan mode for the same composition (the runtime each process adds per rank set aside: plan mode
    runs in another process, whose resident set differs, so it is given room for it)."""
    from memopt.planner.plan import runtime_bytes
    from memopt.planner.search import search

    cfg = typed([*BASE, "+strategy=auto", *AXES])
    rows = search(cfg, node(2**40))
    pp = [r for r in rows if _value(r["overrides"], "parallel.pp") == "2"]
    assert {_value(r["overrides"], "strategy.pipeline.schedule") for r in pp} == {"1f1b", "gpipe", "interleaved_1f1b"}
    (ddp,) = [r for r in rows if r["overrides"][0] == "+strategy=[ddp]"]
    assert all(r["fits"] for r in rows) and max(r["peak"] for r in pp) < ddp["peak"], rows
    limit = (max(r["peak"] for r in pp) + ddp["peak"]) // 2
    tight = search(cfg, node(limit))
    assert tight[0]["fits"] and _value(tight[0]["overrides"], "parallel.pp") == "2", tight[0]
    assert all(r["fits"] == (r in pp or _value(r["overrides"], "parallel.pp") == "2") for r in tight), tight
    assert not [r for r in tight if r["overrides"][0] == "+strategy=[ddp]"][0]["fits"]

    best = tight[0]
    env = {**os.environ, "PYTHONPATH": REPO}
    out = subprocess.run([sys.executable, "-m", "memopt.train", "trainer.mode=plan", *BASE, *best["overrides"],
                          *hw_overrides(2**40), f"hydra.run.dir={tmp_path}"],  # its own runtime differs: room for it
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    plan = json.load(open(tmp_path / "plan.json"))
    assert plan["fits"] and plan["strategy"] == ["pipeline"]
    own = plan["fit"]["host"]["bytes"] - 2 * plan["runtime_bytes_per_rank"]
    assert best["peak"] - 2 * runtime_bytes() == own
    assert best["step_s"] == pytest.approx(plan["step_time"]["total_s"], rel=1e-12)
    # (pp - 1) / (v m + pp - 1), m = 2 micro-batches, v virtual stages per rank: 1, or 2 interleaved (Narayanan et al. 2021)
    v = 2 if _value(best["overrides"], "strategy.pipeline.schedule") == "interleaved_1f1b" else 1
    assert plan["step_time"]["bubble_fraction"] == pytest.approx(1 / (v * 2 + 1))


@pytest.mark.slow
def test_preflight_suggests_the_pipeline_where_only_it_fits():
    """gpt_tiny on 2 ranks at sequence 16: a node limit between pp=2's need and ZeRO-2's leaves the
    plain run, checkpointing and ZeRO-2 (with or without it) over; the suggestion is the pipeline, with
    the accumulation doubled (the 2 stages share the micro-batches, so the global batch stays) and the
    suggested command plans to fit."""
    from memopt.planner.plan import make_plan
    from memopt.planner.preflight import suggestion

    cmd = ["model=gpt_tiny", "model.seq_len=16", "trainer.micro_batch_size=1", "logger=none", "trainer.nproc_per_node=2"]
    need = {name: make_plan(typed([*cmd, *comp]), node(2**40))["fit"]["host"]["bytes"]
            for name, comp in (("pp", ["+strategy=pipeline", "parallel.pp=2", "trainer.grad_accum=2"]),
                               ("zero2", ["+strategy=[zero2,ckpt]"]))}
    assert need["pp"] < need["zero2"], need
    limit = (need["pp"] + need["zero2"]) // 2
    got = suggestion(typed(cmd), node(limit))
    assert got["overrides"] is not None, got["text"]
    assert got["overrides"][0] == "+strategy=[pipeline]" and "parallel.pp=2" in got["overrides"], got
    assert "trainer.grad_accum=2" in got["overrides"] and any("zero2" in t for t in got["tried"]), got
    assert make_plan(typed([*cmd, *got["overrides"]]), node(limit))["fits"]
