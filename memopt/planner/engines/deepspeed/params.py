"""The model's parameters as DeepSpeed's translation holds, groups and communicates them (``engines/deepspeed.py``),
read from the model built on meta: what DeepSpeed's rules (``rules.py``, ``reductions.py``) size their buffers by."""
from __future__ import annotations


def param_bytes(cfg) -> int:
    """Bytes of DeepSpeed's parameters: the precision's weights (fp16 keeps fp16: params=fp32 is refused;
    fp32 under bf16 autocast), as the engine builds them."""
    from memopt.strategies.precision import Precision

    return Precision.of(cfg).param_dtype.itemsize


def autocast_bf16(cfg) -> bool:
    """bf16 over fp32 weights: the translation's ``torch_autocast`` (engines/deepspeed.py)."""
    return cfg.strategy.bf16 is not None and cfg.strategy.bf16.params != "bf16"


def last_value(cache: dict, key: str, make):
    """``make()``, or its value for the same key as the last call."""
    if key not in cache:
        cache.clear()
        cache[key] = make()
    return cache[key]


_META: dict[str, tuple] = {}


def meta_params(cfg) -> tuple[tuple[int, int, bool], ...]:
    """(numel, ndim, lower-precision safe) of each distinct parameter of the model built on meta; safe:
    its module's exact class is one DeepSpeed's torch_autocast communicates in bf16 (Linear, Conv). The rules
    read it a dozen times a plan (a build of gpt_10b on meta: ~75 ms): kept for the last model asked."""
    def build() -> tuple:
        import torch
        from deepspeed.runtime.torch_autocast import LOWER_PRECISION_SAFE_MODULES
        from torch.utils._python_dispatch import _disable_current_modes

        from memopt.models import model_class

        with _disable_current_modes(), torch.device("meta"):
            model = model_class(cfg.model)(cfg.model)
        safe = {id(p) for m in model.modules() if m.__class__ in LOWER_PRECISION_SAFE_MODULES
                for p in m.parameters(recurse=False)}
        return tuple((p.numel(), p.ndim, id(p) in safe) for p in model.parameters())

    return last_value(_META, repr(cfg.model), build)


_RANK: dict[str, tuple] = {}


def rank_params(cfg, world: int) -> tuple[tuple[int, int, bool, bool, int], ...]:
    """(numel, ndim, lower-precision safe, an expert's, the size of the data-parallel group it is partitioned and
    reduced over) of each parameter one rank holds, in the model's order: ``meta_params`` over all W ranks, or
    under DeepSpeed-MoE the dense parameters (routers included) over W and the rank's 1 / ep of each MoE layer's
    experts, in optimizer groups of their own, over its expert-data-parallel group of W / ep ranks (DeepSpeed's
    ``expert_dp_process_group``)."""
    if cfg.strategy.moe is None:
        return tuple((n, ndim, safe, False, max(1, world)) for n, ndim, safe in meta_params(cfg))

    def build() -> tuple:
        import re

        import torch
        from deepspeed.runtime.torch_autocast import LOWER_PRECISION_SAFE_MODULES
        from torch.utils._python_dispatch import _disable_current_modes

        from memopt import compose
        from memopt.model_file import logical_model
        from memopt.parallel.dims import resolve_sizes

        ep = resolve_sizes(cfg.parallel, world)["ep"]
        local = cfg.strategy.moe.num_experts // ep
        with _disable_current_modes(), torch.device("meta"):
            model = logical_model(compose.model_record(cfg))
        safe = {id(p) for m in model.modules() if m.__class__ in LOWER_PRECISION_SAFE_MODULES
                for p in m.parameters(recurse=False)}
        out = []
        for name, p in model.named_parameters():  # distinct parameters (a tied head once)
            expert = re.search(r"\.experts\.(\d+)\.", f".{name}")
            if expert is None or int(expert.group(1)) < local:  # the rank's experts: as many as any other's
                out.append((p.numel(), p.ndim, id(p) in safe, bool(expert), max(1, world // ep if expert else world)))
        return tuple(out)

    return last_value(_RANK, repr((cfg.model, cfg.strategy.moe, cfg.parallel, world)), build)


def optimizer_groups(params: tuple) -> list[list[int]]:
    """The indices of ``rank_params`` in each of DeepSpeed's optimizer groups, in its order: the translation's weight
    decay group (ndim >= 2), then the rest, each in the model's order; DeepSpeed-MoE's expert groups after the dense
    ones (``split_params_into_different_moe_groups_for_optimizer`` appends them). Empty groups left out."""
    groups = [[i for i, p in enumerate(params) if p[3] == expert and (p[1] >= 2) == decay]
              for expert in (False, True) for decay in (True, False)]
    return [g for g in groups if g]


def group_sizes(cfg) -> list[int]:
    """Elements of the translation's two optimizer groups: [no weight decay, weight decay (ndim >= 2)]."""
    sizes = [0, 0]
    for n, ndim, _ in meta_params(cfg):
        sizes[ndim >= 2] += n
    return sizes


def bucket_elements(cfg) -> int:
    """ZeRO-1/2's reduce_bucket_size in elements of the parameter dtype (``bucket_mb`` as the translation sets it)."""
    from memopt.strategies.zero import selected_stage

    return max(1, int(selected_stage(cfg)[2].bucket_mb * 2**20 / param_bytes(cfg)))


def comm_dtypes(cfg) -> int:
    """How many reduction buckets DeepSpeed keeps per bucket slot: one per communication dtype. Under
    ``torch_autocast`` the gradients of lower-precision safe modules' parameters communicate in bf16 and
    every other one in its own dtype, each kind in buckets of its own; otherwise one dtype."""
    return len({safe for _, _, safe in meta_params(cfg)}) if autocast_bf16(cfg) else 1


def largest_group(cfg) -> int:
    """Elements of the larger of the translation's two optimizer groups (weight decay on ndim >= 2)."""
    return max(group_sizes(cfg))


def block_numel(cfg) -> int:
    """memopt's zero3 unit as the translation computes it: one block, or the root group (embeddings,
    final LayerNorm, untied head) when that is larger."""
    from memopt import compose

    mc = cfg.model
    ln = mc.d_model * (2 if mc.bias else 1)
    root = mc.vocab_size * mc.d_model * (1 if mc.tie_embeddings else 2) + ln
    root += mc.seq_len * mc.d_model if mc.pos_emb == "learned" else 0
    return max((compose.num_params(cfg) - root) // max(1, mc.n_layer), root, 1)


def largest_param(cfg) -> int:
    return max((n for n, _, _ in meta_params(cfg)), default=0)
