"""``trainer.mode=plan`` through the CLI's path (``memopt.train.run`` in this process): a composition
the engine refuses at build gets the preflight's suggestion, which is checked against its own plan."""
from __future__ import annotations

import json

from tests.conftest import typed

TINY = ["logger=none", "model=gpt_tiny", "model.seq_len=32", "model.n_layer=2", "trainer.micro_batch_size=2",
        "trainer.eval_every=0", "hardware=v100_patrickstar", "trainer.mode=plan", "data=synthetic",
        "data.synthetic_tokens=20000"]


def cli_main(argv: list[str]) -> int:
    """``python -m memopt.train <argv>`` in this process (Hydra's entry point: the task overrides the
    suggestion keeps are Hydra's); returns the exit code."""
    import sys

    from hydra.core.global_hydra import GlobalHydra

    from memopt.train import main

    saved = sys.argv
    sys.argv = ["memopt.train", *argv]
    try:
        main()
        return 0
    except SystemExit as e:
        return int(e.code or 0)
    finally:
        sys.argv = saved
        GlobalHydra.instance().clear()


def test_plan_of_a_composition_the_engine_refuses_suggests_one_that_fits(tmp_path, capsys):
    """The chunk engine refuses gpt_tiny when its host budget (host RAM x overall_cpu_mem_ratio, here
    2.4 MiB on v100_patrickstar) is under what its chunks need: plan mode prints the engine's reason and
    a composition, and records both; the suggested composition's own plan (the preflight's limits) fits."""
    import torch

    from memopt.memory.hardware import resolve_hardware
    from memopt.planner.plan import limits_of, make_plan

    d = tmp_path / "plan"
    refused = ["+strategy=hybrid_adam", "strategy.chunk.overall_cpu_mem_ratio=0.00001"]
    assert cli_main([*TINY, *refused, f"hydra.run.dir={d}"]) == 0
    out = capsys.readouterr().out
    assert "refused by the engine (hardware v100_patrickstar)" in out and "host budget" in out and "suggestion: this fits:" in out, out
    plan = json.loads((d / "plan.json").read_text())
    assert plan["status"] == "refused_by_engine" and not plan["fits"] and "host budget" in plan["error"]
    fix = plan["suggestion"]["overrides"]
    assert fix and fix[0].startswith("+strategy=") and " ".join(fix) in out
    summary = json.loads((d / "summary.json").read_text())
    assert summary["fits"] is False and summary["plan_status"] == "refused_by_engine" and summary["suggestion"] == fix

    cand = typed([*TINY, *fix])
    hw = resolve_hardware(cand.hardware, torch.device("cpu"))
    again = make_plan(cand, hw, limits_of(hw, 1))
    assert again["fits"] and "error" not in again
    assert max(f["bytes"] for f in again["fit"].values()) == plan["suggestion"]["peak_bytes"]


def test_suggestion_applies_the_chunk_engines_fixes_and_the_fix_runs(tmp_path, capsys):
    """On 2 ranks with a small device budget the chunk engine's warm-up check refuses gpt_tiny (its 2
    chunks gathered by one all-gather exceed the warm-up budget). Plan mode's suggestion keeps the
    command's composition and adds the fixes the engine names (mem_saving_comm, a warm-up ratio); the
    reference is the real engine: the suggested command trains on 2 ranks (gloo) to the end."""
    from memopt.api import run_jobs_on_ranks

    cmd = ["+strategy=chunk", "strategy.chunk.device_budget_gb=0.008", "trainer.nproc_per_node=2"]
    d = tmp_path / "plan"
    assert cli_main([*TINY, *cmd, f"hydra.run.dir={d}"]) == 0
    out = capsys.readouterr().out
    assert "warm-up chunk budget" in out and "suggestion: this fits:" in out, out
    fix = json.loads((d / "plan.json").read_text())["suggestion"]["overrides"]
    assert "+strategy=[chunk]" in fix and "strategy.chunk.device_budget_gb=0.008" in fix  # the command's own composition
    assert "strategy.chunk.mem_saving_comm=true" in fix
    run = [o for o in TINY if o not in ("trainer.mode=plan", "hardware=v100_patrickstar")] + ["trainer.max_steps=2"]
    summary = run_jobs_on_ranks(2, [([*run, *fix], str(tmp_path / "run"))])[0]
    assert summary["status"] == "ok" and summary["steps"] == 2, summary


def test_fsdp2_cpu_offload_plan_on_a_gpu_profile_is_refused_with_its_reason(tmp_path, capsys):
    """FSDP2's CPUOffloadPolicy places shards, gradients and the step on the host with its own copies,
    which the fake step on the CPU cannot separate from device tensors (and fake tensors cannot be
    pinned: torch raised NYI _pin_memory before this refusal). Plan mode for an A100 says so and writes
    no plan, here and on a GPU machine (make_plan itself refuses, so the preflight skips rather than
    planning every byte on the device)."""
    import pytest

    from memopt.memory.hardware import HardwareConfig
    from memopt.planner.plan import make_plan
    from memopt.planner.simulate import PlanUnsupported

    d = tmp_path / "plan"
    offload = ["engine=fsdp2", "+strategy=[zero3,cpu_offload]", "hardware=a100_80g", "trainer.nproc_per_node=2"]
    assert cli_main([*TINY, *offload, f"hydra.run.dir={d}"]) == 2
    err = capsys.readouterr().err
    assert "plan refused" in err and "CPUOffloadPolicy" in err and "engine=memopt" in err, err
    summary = json.loads((d / "summary.json").read_text())
    assert summary["status"] == "refused" and summary["mode"] == "plan" and "CPUOffloadPolicy" in summary["error"]
    assert not (d / "plan.json").exists()

    gpu = HardwareConfig(name="gpu", device_memory_gb=80, host_memory_gb=1024, peak_tflops={"fp32": 19.5},
                         host_device_gbps=25, device_device_gbps=300, devices_per_node=8)
    with pytest.raises(PlanUnsupported, match="CPUOffloadPolicy"):
        make_plan(typed([*TINY, *offload[:2]]), gpu)
