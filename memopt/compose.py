"""The order in which strategies wrap a model, for every engine (torchtitan's parallelize step).

    model on meta                      memopt.models.MODELS[cfg.model.arch]
    -> model-phase strategies          in registry order: flash_attn (attention_core slot),
                                       ckpt (block_runner slot), act_offload (the runner's inputs),
                                       lora (adapters on the targeted Linear layers, the rest frozen)
    -> model.freeze                    matching parameters get requires_grad=False (memopt.freeze)
    -> the engine (engines.resolve):   precision -> partitioner (ddp / ZeRO flat groups, chunk
                                       manager, DeepSpeed, FSDP2) -> materialise and initialise
                                       from the seed -> optimizer (offload: on the host)

The first two steps are here and shared by every engine, so memopt, DeepSpeed and FSDP2 train the
same model; each engine's ``build`` is the rest, on one screen.
"""
from __future__ import annotations

import os

import torch

from memopt.memory.tracker import NullTracker
from memopt.models import Model, model_class
from memopt.strategies.base import Build, selected


def model_on_meta(cfg, device: torch.device, dims, tracker) -> Model:
    """The model on ``meta`` with the selected model-phase strategies applied, in order.

    The model's modules are made with no dispatch mode active: meta tensors hold no bytes (the memory
    tracker counts none), and under the planner's fake mode and tracker each of their initialisers
    (~1,800 ops for 50 GPT blocks) would cost ~0.3 ms for nothing."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.device("meta"):
        model = model_class(cfg.model)(cfg.model)
    if cfg.model.init_from:  # init_tensor reads the Hugging Face directory (before tp wraps it to slice)
        from memopt.hf_checkpoint import install

        install(model)
    build = Build(cfg, device, dims, tracker)
    for strategy, opts in selected(cfg, "model"):
        strategy.apply(model, opts, build)
    from memopt.freeze import freeze

    freeze(model, cfg.model.freeze)  # after the strategies: a glob may name what they added
    return model


def num_params(cfg) -> int:
    """Parameters of the composed model (the model's count, changed by model-phase strategies such as moe)."""
    n = model_class(cfg.model).num_params(cfg.model)
    for strategy, opts in selected(cfg, "model"):
        n = strategy.num_params(n, opts, cfg)
    return n


def model_record(cfg) -> dict:
    """What ``memopt.load_model`` needs to rebuild the trained architecture: the model config and the
    options of the strategies that change it (moe), as plain containers for model.pt and checkpoints."""
    from omegaconf import OmegaConf

    return {"model_config": OmegaConf.to_container(OmegaConf.structured(cfg.model)),
            "architecture": {s.name: OmegaConf.to_container(OmegaConf.structured(o))
                             for s, o in selected(cfg, "model") if s.architecture}}


def tokenizer_record(cfg) -> dict:
    """What the token ids mean (``data.tokenizer``, absolute) for model.pt and a checkpoint's meta.json, which
    ``memopt.export`` writes beside the weights; {} for a byte-level run. Not part of a checkpoint's identity."""
    return {"tokenizer": os.path.abspath(os.path.expanduser(cfg.data.tokenizer))} if cfg.data.tokenizer else {}


def saved_model(cfg, items):
    """model.pt's record and the (name, tensor) pairs it holds, from the engine's ``iter_full_state``
    pairs: the strategies' ``saved`` in order (lora merges its adapters or keeps them alone)."""
    record = {**model_record(cfg), **tokenizer_record(cfg)}
    for strategy, opts in selected(cfg, "model"):
        record, items = strategy.saved(record, items, opts, cfg)
    return record, items


def active_params(cfg) -> int:
    """Parameters one token meets in the composed model (moe: its top_k experts only; dense: all)."""
    n = model_class(cfg.model).num_params(cfg.model)
    for strategy, opts in selected(cfg, "model"):
        n = strategy.active_params(n, opts, cfg)
    return n


def flops_per_token(cfg) -> float:
    """Training FLOPs per token of the composed model (moe: only the active experts count)."""
    f = model_class(cfg.model).flops_per_token(cfg.model)
    for strategy, opts in selected(cfg, "model"):
        f = strategy.flops_per_token(f, opts, cfg)
    return f


def materialize_params(model: torch.nn.Module, device: torch.device, dtype: torch.dtype, storage: bool = False) -> None:
    """Replace meta parameters by parameters on ``device`` (ties kept): empty ones that the engine
    gives storage later, or (``storage``) full-size uninitialised ones."""
    memo: dict[int, torch.nn.Parameter] = {}
    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                if id(p) not in memo:
                    shape = p.shape if storage else (0,)
                    memo[id(p)] = torch.nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=p.requires_grad)
                mod._parameters[name] = memo[id(p)]


def materialize(model: Model, device: torch.device, dtype: torch.dtype, seed: int, tracker=NullTracker()) -> Model:
    """Allocate a meta model whole on ``device`` in ``dtype`` and fill it from the seed (no partitioning)."""
    with tracker.category("params"):
        materialize_params(model, device, dtype, storage=True)
    with tracker.category("temp"):
        model.init_weights(seed)  # float32 values drawn on the CPU, cast on copy
    return model
