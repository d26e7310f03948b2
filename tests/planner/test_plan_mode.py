"""``trainer.mode=plan`` through the CLI's path (``memopt.train.run`` in this process): a composition
the engine refuses at build gets the preflight's suggestion, which is checked against its own plan."""
from __future__ import annotations

import json

import pytest

from tests.conftest import cli_main, train, typed

TINY = ["logger=none", "model=gpt_tiny", "model.seq_len=32", "model.n_layer=2", "trainer.micro_batch_size=2",
        "trainer.eval_every=0", "hardware=v100_patrickstar", "trainer.mode=plan", "data=synthetic",
        "data.synthetic_tokens=20000"]


def test_plan_of_a_composition_the_engine_refuses_suggests_one_that_fits(tmp_path, capsys):
    """The chunk engine refuses gpt_tiny when its host budget (host RAM x overall_cpu_mem_ratio, here
    25.8 KiB on v100_patrickstar) is under what its chunks need (the parameter payloads: the plan places
    every optimizer group on the device at build, so the host holds no group): plan mode prints the engine's reason and
    a composition, and records both; the suggested composition's own plan (the preflight's limits) fits."""
    import torch

    from memopt.memory.hardware import resolve_hardware
    from memopt.planner.plan import limits_of, make_plan

    d = tmp_path / "plan"
    refused = ["+strategy=hybrid_adam", "strategy.chunk.overall_cpu_mem_ratio=0.0000001"]
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
    # the reference is the real engine: the suggested composition trains here to the end
    run = [o for o in TINY if o not in ("trainer.mode=plan", "hardware=v100_patrickstar")] + ["trainer.max_steps=2"]
    s = train([*run, *fix], str(tmp_path / "run"))
    assert s["status"] == "ok" and s["steps"] == 2, s


def test_suggestion_applies_the_chunk_engines_fixes_and_the_fix_runs(tmp_path, capsys):
    """On 2 ranks with a small device budget and PatrickStar's fixed options (group all-gather, warm-up
    share 0.1; left null the engine would choose units of one chunk here) the chunk engine's warm-up
    check refuses gpt_tiny (its 2 chunks gathered by one all-gather exceed the warm-up budget). Plan
    mode's suggestion keeps the command's composition and adds the fixes the engine names
    (mem_saving_comm, a warm-up ratio), replacing the command's values of those options; the reference
    is the real engine: the suggested command trains on 2 ranks (gloo) to the end."""
    from memopt.api import run_jobs_on_ranks

    cmd = ["+strategy=chunk", "strategy.chunk.device_budget_gb=0.004", "trainer.nproc_per_node=2",
           "strategy.chunk.mem_saving_comm=false", "strategy.chunk.warmup_gpu_chunk_mem_ratio=0.1"]
    d = tmp_path / "plan"
    assert cli_main([*TINY, *cmd, f"hydra.run.dir={d}"]) == 0
    out = capsys.readouterr().out
    assert "warm-up chunk budget" in out and "suggestion: this fits:" in out, out
    fix = json.loads((d / "plan.json").read_text())["suggestion"]["overrides"]
    assert "+strategy=[chunk]" in fix and "strategy.chunk.device_budget_gb=0.004" in fix  # the command's own composition
    assert "strategy.chunk.mem_saving_comm=true" in fix and "strategy.chunk.mem_saving_comm=false" not in fix
    run = [o for o in TINY if o not in ("trainer.mode=plan", "hardware=v100_patrickstar")] + ["trainer.max_steps=2"]
    summary = run_jobs_on_ranks(2, [([*run, *fix], str(tmp_path / "run"))])[0]
    assert summary["status"] == "ok" and summary["steps"] == 2, summary


