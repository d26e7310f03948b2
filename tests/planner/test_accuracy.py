"""The planner against the tracker's measured peaks (the reference: the run itself, measured op by op).

Every composition that runs on this CPU, per rank, per device and per category: the plan's peak is
within 3% of the measured one (categories under 64 KiB: within 64 KiB, where 3% is a few hundred
bytes of scalars). The default suite keeps one case (one process, checkpointing + optimizer offload: every
category on both memories); two ranks and the matrix are ``slow``.
"""
from __future__ import annotations

import pytest

from tests.conftest import typed

TOL, FLOOR = 0.03, 64 * 1024
COMMON = ["model.seq_len=64", "trainer.micro_batch_size=2", "trainer.max_steps=2", "trainer.eval_every=0",
          "trainer.save_checkpoint=false", "logger=none", "trainer.progress_bar=false", "trainer.count_comm=true"]
# gloo's worker thread drops its references to a collective's tensors after it has signalled completion,
# so the caller can free a buffer and allocate the next one while gloo still holds the first: measured
# with 2 ranks under load (an all_gather_into_tensor into a fresh 240 KB output, then del, 300 times):
# 25-30% of the outputs were released by the worker thread, 12% were still alive right after the del.
# A 2-rank CPU run's device ``temp`` peak can then hold one collective buffer more than the code's own
# order says (measured 110-210 KB on chunk, FSDP2 and MoE cases, passing on re-runs). The slack is the
# largest single collective payload the run measured (``comm_per_step.max_call_bytes``), on ``temp`` and on
# the ``total`` it raises as much (FSDP2 zero3 + bf16, gpt_tiny, 2 ranks under load, 1 run in ~15: rank 1's
# total 497,924 B over the plan, every category exact: likely a forward all-gather's flat buffer, in no category;
# DeepSpeed zero1 at d_model 256, rank 1 once: its all-reduce's flat copy beside the gradient partition, 6.5 MB).
LATE_RELEASE = ("temp", "total")


def planned(overrides: list[str], world: int) -> dict:
    from memopt.memory.hardware import HardwareConfig
    from memopt.planner.plan import make_plan

    hw = HardwareConfig(name="test", device_memory_gb=1024, host_memory_gb=1024, peak_tflops={"fp32": 1.0},
                        host_device_gbps=1.0, device_device_gbps=1.0, devices_per_node=world, device_is_host=True)
    plan = make_plan(typed([*COMMON, *overrides, f"trainer.nproc_per_node={world}"]), hw)
    return plan["peak_bytes"]


def measured(overrides: list[str], world: int, tmp_path, slack: dict | None = None) -> dict:
    from memopt.api import run_job, run_jobs_on_ranks

    run_dir = str(tmp_path / "run")
    # DeepSpeed and FSDP2 create a process group even for one rank, which would stay in this process
    # (and DeepSpeed caches it), so the planner could not make its fake world afterwards: their
    # one-rank runs get a process of their own
    if world == 1 and not any(o in ("engine=deepspeed", "engine=fsdp2") for o in overrides):
        summary = run_job([*COMMON, *overrides], run_dir)
    else:
        summary = run_jobs_on_ranks(world, [([*COMMON, *overrides], run_dir)])[0]
    if slack is not None and world > 1:  # the late release of one gloo collective buffer (above)
        comm = summary.get("comm_per_step", {})
        late = comm.get("max_call_bytes", 0)
        for cat in LATE_RELEASE:
            slack[cat] = slack.get(cat, 0) + late
        # an expert-parallel all-to-all's input and output are activations: one call's both (DeepSpeed-MoE, moe_tiny
        # zero2 ep=2, rank 1 once: activations 6,997,720 B measured, 6,670,040 planned, two 163,840-byte buffers)
        a2a = comm.get("ops", {}).get("all_to_all", {})
        slack["activations"] = slack.get("activations", 0) + 2 * a2a.get("bytes", 0) // max(1, a2a.get("count", 0))
    return {r: {("device" if d == "cpu" else d): v for d, v in devs.items()} for r, devs in summary["peak_bytes"].items()}


