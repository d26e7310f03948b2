"""The planner's wing (``memopt/planner/engines/``): one entry per engine of ``engines.ENGINES``, looked
up by the resolved engine, and no test of an engine's name anywhere in the planner."""
from __future__ import annotations

import os
import re

from tests.conftest import typed

PLANNER = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "memopt", "planner")


def test_the_wing_mirrors_the_engines():
    from memopt.engines import ENGINES
    from memopt.planner.engines import WINGS

    assert set(WINGS) == set(ENGINES)


def test_the_wing_is_the_resolved_engines():
    from memopt.planner.engines import wing

    assert wing(typed(["+strategy=hybrid_adam"])).replay is not None  # engine=memopt, the chunk engine by its strategy
    assert wing(typed(["engine=deepspeed", "+strategy=zero2"])).rules is not None
    assert wing(typed(["engine=fsdp2", "+strategy=zero3"])).process_group_always
    plain = wing(typed([]))
    assert plain.window_check is not None and plain.rules is None and plain.replay is None and plain.rank_layouts is None


def test_no_engine_name_is_tested_in_the_planner():
    name_test = re.compile(r"engine\.name\s*[!=]=|resolve\(cfg\)\s*[!=]=|[!=]=\s*\"(memopt|chunk|deepspeed|fsdp2|pipeline|ps)\"")
    found = []
    for root, _, files in os.walk(PLANNER):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                found += [f"{os.path.relpath(path, PLANNER)}:{i}" for i, line in enumerate(open(path), 1) if name_test.search(line)]
    assert not found, found
