"""Optimizers: the step sequence every engine shares (step.py), the learning-rate schedule
(schedule.py), AdamW over flat groups (adamw.py) and the host AdamW with its C++ kernel (cpu_adam.py)."""
from memopt.optim.schedule import lr_at
from memopt.optim.step import StepResult, StepSequence

__all__ = ["StepResult", "StepSequence", "lr_at"]
