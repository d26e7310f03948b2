"""A step's middle micro-batches planned from its second (``simulate.sampled_micro_batches``) against the fake
step that runs every one of them (``trainer.plan_exact=true``: the run's own loop, the reference), per rank,
memory and category, exactly; FLOPs, link traffic, collectives by kind and the moments DeepSpeed's rules read
too. Five micro-batches a step, so three are stood for by the second; two ranks, so ZeRO's reductions between
micro-batches and the tensor-parallel collectives are counted."""
from __future__ import annotations

import pytest

from tests.conftest import typed

COMMON = ["model=gpt_tiny", "model.seq_len=64", "trainer.micro_batch_size=2", "trainer.grad_accum=5",
          "trainer.eval_every=0", "trainer.save_checkpoint=false", "logger=none", "trainer.nproc_per_node=2"]
FAST = [["+strategy=ddp"]]
SLOW = [["+strategy=[tp]", "parallel.tp=2", "strategy.tp.sequence_parallel=true"], ["+strategy=[zero2,cpu_offload]"], ["engine=fsdp2", "+strategy=zero3"], ["+strategy=zero1"], ["+strategy=zero3"], ["+strategy=[zero3,cpu_offload]"], ["+strategy=[ckpt,zero2]"],
        ["+strategy=[fp16,zero2]"], ["+strategy=[bf16,ckpt,act_offload]"], ["+strategy=[chunked_loss,zero2]"],
        ["model=moe_tiny", "+strategy=[moe,zero2]", "parallel.ep=2"], ["engine=fsdp2", "+strategy=[bf16,zero2]"]]
KEYS = ("peaks", "traffic", "flops", "comm_per_step", "backward_nonmodel", "backward_with_grads", "data",
        "grad_arrivals")  # (the first backward's)
MOMENTS = ("grad_ready_nonmodel", "recompute_nonmodel")  # a list per step, an entry per gradient or recomputation


def both(overrides: list[str], rank: int) -> tuple[dict, dict]:
    from memopt.planner.simulate import simulate_rank

    sampled = typed([*COMMON, *overrides])
    exact = typed([*COMMON, *overrides, "trainer.plan_exact=true"])
    return simulate_rank(sampled, rank, 2), simulate_rank(exact, rank, 2)


def differences(got: dict, want: dict) -> list[str]:
    bad = [f"{k}: sampled {got.get(k)}, every micro-batch {want.get(k)}" for k in KEYS if got.get(k) != want.get(k)]
    for k in MOMENTS:  # kept a step (DeepSpeed's rules read the first micro-batch's), or repeated by each micro-batch
        g, w = got.get(k) or [], want.get(k) or []  # (the first's may hold more): then the 3rd and 4th's are not run
        per, odd = divmod(len(w) - len(g), 2)
        if g != w and (odd or per <= 0 or g != w[:len(g) - per] + w[len(w) - per:]):
            bad.append(f"{k}: sampled {g}, every micro-batch {w}")
    return bad


def check(overrides: list[str], ranks=(0, 1)) -> None:
    for rank in ranks:
        got, want = both(overrides, rank)
        assert want["traffic"]["ops"] > 1000  # the reference counted a step
        bad = differences(got, want)
        assert not bad, f"rank {rank} {overrides}:\n" + "\n".join(bad)


@pytest.mark.parametrize("overrides", FAST, ids=[" ".join(o) for o in FAST])
def test_sampled_micro_batches_plan_as_every_one(overrides):
    check(overrides, ranks=(0,))


@pytest.mark.slow
@pytest.mark.parametrize("overrides", SLOW, ids=[" ".join(o) for o in SLOW])
def test_sampled_micro_batches_plan_as_every_one_slow(overrides):
    check(overrides)


def test_the_stood_for_micro_batches_are_counted():
    """Control: without the second micro-batch's counts taken again, the FLOPs and collectives fall short of the
    reference's (the comparison above can fail), and the sampled step runs 3 of the 5 micro-batches."""
    from memopt.planner import simulate

    calls = []
    real = simulate.sampled_micro_batches

    def spy(n, repeat):
        calls.append(real(n, repeat))
        return calls[-1]

    simulate.PlanTracker.repeat_since, keep = (lambda self, before, times: None), simulate.PlanTracker.repeat_since
    simulate.sampled_micro_batches = spy
    try:
        got, want = both(["+strategy=zero2"], 0)
    finally:
        simulate.PlanTracker.repeat_since, simulate.sampled_micro_batches = keep, real
    assert calls[0] == ([0, 1, 4], 3) and calls[1] == ([0, 1, 2, 3, 4], 1)
    assert got["flops"] < want["flops"] and got["comm_per_step"]["count"] < want["comm_per_step"]["count"]
    assert got["peaks"] == want["peaks"]  # the bytes are the second's whatever is counted


@pytest.mark.slow
def test_deepspeed_rules_plan_accumulation_as_every_micro_batch():
    """DeepSpeed's plans take memopt's fake step's moments (stage 1: every gradient beside the backward, each
    counted once a step however many micro-batches add into it)."""
    from memopt.planner.plan import make_plan
    from memopt.memory.hardware import resolve_hardware

    import torch

    for stage in ("zero1", "[zero3,cpu_offload]"):
        ov = [*COMMON, "engine=deepspeed", f"+strategy={stage}"]
        sampled, exact = typed(ov), typed([*ov, "trainer.plan_exact=true"])
        hw = resolve_hardware(sampled.hardware, torch.device("cpu"))
        got, want = make_plan(sampled, hw), make_plan(exact, hw)
        assert got["peak_bytes"] == want["peak_bytes"], stage
        assert got["flops_per_step"] == want["flops_per_step"] and got["traffic"] == want["traffic"], stage
