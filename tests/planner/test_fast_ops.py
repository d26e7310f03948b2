"""The planner's direct answers to some fake ops (``planner/fast_ops.py``) against FakeTensorMode's own
dispatch: op by op (the same shape, strides, offset, dtype, device and storage, the same bytes counted),
and a whole simulated rank with the direct path on and off (the same peaks, FLOPs, traffic, metrics)."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import typed


def _meta(t: torch.Tensor) -> tuple:
    return (type(t).__name__, tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, str(t.device), t.requires_grad)


CASES = {  # op -> (make the output from base tensors a, b of the same mode)
    "view": lambda a, b: a.view(64, 16),
    "as_strided": lambda a, b: a.as_strided((8, 8), (1, 8), 3),
    "slice": lambda a, b: a[2:40],
    "narrow": lambda a, b: a.narrow(0, 5, 7),
    "detach": lambda a, b: a.detach(),
    "t": lambda a, b: b.t(),
    "transpose": lambda a, b: b.transpose(0, 1),
    "add_": lambda a, b: b.add_(b[0]),
    "zero_": lambda a, b: a.zero_(),
    "mul_": lambda a, b: b.mul_(b),
    "div_": lambda a, b: b.div_(b),
    "empty": lambda a, b: torch.empty((3, 5), dtype=torch.float16),
    "randn": lambda a, b: torch.randn((3, 5)),
    "randn_generator": lambda a, b: torch.randn((7, 2), generator=torch.Generator().manual_seed(1)) * 0.02,
    "randn_bf16": lambda a, b: torch.randn(4, dtype=torch.bfloat16),
}


def _run(case: str, fast: bool):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memopt.planner import fast_ops
    from memopt.planner.simulate import PlanTracker

    calls = []
    orig = fast_ops.run

    def spy(func, args, kwargs):
        out = orig(func, args, kwargs)
        calls.append(out is not NotImplemented)
        return out

    fast_ops.enabled, fast_ops.run = fast, spy
    try:
        tracker = PlanTracker(torch.device("cpu"))
        with tracker, FakeTensorMode(allow_non_fake_inputs=True):
            a, b = torch.empty(1024), torch.empty(4, 6, dtype=torch.float16)
            calls.clear()
            out = CASES[case](a, b)
            shares = [out.untyped_storage()._cdata == x.untyped_storage()._cdata for x in (a, b)]
            same = [out is x for x in (a, b)]
            live = {d: dict(c) for d, c in tracker.live.items()}
        return _meta(out), shares, same, live, any(calls)
    finally:
        fast_ops.enabled, fast_ops.run = True, orig


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_op_answered_directly_equals_fake_tensor_modes_answer(case):
    fast, ref = _run(case, True), _run(case, False)
    assert fast[:4] == ref[:4], (fast, ref)
    assert fast[4] and not ref[4]  # the direct path answered it, and only when on


def test_a_tensor_holding_a_constant_goes_through_fake_tensor_mode():
    # FakeTensorMode propagates a scalar's value (.item() reads it): an op on it must keep doing so
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memopt.planner import fast_ops
    from memopt.planner.simulate import PlanTracker

    with PlanTracker(torch.device("cpu")), FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.tensor(3.0)
        assert x.constant is not None
        assert fast_ops.run(torch.ops.aten.add_.Tensor, (x, x), {}) is NotImplemented
        assert fast_ops.run(torch.ops.aten.detach.default, (x,), {}) is NotImplemented
        assert x.add_(x).item() == 6.0


def test_a_simulated_rank_is_the_same_with_and_without_direct_answers():
    from memopt.planner import fast_ops
    from memopt.planner.simulate import simulate_rank

    cfg = typed(["model=gpt_tiny", "model.n_layer=3", "model.seq_len=64", "trainer.micro_batch_size=2", "logger=none",
                 "+strategy=[hybrid_adam,ckpt]", "strategy.chunk.chunk_size=496640", "trainer.eval_every=1",
                 "trainer.save_checkpoint=true", "trainer.nproc_per_node=2"])
    try:
        fast_ops.enabled = False
        ref = simulate_rank(cfg, 1, 2)
    finally:
        fast_ops.enabled = True
    got = simulate_rank(cfg, 1, 2)
    for key in ("peaks", "flops", "traffic", "comm_per_step", "engine_metrics", "backward_nonmodel"):
        assert got[key] == ref[key], key
