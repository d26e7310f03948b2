"""Engines: who implements the selected strategies. One module or package per engine, one line each
in ``ENGINES`` (imported on use, so DeepSpeed is imported only by the runs that need it).

``engine=memopt|deepspeed|fsdp2`` names the engine; with ``engine=memopt`` a strategy that names an
engine of its own (``chunk`` -> the chunk engine) selects that one (``resolve``); with ``engine=deepspeed``
``+strategy=pipeline`` selects DeepSpeed's pipeline engine (``deepspeed_pipe``).
"""
from __future__ import annotations

import importlib

from memopt.engines.base import refuse_unsupported
from memopt.errors import ConfigError
from memopt.parallel.dims import expected_world, resolve_sizes
from memopt.strategies.base import registry, selected

ENGINES = {
    "memopt": "memopt.engines.memopt",
    "chunk": "memopt.engines.chunk",
    "deepspeed": "memopt.engines.deepspeed",
    "fsdp2": "memopt.engines.fsdp2",
    "pipeline": "memopt.engines.pipeline",
    "ps": "memopt.engines.ps",
    "deepspeed_pipe": "memopt.engines.deepspeed_pipe",
}
PUBLIC = ("memopt", "deepspeed", "fsdp2")  # the values of ``engine=``; chunk, pipeline and ps are chosen by their strategies
# (and deepspeed_pipe by +strategy=pipeline under engine=deepspeed)


def resolve(cfg) -> str:
    """The engine that runs ``cfg``: ``engine.name``, or the engine a selected strategy names."""
    name = cfg.engine.name
    if name not in PUBLIC:
        raise ConfigError(f"engine.name={name!r} is not one of: {', '.join(PUBLIC)}")
    if name == "memopt":
        own = {s.engine for s, _ in selected(cfg) if s.engine is not None}
        if len(own) > 1:
            raise ConfigError(f"the selected strategies need different engines ({', '.join(sorted(own))}); select one")
        if own:
            return own.pop()
    if name == "deepspeed" and "pipeline" in cfg.strategy.selected():  # DeepSpeed's PipelineModule engine
        return "deepspeed_pipe"
    return name


def engine_module(cfg):
    return module_named(resolve(cfg))


def module_named(name: str):
    """Engine ``name``'s module (its ``SUPPORTS``, ``PARALLEL`` and traits)."""
    return importlib.import_module(ENGINES[name])


def validate(cfg) -> None:
    """The engine's support of the selected strategies and of the parallel dimensions, then its own rules."""
    mod = engine_module(cfg)
    sizes = resolve_sizes(cfg.parallel, expected_world(cfg))
    for dim in ("pp", "dp_replicate", "ep", "tp"):
        if sizes[dim] > 1 and dim not in mod.PARALLEL:
            raise ConfigError(
                f"parallel.{dim}={sizes[dim]} is not supported by {mod.LABEL} (engine={cfg.engine.name}): it uses "
                f"the {', '.join(mod.PARALLEL)} dimension only; set parallel.{dim}=1"
                + (" (replicate x shard is built for engine=fsdp2: HSDP)" if dim == "dp_replicate" else "")
                + (" (pipeline stages are built by +strategy=pipeline with engine=memopt)" if dim == "pp" else ""))
    for dim in ("pp", "ep", "tp"):  # model-parallel dimensions: some selected strategy must split work over them
        if sizes[dim] > 1 and not any(dim in s.uses for s, _ in selected(cfg)):
            users = [n for n, s in registry().items() if dim in s.uses]
            raise ConfigError(f"parallel.{dim}={sizes[dim]} is not supported without a strategy that splits work over "
                              f"it (" + (", ".join(f"+strategy={u}" for u in users) or "none is built") +
                              f"); set parallel.{dim}=1")
    if "auto" in cfg.strategy.selected():  # replaced by its choice before any rank starts; the choice is validated
        return
    if hasattr(mod, "validate"):
        mod.validate(cfg)  # its own refusals, the unsupported strategies included
    else:
        refuse_unsupported(cfg, cfg.engine.name, mod.LABEL, mod.SUPPORTS)
    t = cfg.trainer
    if (t.checkpoint_every or t.resume) and not getattr(mod, "CHECKPOINTS", True):
        raise ConfigError(f"resumable checkpoints (trainer.checkpoint_every, trainer.resume) are not built for {mod.LABEL} "
                          f"(engine={cfg.engine.name}); set trainer.checkpoint_every=0 and no trainer.resume")


def build_engine(cfg, device, dims, tracker):
    """The engine that implements the selected strategies, built."""
    return engine_module(cfg).build(cfg, device, dims, tracker)
