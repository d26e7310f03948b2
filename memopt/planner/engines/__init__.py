"""The planner's wing: what planning an engine needs beyond running its code on fake tensors.

One entry per engine of ``engines.ENGINES``, looked up by the resolved engine (``wing(cfg)``), so the
core (simulate, extrapolate, plan, preflight, search) reads as one path and asks the wing, never the
engine's name. What each wing holds (``base.Wing`` lists the questions, with the default answers):

    memopt     its size buckets' packing, checked while extrapolating; a step's middle micro-batches repeat (memopt.py)
    chunk      the replay of a recorded shallow step at the planned depth, the chunk layout's and decisions'
               checks (chunk/depth.py), ranks of unequal bytes, the engine's own device budget (chunk/)
    deepspeed  DeepSpeed's buffers by its own rules, its ZeRO-3 fetch replayed, DeepSpeed-MoE (deepspeed/)
    deepspeed_pipe  DeepSpeed's pipeline engine: not planned, said so (deepspeed/pipe.py)
    fsdp2      CPUOffloadPolicy's copies made explicit on fake tensors, a process group for one rank, a step's
               middle micro-batches repeat (fsdp2.py)
    pipeline   its stages' model work bounds its step (pipeline.py); otherwise the run's code on fake tensors
    ps         nothing beyond the run's code on fake tensors (the defaults)

Imported on use, as the engines are: DeepSpeed's rules load only for the plans that need them.
"""
from __future__ import annotations

import importlib

from memopt.planner.engines.base import Wing

WINGS = {
    "memopt": "memopt.planner.engines.memopt",
    "chunk": "memopt.planner.engines.chunk",
    "deepspeed": "memopt.planner.engines.deepspeed",
    "fsdp2": "memopt.planner.engines.fsdp2",
    "pipeline": "memopt.planner.engines.pipeline",
    "ps": None,
    "deepspeed_pipe": "memopt.planner.engines.deepspeed.pipe",
}
DEFAULT = Wing()


def wing(cfg) -> Wing:
    """The planning wing of the engine that runs ``cfg`` (``engines.resolve``)."""
    from memopt.engines import resolve

    path = WINGS[resolve(cfg)]
    return importlib.import_module(path).WING if path else DEFAULT
