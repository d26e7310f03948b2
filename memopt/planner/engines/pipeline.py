"""The pipeline engine's wing: its stages together run the composed model's forward and backward of every
micro-batch (the tied output layer's copy and the sends besides), so the model's own work spread over the stages
bounds its slowest stage's step (``planner/model_work.py``); everything else is its code on fake tensors."""
from __future__ import annotations

from memopt.planner.engines.base import Wing

WING = Wing(model_bound=lambda cfg: True)
