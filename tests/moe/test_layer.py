"""The MoE layer against independent references, in float64: the dense MLP (one expert, top-1,
capacity above the token count) and a hand-written per-token loop for the gating decisions, the
combine weights, the dropped assignments and the two router losses (their papers' formulas)."""
from __future__ import annotations

import math

import pytest
import torch

from memopt.models.gpt import MLP, GPTConfig
from memopt.models.moe import MoE, RoutingStats, capacity

C, FF = 8, 16


def moe(E, k, **kw):
    torch.manual_seed(0)
    return MoE(C, FF, E, k, **kw).double()


def test_one_expert_equals_dense_mlp_forward_and_grads():
    torch.manual_seed(1)
    dense = MLP(GPTConfig(d_model=C, d_ff=FF)).double()
    layer = moe(1, 1, capacity_factor=2.0, min_capacity=1)
    with torch.no_grad():
        for n in ("fc.weight", "fc.bias", "proj.weight", "proj.bias"):
            layer.experts["0"].get_parameter(n).copy_(dense.get_parameter(n))
    x = torch.randn(3, 5, C, dtype=torch.float64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = dense(xa), layer(xb)
    torch.testing.assert_close(yb, ya, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-12, atol=1e-12)
    for n in ("fc.weight", "fc.bias", "proj.weight", "proj.bias"):
        torch.testing.assert_close(layer.experts["0"].get_parameter(n).grad, dense.get_parameter(n).grad, rtol=1e-12, atol=1e-12)
    assert layer.take_aux_loss() is not None


def reference(layer: MoE, x: torch.Tensor, cap: int | None):
    """Per-token loop: softmax, top-k, GShard queueing (all first choices, then all second ones)."""
    W = layer.router.weight.detach()
    xs = x.reshape(-1, C)
    S, E, k = xs.shape[0], layer.num_experts, layer.top_k
    logits = xs @ W.t()
    probs = [[math.exp(v) / sum(math.exp(u) for u in row) for v in row] for row in logits.tolist()]
    choice = [sorted(range(E), key=lambda e: -p[e])[:k] for p in probs]
    fill = [0] * E
    kept = {}
    for j in range(k):
        for s in range(S):
            e = choice[s][j]
            if cap is None or fill[e] < cap:
                kept[(s, j)] = (e, fill[e])
            fill[e] += 1
    y = torch.zeros_like(xs)
    for s in range(S):
        tot = sum(probs[s][e] for e in choice[s])
        for j in range(k):
            if (s, j) in kept:
                e = choice[s][j]
                w = probs[s][e] if k == 1 else probs[s][e] / tot
                y[s] += w * layer.experts[str(e)](xs[s : s + 1])[0]
    f = [sum(1 for s in range(S) if choice[s][0] == e) / S for e in range(E)]
    P = [sum(probs[s][e] for s in range(S)) / S for e in range(E)]
    aux = E * sum(a * b for a, b in zip(f, P))
    z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / S
    dropped = 1 - len(kept) / (S * k)
    return y.view_as(x), kept, aux, z, dropped, fill


@pytest.mark.parametrize("E,k,factor", [(4, 1, 1.0), (4, 2, 1.0), (4, 2, 0.5), (3, 2, 2.0), (4, 1, 0.25)])
def test_gating_matches_float64_reference(E, k, factor):
    layer = moe(E, k, capacity_factor=factor, min_capacity=1, aux_loss_coef=0.5, z_loss_coef=0.25,
                stats=RoutingStats(E), name="l")
    with torch.no_grad():
        layer.router.weight.mul_(20)  # sharper routing: uneven loads, so capacity bites
    x = torch.randn(2, 6, C, dtype=torch.float64)
    cap = capacity(12, E, k, factor, 1)
    y_ref, kept, aux, z, dropped, fill = reference(layer, x, cap)
    y = layer(x)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-12)
    term = layer.take_aux_loss()
    assert term.item() == pytest.approx(0.5 * aux + 0.25 * z, rel=1e-10)
    m = layer.stats.report()["moe"]
    assert m["aux_loss"] == pytest.approx(aux, rel=1e-10) and m["z_loss"] == pytest.approx(z, rel=1e-10)
    assert m["dropped_frac"] == pytest.approx(dropped)
    assert [m["load"]["l"][f"e{e}"] for e in range(E)] == pytest.approx([n / (12 * k) for n in fill])
    if factor < 1:
        assert dropped > 0, "the case should drop assignments"


def test_dropless_keeps_every_assignment_and_eval_uses_its_factor():
    layer = moe(4, 2, capacity_factor=0.25, min_capacity=1, drop_tokens=False, stats=RoutingStats(4), name="l")
    with torch.no_grad():
        layer.router.weight.mul_(20)
    x = torch.randn(2, 6, C, dtype=torch.float64)
    y_ref, kept, *_ = reference(layer, x, None)
    torch.testing.assert_close(layer(x), y_ref, rtol=1e-10, atol=1e-12)
    layer.take_aux_loss()
    assert layer.stats.report()["moe"]["dropped_frac"] == 0.0
    drop = moe(4, 2, capacity_factor=0.25, eval_capacity_factor=100.0, min_capacity=1)
    with torch.no_grad():
        drop.router.weight.mul_(20)
    drop.eval()
    y_ref, *_ = reference(drop, x, capacity(12, 4, 2, 100.0, 1))
    torch.testing.assert_close(drop(x), y_ref, rtol=1e-10, atol=1e-12)
    assert drop.take_aux_loss() is None  # eval forwards add no loss term


def test_router_runs_in_fp32_under_autocast():
    layer = MoE(C, FF, 4, 2).to(torch.bfloat16)
    seen = {}
    layer.router.register_forward_hook(lambda *a: None)
    orig = torch.nn.functional.linear

    def spy(x, w, b=None):
        seen.setdefault("dtypes", []).append((x.dtype, w.dtype))
        return orig(x, w, b)

    torch.nn.functional.linear = spy
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            layer(torch.randn(1, 4, C, dtype=torch.bfloat16))
    finally:
        torch.nn.functional.linear = orig
    assert seen["dtypes"][0] == (torch.float32, torch.float32)
