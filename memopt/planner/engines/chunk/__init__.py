"""The chunk engine's wing (PatrickStar's chunks, Hybrid Adam).

A large chunk in groups of W ranks changes a rank's layout only every W chunks, which no shallow
window follows: the engine is planned by replaying a recorded shallow step at the planned depth
(``replay.py``), its chunk layout and decisions checked where it is extrapolated instead
(``depth.py``), and its ranks hold unequal bytes (a partial last group), so the node's host is
the sum of its ranks' layouts (``plan.node_rank_peaks``). Its own device budget
(``strategy.chunk.device_budget_gb``) is a limit the preflight's hardware bound does not see.
"""
from __future__ import annotations

from memopt.planner.engines.base import Wing
from memopt.planner.engines.chunk import depth

WING = Wing(prepare=depth.prepare, replay=depth.replayed, window_check=depth.window_check,
            sample_check=depth.sample_check, rank_layouts=depth.layouts,
            device_budget=lambda cfg: cfg.strategy.chunk.device_budget_gb, model_bound=lambda cfg: True)
