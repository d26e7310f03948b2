"""``+strategy=lora``: low-rank adapters on the targeted Linear layers, every base parameter frozen
(Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models").

A targeted ``nn.Linear`` (``strategy.lora.targets``: fnmatch globs over module names; empty: the
attention projections of the model's family) becomes a ``LoRALinear`` that keeps the base ``weight``
and ``bias`` (same parameter objects, same names: the seeded init and ``model.init_from`` fill them as
before) and gains ``lora_A`` (rank x in, Kaiming-uniform from (seed, name), as PEFT) and ``lora_B``
(out x rank, zeros, so the adapted model starts as the base model):

    y = x W^T + b + (alpha / rank) * dropout(x) A^T B^T

Every parameter that is not an adapter is frozen (``memopt.freeze``): the engines keep no gradient and
no optimizer state for it, so the ``grads`` and ``optim`` bytes are the adapters' alone. The
activations are those of the base model plus the adapters' small (tokens x rank) intermediates: the
frozen layers still propagate gradients to their inputs.

Saving (``strategy.lora.save``): resumable checkpoints always hold the base weights and the adapters
unmerged (an exact resume). ``model.pt`` holds either ``merged``: W + (alpha/rank) B A written under
the base weight names, a plain model for ``memopt.load_model`` and ``python -m memopt.export``; or
``adapters``: the adapter tensors alone with the options needed to put them back
(``load_adapters(model, path)`` onto the base model).
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from memopt.errors import ConfigError
from memopt.freeze import match_globs
from memopt.strategies.base import Build, Strategy, register

SAVES = ("adapters", "merged")
DEFAULT_TARGETS = {"gpt": ["*.attn.qkv", "*.attn.proj"], "llama": ["*.q_proj", "*.k_proj", "*.v_proj", "*.o_proj"]}
ADAPTER_LEAVES = ("lora_A", "lora_B")


@dataclass
class LoraConfig:
    """``+strategy=lora``: adapter rank, scale, dropout, which Linear layers, and what model.pt holds."""

    rank: int = 8  # r: lora_A is (r, in), lora_B (out, r)
    alpha: float = 16.0  # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapter's input
    targets: list[str] = field(default_factory=list)  # fnmatch globs over module names; []: attention projections
    save: str = "merged"  # model.pt: merged (W + alpha/r B A under the base names) | adapters (lora_A/lora_B alone)


class LoRALinear(nn.Linear):
    """A Linear layer with a low-rank adapter: ``x W^T + b + scale * B(A(dropout(x)))``."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias  # the same parameters (tied ones stay tied)
        dev = base.weight.device
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, device=dev, dtype=base.weight.dtype))
        self.lora_B = nn.Parameter(torch.empty(self.out_features, rank, device=dev, dtype=base.weight.dtype))
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        self.lora_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        return out + self.scale * F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}"


def targets_of(c: LoraConfig, model_cfg) -> list[str]:
    return list(c.targets) or DEFAULT_TARGETS.get(model_cfg.arch, [])


def targeted(model: nn.Module, c: LoraConfig) -> list[str]:
    """Names of the Linear modules the targets match; refuses a glob that matches no Linear layer and a
    target whose weight is tied to another parameter (merging would change both)."""
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    globs = targets_of(c, model.cfg)
    if not globs:
        raise ConfigError(f"strategy.lora.targets is empty and model.arch={model.cfg.arch} has no default targets; "
                          f"name the Linear layers, e.g. strategy.lora.targets=[{next(iter(linears), '*.proj')}]")
    out = match_globs(list(linears), globs, "strategy.lora.targets", "Linear layer", model.cfg.name)
    owners: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(n)
    for n in out:
        names = owners[id(linears[n].weight)]
        if len(names) > 1:
            raise ConfigError(f"strategy.lora.targets: {n} shares its weight with {', '.join(x for x in names if x != n + '.weight')} "
                              "(tied embeddings): an adapter there would change both when merged; leave it out of the targets")
    return out


