"""DeepSpeed-MoE's dropless capacity as planned (``planner/engines/deepspeed/moe_rules.worst_case_capacity``: every token
of the rank in one expert) against the tracker's measurement of the run's own layer (memopt's translation,
``engines/deepspeed_moe.DeepSpeedMoE``) whose router was set to produce that case: a collapsed router
(every token's choices are experts 0 and 1) holds what the plan holds, byte for byte; a balanced one less.
The routers are tests/planner/test_moe_routing.py's."""
from __future__ import annotations

import pytest
import torch

from memopt.memory.tracker import MemoryTracker
from tests.planner.test_moe_routing import B, C, E, FF, T, inputs, layer


def deepspeed_layer(k: int, collapsed: bool):
    from memopt.engines.deepspeed_moe import DeepSpeedMoE
    from memopt.models.moe import MoE

    torch.manual_seed(0)
    src = MoE(C, FF, E, k, capacity_factor=1.25, min_capacity=1, drop_tokens=False)
    with torch.no_grad():
        src.router.weight.copy_(layer(False, collapsed).router.weight)
    return DeepSpeedMoE(src, 1)


def step(m, x: torch.Tensor) -> None:
    x = x.clone().requires_grad_()
    m(x).sum().backward()


def measured(m) -> tuple[int, list[int]]:
    """(the tracker's peak, DeepSpeed's own per-expert loads of that forward)."""
    tracker = MemoryTracker("cpu")
    x = inputs()
    with tracker:
        step(m, x)
    return tracker.peaks()["cpu"]["total"], m.moe.deepspeed_moe.exp_counts.tolist()


def planned(m) -> int:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memopt.planner.engines.deepspeed.moe_rules import worst_case_capacity
    from memopt.planner.simulate import PlanTracker

    x = inputs()
    tracker = PlanTracker("cpu")
    with tracker, FakeTensorMode(allow_non_fake_inputs=True), worst_case_capacity():
        step(m, x)
    return tracker.peaks()["cpu"]["total"]


@pytest.mark.parametrize("k", [1, 2])
def test_dropless_plan_equals_a_collapsed_router_run(k):
    m = deepspeed_layer(k, collapsed=True)
    peak, loads = measured(m)
    assert loads == [B * T] * k + [0] * (E - k)  # DeepSpeed's gate saw the case the plan assumes
    assert planned(m) == peak


@pytest.mark.parametrize("k", [1, 2])
def test_dropless_plan_bounds_a_balanced_run(k):
    m = deepspeed_layer(k, collapsed=False)
    peak, loads = measured(m)
    assert loads == [B * T * k // E] * E
    assert planned(m) > peak
