"""``model.freeze=[glob, ...]``: parameters that keep their initial values.

The globs (``fnmatch``, over the names of ``named_parameters`` with the tied names included, e.g.
``wte.*``, ``blocks.0.*``, ``*.ln1.*``) are applied to the model on meta, after the model-phase
strategies and before any engine sees it: a matching parameter gets ``requires_grad=False``. Every
engine reads that flag when it lays the parameters out, so a frozen parameter holds its weights and
nothing else: no gradient buffer, no gradient shard, no optimizer state (memopt's flat groups keep
frozen parameters in groups of their own that the optimizer never sees; the chunk engine packs them
into frozen chunks). Tied weights are one tensor: freezing either name freezes both. The planner
runs this same code on fake tensors, so it counts frozen parameters the same way.
"""
from __future__ import annotations

import fnmatch

import torch

from memopt.errors import ConfigError


def match_globs(names: list[str], globs, field: str, what: str, model_name: str) -> list[str]:
    """The ``names`` any of the fnmatch ``globs`` matches, in glob order, once each; a glob that matches
    none is refused naming ``field``, the glob and a sample of the ``what`` names it was matched against."""
    out: list[str] = []
    for g in globs:
        hit = [n for n in names if fnmatch.fnmatchcase(n, g)]
        if not hit:
            sample = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
            raise ConfigError(f"{field}: the glob {g!r} matches no {what} of model={model_name} "
                              f"(fnmatch over {what} names such as {sample})")
        out += [n for n in hit if n not in out]
    return out


def matching(model: torch.nn.Module, globs, field: str = "model.freeze") -> list[str]:
    """Parameter names (tied names included) matched by any glob; a glob that matches none is refused."""
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    return match_globs(names, globs, field, "parameter", model.cfg.name)


def freeze(model: torch.nn.Module, globs) -> list[str]:
    """Set requires_grad=False on the parameters the globs match; refuse freezing every parameter."""
    if not globs:
        return []
    names = matching(model, list(globs))
    params = dict(model.named_parameters(remove_duplicate=False))
    for n in names:
        params[n].requires_grad_(False)
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"model.freeze={list(globs)} freezes every parameter: nothing is left to train "
                          "(narrow the globs, or use trainer.mode=plan / evaluation for a frozen model)")
    return names


def check(cfg) -> None:
    """``config.validate``: the globs against the composed model's names, on meta, before any rank starts
    (the architecture strategies installed as ``memopt.load_model`` does, lora's adapters added)."""
    if not cfg.model.freeze:
        return
    from torch.utils._python_dispatch import _disable_current_modes

    from memopt.models import model_class
    from memopt.strategies.base import selected

    with _disable_current_modes(), torch.device("meta"):
        model = model_class(cfg.model)(cfg.model)
        for s, opts in selected(cfg, "model"):
            if s.architecture:
                s.install(model, opts, cfg.model)
            elif s.name == "lora":  # its adapters are parameters the globs may name
                s.adapt(model, opts)
    freeze(model, cfg.model.freeze)
