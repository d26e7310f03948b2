"""The pipeline engine, selected by ``+strategy=pipeline``: engine.py (build, the step, weights and
checkpoints), stages.py (the split and the stage modules), schedules.py (the schedules and their
formulas: micro-batches in flight, bubble, boundary bytes)."""
from memopt.engines.pipeline.engine import LABEL, NAME, PARALLEL, SUPPORTS, PipelineEngine, build, validate

__all__ = ["LABEL", "NAME", "PARALLEL", "SUPPORTS", "PipelineEngine", "build", "validate"]
