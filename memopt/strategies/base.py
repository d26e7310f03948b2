"""What a strategy is, and the registry that the Hydra schema, the validation and the composition
are assembled from.

A strategy is one module in ``memopt/strategies/`` holding its typed options (a dataclass), a
``Strategy`` subclass decorated with ``@register`` (its rules and, for model-phase strategies, the
step that applies it), and one yaml in ``conf/strategy/``. Nothing else names it: the schema field
``strategy.NAME``, the conflict checks and the engines' support checks all read the registry.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import pkgutil
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from memopt.errors import ConfigError

# Where the composition applies a strategy, in this order (see memopt/compose.py):
#   model      changes the model on meta (attention kernel, checkpointing, ...): ``apply`` is called
#   precision  parameter / compute dtype and the loss scaler (read by every engine)
#   partition  who holds which parameters, gradients and states (ZeRO stages, the chunk engine)
#   offload    where optimizer states and the step live (read by the engine that owns the step)
PHASES = ("model", "precision", "partition", "offload")


@dataclass
class Build:
    """What applying a strategy may need beside the model: the run's config, device, mesh and tracker."""

    cfg: Any
    device: Any
    dims: Any
    tracker: Any


class Strategy:
    """One memory strategy (subclasses set the class attributes; instances are stateless).

    name      ``+strategy=NAME`` and the ``strategy.NAME`` key of its options
    Config    dataclass of its options
    phase     one of PHASES
    order     position among the model-phase strategies (lower is applied first)
    group     strategies of one group exclude each other (with ``group_why`` saying why)
    requires  strategies that must be selected with it (``requires_why`` says why)
    excludes  strategies it cannot be combined with (``excludes_why`` says why: one text, or one per name)
    engine    the engine that implements it when ``engine=memopt`` (e.g. chunk); None: memopt's own
    """

    name: ClassVar[str]
    Config: ClassVar[type]
    phase: ClassVar[str] = "model"
    order: ClassVar[int] = 0
    group: ClassVar[Optional[str]] = None
    group_why: ClassVar[str] = ""
    requires: ClassVar[tuple[str, ...]] = ()
    requires_why: ClassVar[str] = ""
    excludes: ClassVar[tuple[str, ...]] = ()
    excludes_why: ClassVar[str | dict[str, str]] = ""
    engine: ClassVar[Optional[str]] = None
    uses: ClassVar[tuple[str, ...]] = ()  # parallel dimensions besides data parallelism it splits work over (moe: ep)

    def validate(self, opts, cfg) -> None:
        """Rules on its own fields and against the model / trainer; raise ConfigError naming field and fix."""

    def apply(self, model, opts, build: Build) -> None:
        """Model-phase strategies: change ``model`` (on meta) in place."""
        raise NotImplementedError(f"strategy {self.name} has no model step (phase {self.phase})")

    # A model-phase strategy that changes the architecture (moe) also changes what the model's
    # classmethods count from the config; ``memopt.compose`` folds these in, in registry order.
    def num_params(self, n: int, opts, cfg) -> int:
        """The model's parameter count once this strategy is applied (``n``: the count before it)."""
        return n

    def flops_per_token(self, f: float, opts, cfg) -> float:
        """Training FLOPs per token once this strategy is applied (``f``: the count before it)."""
        return f

    # A strategy that changes the architecture (moe) is recorded in model.pt (``compose.model_record``)
    # and rebuilt by ``memopt.load_model`` through ``install`` (no mesh: everything on one process).
    architecture = False

    def install(self, model, opts, model_cfg) -> None:
        """Put this strategy's modules into a single-process ``model`` (``architecture`` strategies)."""
        raise NotImplementedError

    def saved(self, record: dict, items, opts, cfg):
        """What model.pt holds: the record and the (name, tensor) pairs the engine streams, changed by a
        strategy that saves something else (lora: merged weights, or its adapters alone)."""
        return record, items

    def active_params(self, n: int, opts, cfg) -> int:
        """Parameters one token meets once this strategy is applied (moe: only its top_k experts)."""
        return self.num_params(n, opts, cfg)


_REGISTRY: dict[str, Strategy] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: add a strategy to the registry under ``cls.name``."""
    if cls.phase not in PHASES:
        raise ValueError(f"strategy {cls.name}: phase {cls.phase!r} is not one of {PHASES}")
    _REGISTRY[cls.name] = cls()
    return cls


def registry() -> dict[str, Strategy]:
    """Every strategy, in composition order (phase, then ``order``, then name). Imports each module of
    ``memopt.strategies`` once, so that a new module is found without being listed anywhere."""
    for mod in pkgutil.iter_modules([os.path.dirname(__file__)]):
        if mod.name != "base":
            importlib.import_module(f"{__package__}.{mod.name}")
    ranked = sorted(_REGISTRY.values(), key=lambda s: (PHASES.index(s.phase), s.order, s.name))
    return {s.name: s for s in ranked}


def schema() -> type:
    """The ``strategy`` node of the config: one optional field per registered strategy."""
    fields = [(name, Optional[s.Config], dataclasses.field(default=None)) for name, s in registry().items()]

    def selected(self) -> list[str]:
        """Names of the selected strategies (those whose options are set), in composition order."""
        return [k for k, v in self.__dict__.items() if v is not None]

    return dataclasses.make_dataclass("StrategyConfig", fields, namespace={"selected": selected,
                                      "__doc__": "The selected strategies: ``+strategy=NAME`` sets ``strategy.NAME``."})


def check_combination(names: list[str]) -> None:
    """Group, requires and excludes rules over the selected strategy names."""
    reg = registry()
    unknown = [n for n in names if n not in reg]
    if unknown:
        raise ConfigError(f"strategy {unknown[0]} is not registered; available: {', '.join(reg)}")
    chosen = [reg[n] for n in names]
    for s in chosen:
        for need in s.requires:
            if need not in names:
                why = f" ({s.requires_why})" if s.requires_why else ""
                raise ConfigError(f"strategy {s.name} needs strategy {need}{why}: use +strategy=[{need},{s.name}]")
    for i, a in enumerate(chosen):
        for b in chosen[i + 1:]:
            if a.group is not None and a.group == b.group:
                raise ConfigError(f"strategies {a.name} and {b.name} are mutually exclusive: {a.group_why or a.group}; "
                                  f"drop +strategy={b.name}, or drop {a.name} to use {b.name}")
            for x, y in ((a, b), (b, a)):
                if y.name in x.excludes:
                    why = x.excludes_why.get(y.name, "") if isinstance(x.excludes_why, dict) else x.excludes_why
                    raise ConfigError(f"strategies {x.name} and {y.name} are mutually exclusive: {why}; "
                                      f"drop +strategy={y.name}, or drop {x.name} to use {y.name}")


def validate(cfg) -> None:
    """Every selected strategy's rules, then its own field checks."""
    names = cfg.strategy.selected()
    check_combination(names)
    reg = registry()
    for n in names:
        reg[n].validate(getattr(cfg.strategy, n), cfg)


def selected(cfg, phase: str | None = None) -> list[tuple[Strategy, Any]]:
    """(strategy, its options) for the selected strategies of ``phase`` (all phases: None), in order."""
    reg = registry()
    return [(s, getattr(cfg.strategy, n)) for n, s in reg.items()
            if getattr(cfg.strategy, n, None) is not None and phase in (None, s.phase)]