@pytest.mark.slow  # 7 s on an AVX2 CPU; FSDP2's plans stay in the default suite through test_candidate and the accuracy rows
def test_fsdp2_cpu_offload_plan_on_a_gpu_profile_puts_the_shards_on_the_host(tmp_path):
    """FSDP2's CPUOffloadPolicy on a GPU keeps the fp32 parameter shards, the gradient shards and
    AdamW's moments on the host. No GPU here to measure, so the reference is the parameter count P
    (GPT with tied head, biases and LayerNorms, counted from the config) and the world W, per rank:
    host params 4P/W, grads 4P/W, optim 8P/W; on the device no gradient or optimizer bytes, the
    parameters' only the gathered blocks (the no-offload plan's less its 4P/W of shards), and the
    device total under the no-offload plan's by at least the shards that plan keeps resident (12P/W)."""
    import torch

    from memopt.memory.hardware import resolve_hardware
    from memopt.planner.plan import make_plan

    W, L, C, V, T = 2, 2, 128, 256, 32  # TINY's gpt_tiny: n_layer, d_model, vocab_size, seq_len
    P = V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C
    d = tmp_path / "plan"
    gpu = ["engine=fsdp2", "hardware=a100_80g", f"trainer.nproc_per_node={W}"]
    assert cli_main([*TINY, *gpu, "+strategy=[zero3,cpu_offload]", f"hydra.run.dir={d}"]) == 0
    plan = json.loads((d / "plan.json").read_text())
    assert plan["world_size"] == W and set(plan["peak_bytes"]) == {"0", str(W - 1)}
    typed_cfg = typed([*TINY, *gpu, "+strategy=zero3"])
    base = make_plan(typed_cfg, resolve_hardware(typed_cfg.hardware, torch.device("cpu")))["peak_bytes"]

    def close(got, want):
        return abs(got - want) <= max(0.03 * want, 64 * 1024)

    for rank, peaks in plan["peak_bytes"].items():
        host, dev = peaks["host"], peaks["device"]
        for cat, want in (("params", 4 * P // W), ("grads", 4 * P // W), ("optim", 8 * P // W)):
            assert close(host[cat], want), (rank, cat, host[cat], want)
        assert dev["grads"] == 0 and dev["optim"] == 0, (rank, dev)
        assert close(dev["params"], base[rank]["device"]["params"] - 4 * P // W), (rank, dev, base[rank]["device"])
        assert dev["total"] <= base[rank]["device"]["total"] - 12 * P // W, (rank, dev["total"], base[rank]["device"])
    assert plan["traffic"]["offload_bytes"] > 0  # the shards' copies to the device and the gradients' back


@pytest.mark.slow  # 8 s on an AVX2 CPU; plan mode at depth stays in the default suite (gpt_10b on PatrickStar's node)
def test_llama3_8b_plans_on_a_node_of_8_a100s(tmp_path):
    """The Llama runs on the planner's fake tensors like the GPT: Llama 3.1 8B with ZeRO-3 and
    checkpointing on 8 A100 80G (extrapolated from two shallow plans, seconds). Each rank holds an
    eighth of AdamW's fp32 moments (8 B/param / 8 = P bytes) and of the fp32 weights, plus the units
    it gathers; at seq 8192 and micro-batch 2 it fits (micro-batch 16 does not: the block inputs and
    the (B, T, 128256) logits)."""
    from memopt.models.llama import Llama

    d = tmp_path / "plan"
    assert cli_main(["logger=none", "trainer.mode=plan", "model=llama3_8b", "hardware=a100_80g", "trainer.micro_batch_size=2",
                     "trainer.nproc_per_node=8", "+strategy=[zero3,ckpt]", f"hydra.run.dir={d}"]) == 0
    plan = json.loads((d / "plan.json").read_text())
    P = Llama.num_params(typed(["model=llama3_8b"]).model)
    assert plan["params"] == P == 8_030_261_248 and plan["world_size"] == 8
    rank0 = plan["peak_bytes"]["0"]["device"]
    assert rank0["optim"] == P and 4 * P / 8 <= rank0["params"] < 4 * P / 2
    # ckpt keeps each block's input: L x B T C fp32 values at least
    assert rank0["activations"] >= 32 * 2 * 8192 * 4096 * 4
    assert plan["fits"] and plan["status"] == "fits", plan["status"]


def test_a_pipeline_stage_over_its_limit_is_an_overflow_not_a_crash():
    """torch's pipelining wraps a stage's exception in a RuntimeError; the planner's overflow inside it is the
    plan's answer (the auto search once died on the first pipeline candidate that did not fit)."""
    from memopt.memory.hardware import HardwareConfig
    from memopt.planner.plan import make_plan
    from memopt.planner.simulate import PlanOverflow

    cfg = typed(["model=gpt_tiny", "trainer.micro_batch_size=16", "trainer.grad_accum=2", "trainer.nproc_per_node=2",
                 "+strategy=pipeline", "parallel.pp=2", "logger=none", "trainer.save_checkpoint=false"])
    hw = HardwareConfig(name="t", device_memory_gb=1.0, host_memory_gb=1.0, peak_tflops={"fp32": 1.0},
                        device_is_host=True)
    plan = make_plan(cfg, hw)
    stage0 = plan["peak_bytes"]["0"]["device"]
    # below stage 0's peak by half its activations: its model states fit, its forward goes over
    with pytest.raises(PlanOverflow):
        make_plan(cfg, hw, {"all": stage0["total"] - stage0["activations"] // 2})