def adapter_init(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """lora_A: Kaiming-uniform (a=sqrt(5), PyTorch's Linear init, as PEFT), from (seed, name); lora_B: zeros."""
    if name.endswith(".lora_B"):
        return torch.zeros(shape)
    bound = 1.0 / math.sqrt(shape[1])
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return torch.rand(shape, generator=g) * (2 * bound) - bound


class AdapterInit:
    """``model.init_tensor`` with the adapters' values; every other name goes to the model's (or the checkpoint's)."""

    def __init__(self, fallback):
        self.fallback = fallback

    def __call__(self, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        if name.rsplit(".", 1)[-1] in ADAPTER_LEAVES:
            return adapter_init(name, shape, seed)
        return self.fallback(name, shape, seed)


def install_adapters(model: nn.Module, names: list[str], rank: int, alpha: float, dropout: float) -> None:
    for n in names:
        parent, _, leaf = n.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, leaf, LoRALinear(getattr(owner, leaf), rank, alpha, dropout))


def is_adapter(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ADAPTER_LEAVES


def _meta_model(cfg):
    from torch.utils._python_dispatch import _disable_current_modes

    from memopt.models import model_class

    with _disable_current_modes(), torch.device("meta"):
        return model_class(cfg.model)(cfg.model)


@register
class Lora(Strategy):
    name, Config, phase, order = "lora", LoraConfig, "model", 50
    excludes = ("tp",)
    excludes_why = "tensor parallelism splits the Linear layers' weights and the adapters are not split with them"

    def validate(self, c: LoraConfig, cfg) -> None:
        if c.rank < 1:
            raise ConfigError(f"strategy.lora.rank={c.rank} must be >= 1 (the adapters' inner width, e.g. 8)")
        if not c.alpha > 0:
            raise ConfigError(f"strategy.lora.alpha={c.alpha} must be > 0 (the adapter output is scaled by alpha/rank)")
        if not 0 <= c.dropout < 1:
            raise ConfigError(f"strategy.lora.dropout={c.dropout} must be in [0, 1)")
        if c.save not in SAVES:
            raise ConfigError(f"strategy.lora.save={c.save!r} is not one of: {', '.join(SAVES)}")
        names = targeted(_meta_model(cfg), c)  # the globs against the model's Linear layers, on meta
        if "lm_head" in names and getattr(cfg.strategy, "chunked_loss", None) is not None:
            raise ConfigError("strategy.lora.targets includes lm_head with +strategy=chunked_loss, whose loss reads the "
                              "head's weight directly (the adapter would be skipped); leave lm_head out of the targets "
                              "or drop chunked_loss")

    @staticmethod
    def adapt(model: nn.Module, c: LoraConfig) -> None:
        """The targeted Linear layers made ``LoRALinear``, every other parameter frozen (``apply``;
        ``memopt.freeze.check`` builds the same model on meta to check its globs)."""
        names = targeted(model, c)
        for p in model.parameters():
            p.requires_grad_(False)
        install_adapters(model, names, c.rank, c.alpha, c.dropout)

    def apply(self, model, c: LoraConfig, build: Build) -> None:
        self.adapt(model, c)
        model.init_tensor = AdapterInit(model.init_tensor)

    def num_params(self, n: int, c: LoraConfig, cfg) -> int:
        model = _meta_model(cfg)
        return n + sum(c.rank * (m.in_features + m.out_features) for m in map(model.get_submodule, targeted(model, c)))

    # model.pt (compose.saved_model) ------------------------------------------------------------
    def saved(self, record: dict, items, c: LoraConfig, cfg):
        names = targeted(_meta_model(cfg), c)
        if c.save == "adapters":
            record = {**record, "lora": {"rank": c.rank, "alpha": c.alpha, "modules": names}}
            return record, ((n, v) for n, v in items if is_adapter(n))
        return record, merged(items, c.alpha / c.rank, names)


def merged(items, scale: float, modules: list[str]):
    """(name, tensor) pairs with the weight of each adapted layer (``modules``) replaced by
    W + scale * B A (fp32) and the adapters dropped; everything else passes through untouched. Of an
    adapted layer, what arrives first (the adapters: small) is copied until the rest arrives."""
    modules, held = set(modules), {}
    for name, value in items:
        prefix, _, leaf = name.rpartition(".")
        if prefix not in modules or leaf not in ("weight", *ADAPTER_LEAVES):
            yield name, value
            continue
        h = held.setdefault(prefix, {})
        h[leaf] = value.detach().to("cpu", torch.float32, copy=True)
        if len(h) == 3:
            del held[prefix]
            yield f"{prefix}.weight", h["weight"].add_(h["lora_B"] @ h["lora_A"], alpha=scale)
    if held:
        raise RuntimeError(f"model.pt: {sorted(held)[0]} is missing its base weight or an adapter ({sorted(held[sorted(held)[0]])} arrived)")


def load_adapters(model: nn.Module, path: str) -> nn.Module:
    """Put the adapters of a ``strategy.lora.save=adapters`` model.pt (``path``: it or its run dir) onto
    ``model`` (the base model, e.g. ``memopt.load_model`` of the base run), in place; returns it."""
    import os

    if os.path.isdir(path):
        path = os.path.join(path, "model.pt")
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    rec = ckpt.get("lora")
    if rec is None:
        raise ValueError(f"{path} holds no LoRA adapters (a plain or merged model: load it with memopt.load_model)")
    dev = next(model.parameters()).device
    install_adapters(model, rec["modules"], rec["rank"], rec["alpha"], 0.0)
    with torch.no_grad():
        for name, t in ckpt["state_dict"].items():
            model.get_parameter(name).copy_(t.to(dev))
    return model
