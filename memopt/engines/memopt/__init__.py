"""``engine=memopt``: engine.py (build and the engine), flat.py (flat parameter groups),
partitioner.py (the hooks that gather, free and synchronise them)."""
from memopt.engines.memopt.engine import LABEL, NAME, PARALLEL, SUPPORTS, MemoptEngine, build, validate

__all__ = ["LABEL", "NAME", "PARALLEL", "SUPPORTS", "MemoptEngine", "build", "validate"]