def assert_plan_bounds(plan: dict, real: dict, bad: list[str]) -> None:
    """A worst-case plan (dropless routing): the comparison's failures ``bad`` are only ``activations`` and
    ``total``, and there the plan holds at least what the run measured, per rank and memory."""
    assert not [b for b in bad if " activations:" not in b and " total:" not in b]
    for rank, devs in real.items():
        for dev, cats in devs.items():
            assert plan[rank][dev]["activations"] >= cats["activations"]
            assert plan[rank][dev]["total"] >= cats["total"]


def compare(plan: dict, real: dict, slack: dict | None = None) -> list[str]:
    """Per rank, memory and category: |planned - measured| within the tolerance; ``slack`` ({category:
    bytes}) lets the measured peak exceed the plan by that much more (what a run holds for a time no
    plan can know; each use says what)."""
    bad = []
    for rank, devs in plan.items():
        for dev, cats in devs.items():
            for cat, want in real[rank].get(dev, {}).items():
                got = cats.get(cat, 0)
                tol = max(TOL * want, FLOOR)
                if got - want > tol or want - got > tol + (slack or {}).get(cat, 0):
                    bad.append(f"rank {rank} {dev} {cat}: planned {got}, measured {want}")
        for dev in real[rank]:
            if dev not in devs and real[rank][dev].get("total", 0) > FLOOR:
                bad.append(f"rank {rank}: {dev} measured but not planned")
    return bad


def check(overrides: list[str], world: int, tmp_path, skip: tuple[str, ...] = (), slack: dict | None = None) -> None:
    plan = planned(overrides, world)
    slack = dict(slack or {})
    real = measured(overrides, world, tmp_path, slack)
    bad = [b for b in compare(plan, real, slack) if not any(f" {c}:" in b for c in skip)]
    assert not bad, f"{overrides} on {world} rank(s):\n" + "\n".join(bad)


def test_plan_matches_measured_one_process(tmp_path):
    check(["+strategy=[ckpt,cpu_offload]", "model.n_layer=2"], 1, tmp_path)


def test_plan_counts_the_held_out_batches_the_run_keeps(tmp_path):
    """With evaluation on, the trainer builds trainer.eval_batches held-out batches before its steps and keeps them
    (device bytes on a CPU run): the plan had counted one, at evaluation, and let a run through a budget it then
    crossed at step 0 by their bytes."""
    check(["model.n_layer=2", "trainer.eval_every=2", "trainer.eval_batches=256"], 1, tmp_path)  # 512 KB of them


@pytest.mark.slow
def test_plan_matches_measured_two_ranks(tmp_path):
    check(["+strategy=zero3"], 2, tmp_path)


# fp16 runs start at a loss scale that does not overflow (HEALTHY): the plan is the step that is applied
# (simulate.py: no overflow), and a skipped step holds less. At the default 2^16 the 2-rank hybrid_adam
# run's warm-up step overflowed (skipped_steps=1 in its records: the fp16 sum of the two ranks'
# gradients) and rank 1's host Adam stopped at its first non-finite chunk: 274 KB of host temp instead
# of the planned 1.92 MB (every fp32 gradient chunk of its host groups, which the applied step holds).
HEALTHY = "strategy.fp16.init_scale=1024"
ONE = [[], ["+strategy=fp16", HEALTHY], ["+strategy=bf16"], ["+strategy=ckpt"], ["+strategy=ckpt", "strategy.ckpt.policy=every_k"],
       ["+strategy=ckpt", "strategy.ckpt.policy=selective"], ["+strategy=[ckpt,act_offload]"], ["+strategy=cpu_offload"],
       ["+strategy=[fp16,cpu_offload]", HEALTHY], ["+strategy=chunk"], ["+strategy=static_partition"], ["+strategy=hybrid_adam", HEALTHY],
       ["+strategy=hybrid_adam", "strategy.chunk.device_budget_gb=0.02", HEALTHY],
       ["+strategy=hybrid_adam", "strategy.chunk.device_budget_gb=0.02", "strategy.hybrid_adam.device_groups=2", HEALTHY],
       ["+strategy=chunk", "strategy.chunk.device_budget_gb=0.015"], ["+strategy=chunked_loss"],
       ["+strategy=[bf16,ckpt,act_offload]"], ["engine=fsdp2", "+strategy=zero3"]]
