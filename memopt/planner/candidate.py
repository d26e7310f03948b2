"""A composition the search or the preflight tries, as typed data: strategy names and field values.

Why typed: a candidate becomes a ``TrainConfig`` copy of the command's (``Candidate.config``), with its
strategies' options built from their ``conf/strategy`` files once per selection (``strategy_node``:
a preset's ``defaults`` pulled in as Hydra does) and its field values set on it. No override string is
composed or parsed per candidate (that was most of a search's time, and strings round-tripped between
typed configs); ``Candidate.overrides`` prints the same composition for the user, as a command-line
tail that Hydra composes to the same config (tests/planner/test_candidate.py checks that against
Hydra for every candidate of several searches).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Any

BATCH = ("trainer.micro_batch_size", "trainer.grad_accum")


@dataclass(frozen=True)
class Candidate:
    """``strategies``: the selection (``+strategy=[...]``, in the order printed); ``options``: (dotted
    field, value) pairs set after the strategies' own options, in the order printed."""

    strategies: tuple[str, ...] = ()
    options: tuple[tuple[str, Any], ...] = ()

    def value(self, key: str, default=None):
        return next((v for k, v in reversed(self.options) if k == key), default)

    def with_options(self, *pairs: tuple[str, Any]) -> Candidate:
        """The candidate with ``pairs`` set: a key it had moves to the end with its new value."""
        keys = {k for k, _ in pairs}
        return Candidate(self.strategies, (*[(k, v) for k, v in self.options if k not in keys], *pairs))

    def extend(self, names=(), *pairs: tuple[str, Any]) -> Candidate:
        """This candidate's strategies and values followed by ``names`` and ``pairs`` (what every candidate
        keeps of the command, ``carried``, extended by a composition)."""
        return Candidate((*self.strategies, *names), (*self.options, *pairs))

    def without(self, *keys: str) -> Candidate:
        return Candidate(self.strategies, tuple((k, v) for k, v in self.options if k not in keys))

    def overrides(self) -> list[str]:
        """The command-line tail that composes this candidate (after the command's own overrides)."""
        return [f"+strategy=[{','.join(self.strategies)}]", *(f"{k}={_fmt(v)}" for k, v in self.options)]

    def label(self) -> str:
        return " ".join(self.overrides())

    def config(self, base):
        """``base`` (a ``TrainConfig`` without a strategy selection of its own, see ``clear``) with this
        candidate's strategies and values."""
        cfg = copy.deepcopy(base)
        cfg.strategy = strategy_node(self.strategies)
        for key, value in self.options:
            set_field(cfg, key, value)
        return cfg


def clear(cfg, parallel: tuple[str, ...] = ()):
    """A copy of the command's config without its strategy selection and with the ``parallel`` fields at
    their defaults: what a candidate is composed on (the search chooses them)."""
    from memopt.parallel.dims import ParallelConfig

    out = copy.deepcopy(cfg)
    out.strategy = strategy_node(())
    for name in parallel:
        setattr(out.parallel, name, getattr(ParallelConfig(), name))
    return out


def carried(cfg) -> Candidate:
    """What every candidate keeps of the command: the strategies that change the model (MoE, named or
    selected by a model preset) with the command's options for them; the search chooses the rest."""
    from memopt.strategies.base import registry

    reg = registry()
    names = tuple(n for n in cfg.strategy.selected() if reg[n].architecture)
    return Candidate(names, kept(cfg, names))


def kept(cfg, names: tuple[str, ...]) -> tuple[tuple[str, Any], ...]:
    """The (field, value) pairs that give ``cfg``'s strategies their options when ``names`` are selected
    afresh: every field of the nodes that selection composes whose value in ``cfg`` differs from the
    strategy files' (the command's own options, or a model preset's MoE)."""
    fresh = strategy_node(tuple(names))
    out = []
    for name in fresh.selected():
        have, default = getattr(cfg.strategy, name), getattr(fresh, name)
        if have is None:
            continue
        for f in dataclasses.fields(have):
            if getattr(have, f.name) != getattr(default, f.name):
                out.append((f"strategy.{name}.{f.name}", getattr(have, f.name)))
    return tuple(out)


def selection(cfg) -> tuple[str, ...]:
    """``cfg``'s selected strategies without those a selected preset pulls in (hybrid_adam's chunk,
    chunked_loss and fp16): the names a command selects."""
    names = cfg.strategy.selected()
    pulled = {d for n in names for d in _pulled(n)}
    return tuple(n for n in names if n not in pulled)


def _pulled(name: str) -> set[str]:
    """The strategies a strategy file pulls in through its ``defaults`` (its composed node's other names)."""
    return set(_group_file(name)) - {name}


def set_field(cfg, key: str, value) -> None:
    *path, last = key.split(".")
    node = cfg
    for p in path:
        node = getattr(node, p)
    if not hasattr(node, last):
        raise AttributeError(f"{key} is not a field of the configuration")
    setattr(node, last, copy.deepcopy(value))


CONF_STRATEGY = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "conf", "strategy")


def strategy_node(names: tuple[str, ...]):
    """The ``strategy`` node that ``+strategy=[names]`` composes (a copy: the caller may change it)."""
    return copy.deepcopy(_strategy_node(tuple(names)))


@functools.lru_cache(maxsize=None)
def _strategy_node(names: tuple[str, ...]):
    from omegaconf import OmegaConf

    from memopt.config import StrategyConfig
    from memopt.strategies.base import registry

    merged = OmegaConf.create({})
    for name in names:
        merged = OmegaConf.merge(merged, _group_file(name))
    reg = registry()
    nodes = {}
    for name in merged:
        typed = OmegaConf.merge(OmegaConf.structured(reg[name].Config), merged[name] or {})
        nodes[name] = OmegaConf.to_object(typed)
    return StrategyConfig(**nodes)


@functools.lru_cache(maxsize=None)
def _group_file(name: str):
    """``conf/strategy/<name>.yaml`` with its ``defaults`` (same group) merged in Hydra's order: the
    entries before ``_self_``, the file, the entries after."""
    from omegaconf import OmegaConf

    raw = OmegaConf.load(os.path.join(CONF_STRATEGY, f"{name}.yaml"))
    defaults = list(raw.pop("defaults", None) or ["_self_"])
    if "_self_" not in defaults:
        defaults.append("_self_")
    out = OmegaConf.create({})
    for entry in defaults:
        out = OmegaConf.merge(out, raw if entry == "_self_" else _group_file(str(entry)))
    return out


def _fmt(value) -> str:
    """A value as Hydra's override grammar reads it back."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_fmt(v) for v in value) + "]"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))  # as a user writes it (4, not 4.0): a float field reads it back as 4.0
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_fmt(v)}" for k, v in value.items()) + "}"
    return str(value)
