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
    "select": lambda a, b: b[2],
    "select_negative": lambda a, b: b.select(1, -2),
    "unsqueeze": lambda a, b: b.unsqueeze(1),
    "expand": lambda a, b: b[:, :1].expand(4, 9),
    "squeeze": lambda a, b: b[:1].squeeze(0),
    "permute": lambda a, b: a.view(4, 16, 16).permute(2, 0, 1),
    "copy_": lambda a, b: a[:24].view(4, 6).copy_(b),
    "copy_broadcast": lambda a, b: b.copy_(b[1]),
}

# ops that make new tensors: answered from what FakeTensorMode gave the same op on arguments of the same metadata
RECALLED = {
    "mm": lambda a, b: torch.mm(a.view(64, 16), a.view(16, 64)),
    "addmm_transposed": lambda a, b: torch.addmm(a[:8], a.view(16, 64)[:, :4], a.view(16, 64)[:8, :4].t()),
    "add_broadcast_noncontiguous": lambda a, b: b.t() + b[0].view(6, 1),
    "sum_dim": lambda a, b: b.sum(0),
    "gelu": lambda a, b: torch.nn.functional.gelu(b),
    "gelu_backward": lambda a, b: torch.ops.aten.gelu_backward(b, b),
    "layer_norm": lambda a, b: torch.ops.aten.native_layer_norm(a.view(64, 16), [16], a[:16], a[16:32], 1e-5),
    "layer_norm_backward_some": lambda a, b: torch.ops.aten.native_layer_norm_backward(
        a.view(64, 16), a.view(64, 16), [16], a[:64].view(64, 1), a[64:128].view(64, 1), a[:16], a[16:32],
        [True, False, True]),
    "cat": lambda a, b: torch.cat([b, b[1:].float().half(), b], dim=0),
    "softmax": lambda a, b: torch.softmax(a.view(8, 128), -1),
    "topk": lambda a, b: torch.topk(a.view(32, 32), 3),
    "index_select": lambda a, b: a.view(64, 16).index_select(0, torch.zeros(5, dtype=torch.long)),
    "to_dtype": lambda a, b: b.t().to(torch.float32),
    "new_zeros": lambda a, b: b.new_zeros((2, 3)),
    "sdpa": lambda a, b: torch.nn.functional.scaled_dot_product_attention(
        a.view(1, 2, 32, 16), a.view(1, 2, 32, 16), a.view(1, 2, 32, 16), is_causal=True),
}


def _run(make, fast: bool, twice: bool = False):
    """``make``'s output on fake tensors a, b (the second of two calls with ``twice``: the first is recorded), with
    the direct path on or off: each output's metadata, whether it shares a storage with a or b or is one of them,
    the bytes the tracker holds, and whether the direct path answered the op."""
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
    fast_ops._OUTPUTS.clear()
    try:
        tracker = PlanTracker(torch.device("cpu"))
        with tracker, FakeTensorMode(allow_non_fake_inputs=True):
            a, b = torch.empty(1024), torch.empty(4, 6, dtype=torch.float16)
            if twice:
                make(a, b)
            calls.clear()
            out = make(a, b)
            outs = [out] if isinstance(out, torch.Tensor) else list(out)
            shares = [[o.untyped_storage()._cdata == x.untyped_storage()._cdata for x in (a, b)] for o in outs if o is not None]
            same = [[o is x for x in (a, b)] for o in outs]
            live = {d: dict(c) for d, c in tracker.live.items()}
        return [None if o is None else _meta(o) for o in outs], shares, same, live, calls[-1:] == [True]
    finally:
        fast_ops.enabled, fast_ops.run = True, orig
        fast_ops._OUTPUTS.clear()


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_op_answered_directly_equals_fake_tensor_modes_answer(case):
    fast, ref = _run(CASES[case], True), _run(CASES[case], False)
    assert fast[:4] == ref[:4], (fast, ref)
    assert fast[4] and not ref[4]  # the direct path answered it, and only when on


@pytest.mark.parametrize("case", sorted(RECALLED))
def test_an_op_answered_from_its_first_answer_equals_fake_tensor_modes_answer(case):
    fast, ref = _run(RECALLED[case], True, twice=True), _run(RECALLED[case], False, twice=True)
    assert fast[:4] == ref[:4], (fast, ref)
    assert not any(any(s) for s in fast[1]) and not any(any(s) for s in fast[2])  # new tensors of their own
    assert fast[4] and not ref[4]


def test_an_op_is_answered_from_an_earlier_answer_only_for_the_same_metadata():
    """Arguments of other strides, another dtype or another size are not the op answered before."""
    def column_major(b):  # b's shape, other strides
        return b.t().contiguous().t()

    variants = [lambda a, b: b + b, lambda a, b: column_major(b) + column_major(b), lambda a, b: b.float() + b.float(),
                lambda a, b: b[:3] + b[:3]]
    got = _run(lambda a, b: [v(a, b) for v in variants], True, twice=True)  # the second round: four recalled answers
    ref = _run(lambda a, b: [v(a, b) for v in variants], False, twice=True)
    assert got[0] == ref[0] and got[3] == ref[3]
    assert len(set(got[0])) == 4 and got[4]  # four layouts, each its own answer


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
        assert fast_ops.run(torch.ops.aten.mul.Tensor, (x, x), {}) is NotImplemented
        assert x.add_(x).item() == 6.0
        assert (x * x).item() == 36.0 and (x * x).item() == 36.0  # the same op twice: its value both times


RANKS = {  # the chunk engine with recomputation, its evaluation and save; MoE with expert parallelism under ZeRO-3
    "chunk_ckpt": ["model=gpt_tiny", "model.n_layer=3", "model.seq_len=64", "trainer.micro_batch_size=2",
                   "+strategy=[hybrid_adam,ckpt]", "strategy.chunk.chunk_size=496640", "trainer.eval_every=1",
                   "trainer.save_checkpoint=true"],
    "moe_ep2_zero3": ["model=moe_tiny", "model.n_layer=2", "model.seq_len=64", "trainer.micro_batch_size=2",
                      "trainer.grad_accum=2", "+strategy=zero3", "parallel.ep=2"],
}


@pytest.mark.parametrize("case", sorted(RANKS))
def test_a_simulated_rank_is_the_same_with_and_without_direct_answers(case):
    from memopt.planner import fast_ops
    from memopt.planner.simulate import simulate_rank

    cfg = typed([*RANKS[case], "logger=none", "trainer.nproc_per_node=2"])
    try:
        fast_ops.enabled = False
        ref = simulate_rank(cfg, 1, 2)
    finally:
        fast_ops.enabled = True
    got = simulate_rank(cfg, 1, 2)
    for key in ("peaks", "flops", "traffic", "comm_per_step", "engine_metrics", "backward_nonmodel"):
        assert got[key] == ref[key], key