# engine=fsdp2's compositions that run on a CPU (cpu_offload is refused there; tp needs dp_shard >= 2: TP4)
FSDP2 = [["+strategy=[zero3,bf16]"], ["+strategy=[zero3,bf16]", "strategy.bf16.params=bf16"],
         ["+strategy=[zero3,fp16]", HEALTHY], ["+strategy=[zero3,ckpt]"],
         ["+strategy=[zero3,ckpt]", "strategy.ckpt.policy=selective"], ["+strategy=[zero2,ckpt,act_offload]"]]
ONE += [["engine=fsdp2", *o] for o in FSDP2]
TWO = [["+strategy=ddp"], ["+strategy=zero1"], ["+strategy=zero2"], ["+strategy=zero3"], ["+strategy=[zero3,cpu_offload]"],
       ["+strategy=[zero2,fp16]", HEALTHY], ["+strategy=[zero1,fp16]", HEALTHY], ["+strategy=[zero3,fp16]", HEALTHY],
       ["+strategy=[zero2,bf16]"], ["+strategy=[zero3,bf16]"], ["+strategy=[zero2,cpu_offload]"],
       ["+strategy=[zero2,ckpt]", "strategy.ckpt.policy=selective"], ["+strategy=chunk"], ["+strategy=hybrid_adam", HEALTHY],
       ["engine=fsdp2", "+strategy=zero3"], ["engine=fsdp2", "+strategy=zero2"]]
TWO += [["engine=fsdp2", *o] for o in FSDP2]
MODELS = [["model=gpt_tiny"], ["model=gpt_tiny", "model.n_layer=3", "model.d_model=96", "model.n_head=4"]]


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS, ids=["tiny", "tiny_wide"])
@pytest.mark.parametrize("overrides", ONE, ids=lambda o: "+".join(o) or "plain")
def test_matrix_one_process(overrides, model, tmp_path):
    check([*model, *overrides], 1, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS, ids=["tiny", "tiny_wide"])
@pytest.mark.parametrize("overrides", TWO, ids=lambda o: "+".join(o))
def test_matrix_two_ranks(overrides, model, tmp_path):
    check([*model, *overrides], 2, tmp_path)


# MoE (moe_tiny: top-2 of 4 experts, capacity factor 1.25, blocks 1 and 3). The plan keeps every
# assignment a capacity allows (planner/routing.py); a fresh router drops a few, so the run holds up to
# ~1% fewer ``activations`` (measured 29-37 KB of 7.2 MB on 1 and 2 ranks: the kept assignments'
# indices and gathered expert outputs); every other category is exact.
MOE = [(1, []), (1, ["+strategy=chunk"]), (1, ["model.d_model=96", "model.n_head=4"]),
       (2, ["+strategy=zero2"]), (2, ["+strategy=zero2", "parallel.ep=2"]), (2, ["+strategy=zero3"]),
       (2, ["+strategy=zero3", "parallel.ep=2"]), (2, ["+strategy=ddp", "parallel.ep=2"]), (2, ["+strategy=chunk"]),
       (2, ["+strategy=chunk", "parallel.ep=2"])]


@pytest.mark.slow
@pytest.mark.parametrize("world,overrides", MOE, ids=lambda o: "+".join(o) if isinstance(o, list) else f"{o}rank")
def test_matrix_moe(world, overrides, tmp_path):
    check(["model=moe_tiny", *overrides], world, tmp_path)


