"""DeepSpeed's pipeline engine (``engine=deepspeed +strategy=pipeline``): not planned. Its engine does not
run on fake tensors and no rules for it are built, so a plan says so and names the plannable twin."""
from __future__ import annotations

from memopt.planner.engines.base import Wing


def refuse(cfg, backend: str):
    from memopt.planner.simulate import PlanUnsupported

    raise PlanUnsupported("engine=deepspeed +strategy=pipeline is not planned: DeepSpeed's pipeline engine does "
                          "not run on fake tensors and the planner has no rules for it; plan engine=memopt "
                          "+strategy=pipeline (the same stages and schedule)")


WING = Wing(step_patch=refuse)
