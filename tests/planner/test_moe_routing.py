"""The planner's MoE routing answers (``memopt/planner/routing.py``) against the tracker's measurement
of real layers whose router was set to produce exactly the case the plan assumes:

- ``drop_tokens=true``: a balanced router (token s picks experts s mod E and s+1 mod E, so no expert
  goes over its capacity and nothing is dropped) holds what the plan holds, byte for byte;
- dropless: a collapsed router (every token picks experts 0 and 1) makes the largest load S, the
  plan's capacity, and again holds what the plan holds; a balanced dropless run holds less.
"""
from __future__ import annotations

import pytest
import torch

from memopt.memory.tracker import MemoryTracker
from memopt.models.moe import MoE

C, FF, E, K, B, T = 16, 32, 4, 2, 2, 16


def layer(drop_tokens: bool, collapsed: bool) -> MoE:
    torch.manual_seed(0)
    m = MoE(C, FF, E, K, capacity_factor=1.25, min_capacity=1, drop_tokens=drop_tokens)
    w = torch.zeros(E, C)
    for e in range(E):
        if collapsed:  # inputs are positive below: expert 0 first, then 1, for every token
            w[e] = {0: 2.0, 1: 1.0}.get(e, -1.0)
        else:  # feature c points at expert c mod E (first choice) and c+1 mod E (second)
            w[e, [c for c in range(C) if c % E == e]] = 2.0
            w[e, [c for c in range(C) if (c + 1) % E == e]] = 1.0
    with torch.no_grad():
        m.router.weight.copy_(w)
    return m


def inputs() -> torch.Tensor:
    x = torch.zeros(B * T, C)
    x[torch.arange(B * T), torch.arange(B * T) % C] = 1.0  # token s: feature s mod C (positive)
    return x.view(B, T, C)


def step(m: MoE, x: torch.Tensor) -> None:
    x = x.clone().requires_grad_()
    m(x).sum().backward()


def measured(m: MoE) -> int:
    x = inputs()
    tracker = MemoryTracker("cpu")
    with tracker:
        step(m, x)
    return tracker.peaks()["cpu"]["total"]


def planned(m: MoE) -> int:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memopt.planner.routing import planned_routing
    from memopt.planner.simulate import PlanTracker

    x = inputs()
    tracker = PlanTracker("cpu")
    with tracker, FakeTensorMode(allow_non_fake_inputs=True), planned_routing():
        step(m, x)
    return tracker.peaks()["cpu"]["total"]


def loads(m: MoE) -> torch.Tensor:
    from memopt.models.moe import route

    with torch.no_grad():
        return route(m.router(inputs().view(-1, C)), K, None)[5]


@pytest.mark.parametrize("drop_tokens,collapsed", [(True, False), (False, True)], ids=["capacity", "dropless"])
def test_plan_equals_the_run_of_the_case_it_assumes(drop_tokens, collapsed):
    m = layer(drop_tokens, collapsed)
    want = [B * T, B * T, 0, 0] if collapsed else [B * T * K // E] * E
    assert loads(m).tolist() == want  # the router does what the test says
    assert planned(m) == measured(m)


def test_dropless_plan_bounds_a_balanced_run():
    """Balanced dropless routing fills S k / E slots per expert, the plan S: the plan is above."""
    balanced = layer(False, False)
    assert loads(balanced).max() == B * T * K // E
    assert planned(balanced) > measured(balanced)