@pytest.mark.slow
def test_moe_dropless_plans_the_fullest_expert(tmp_path):
    """Dropless routing is planned at its worst case (an expert receiving every token: capacity S,
    planner/routing.py), so a measured run holds at most the plan, and only ``activations`` (the
    E x N dispatch buffers and the experts' activations) differ; tests/planner/test_moe_routing.py
    checks that a collapsed router's run holds exactly the plan."""
    ov = ["model=moe_tiny", "strategy.moe.drop_tokens=false"]
    plan, real = planned(ov, 1), measured(ov, 1, tmp_path)
    assert_plan_bounds(plan, real, compare(plan, real))


# tp=2 (tests/tp): on 2 ranks (dp 1) and on 4 (tp 2 x dp_shard 2: the ZeRO stages partition tp-local
# tensors). Logits all-gathered over tp (no loss_parallel): once in four runs rank 0 measured exactly one
# (B, T, V) fp32 buffer more activations than planned (rank 1 and the other runs: exact). The likely
# cause, not proven: gloo's worker thread drops the all-gather's Work, which holds the gathered
# (tp, B, T, V/tp) buffer, after DTensor has copied it into the logits; the plan frees it after the copy.
# So the measured activations (and total) may exceed the plan by that one buffer.
TP2 = {"megatron": ["+strategy=tp"], "sp": ["+strategy=tp", "strategy.tp.sequence_parallel=true"],
       "lp": ["+strategy=tp", "strategy.tp.loss_parallel=true"], "all_gather": ["+strategy=tp", "strategy.tp.form=all_gather"],
       "sp_lp_ckpt": ["+strategy=[tp,ckpt]", "strategy.tp.sequence_parallel=true", "strategy.tp.loss_parallel=true"],
       "zero3_sp": ["+strategy=[tp,zero3]", "strategy.tp.sequence_parallel=true"]}
TP4 = {"zero1": ["+strategy=[tp,zero1]"], "zero2_sp": ["+strategy=[tp,zero2]", "strategy.tp.sequence_parallel=true"],
       "zero3_lp": ["+strategy=[tp,zero3]", "strategy.tp.loss_parallel=true"],
       "zero3_sp_lp_ckpt": ["+strategy=[tp,zero3,ckpt]", "strategy.tp.sequence_parallel=true", "strategy.tp.loss_parallel=true"],
       "fsdp2_zero3": ["engine=fsdp2", "+strategy=[tp,zero3]"],
       "fsdp2_zero3_sp_lp": ["engine=fsdp2", "+strategy=[tp,zero3]", "strategy.tp.sequence_parallel=true",
                             "strategy.tp.loss_parallel=true"]}


def _tp_slack(overrides: list[str]) -> dict:
    if "strategy.tp.loss_parallel=true" in overrides:
        return {}
    logits = 2 * 64 * 256 * 4  # micro-batch x seq_len x gpt_tiny's vocabulary, fp32
    return {"activations": logits, "total": logits}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TP2))
def test_matrix_tp2_two_ranks(name, tmp_path):
    o = ["model=gpt_tiny", "parallel.tp=2", *TP2[name]]
    check(o, 2, tmp_path, slack=_tp_slack(o))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TP4))
def test_matrix_tp2_x_dp2_four_ranks(name, tmp_path):
    o = ["model=gpt_tiny", "parallel.tp=2", *TP4[name]]
    check(o, 4, tmp_path, slack=_tp_slack(o))


@pytest.mark.slow
def test_fsdp2_hsdp_four_ranks(tmp_path):
    """FSDP2's HSDP (2 replicas x dp_shard 2): planned per rank and category against the measured run (its plan had
    crashed: a second 2-D mesh whose process groups the planner's fake one cannot make; it now takes the run's own
    mesh)."""
    check(["model=gpt_tiny", "engine=fsdp2", "+strategy=zero3", "parallel.dp_replicate=2"], 4, tmp_path)
