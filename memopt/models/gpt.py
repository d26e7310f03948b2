"""A GPT-2 style decoder in one readable file.

Pre-LayerNorm blocks, learned or rotary positions, tied input/output embeddings, GELU MLP and
causal self-attention whose core is pluggable (``sdpa``, ``naive``; the Triton kernel through its slot).

Shape legend used in the comments: B batch, T sequence length, C d_model, H heads, D head dim
(C = H * D), V vocabulary.

It implements the model interface of ``memopt/models/base.py``:
- ``GPT.blocks`` is a ``ModuleList`` so that activation checkpointing, ZeRO-3 gathering and the chunk
  engine can hook one block at a time; the stack runs through ``block_runner`` (checkpointing's slot).
- Slots: ``attention_core`` (``CausalSelfAttention.core``, its own module so that selective
  checkpointing can recompute only the scores/softmax and FlashAttention can replace it) and ``mlp``.
- Weights are created on any device (``meta`` included) and filled by ``init_weights(seed)``: each
  parameter's values depend only on the seed and the parameter's name, never on the order or
  the rank that materialises it, so every partitioning starts from the single-process weights.
"""
from __future__ import annotations

import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from memopt.errors import ConfigError
from memopt.models.base import Model, ModelConfig


GPTConfig = ModelConfig  # the GPT reads every field of the common model config


def count_params(cfg: GPTConfig) -> int:
    """Number of parameters, from the config alone (tied embeddings counted once)."""
    C, L, V, T = cfg.d_model, cfg.n_layer, cfg.vocab_size, cfg.seq_len
    b = 1 if cfg.bias else 0
    ln = C * (1 + b)
    attn = C * 3 * C + b * 3 * C + C * C + b * C
    mlp = mlp_params(cfg)
    block = 2 * ln + attn + mlp
    emb = V * C + (T * C if cfg.pos_emb == "learned" else 0)
    head = 0 if cfg.tie_embeddings else V * C
    return L * block + emb + ln + head


def mlp_params(cfg: GPTConfig, d_ff: int | None = None) -> int:
    """Parameters of one block's MLP (fc and proj, with their biases) of hidden width d_ff (None: cfg.ff)."""
    C, F_, b = cfg.d_model, d_ff if d_ff is not None else cfg.ff, 1 if cfg.bias else 0
    return C * F_ + b * F_ + F_ * C + b * C


def flops_per_token(cfg: GPTConfig) -> float:
    """Training FLOPs per token: 6 N for the matmuls with the weights plus 12 L C T for attention.

    N excludes the position table (no matmul) but includes the output projection onto the
    vocabulary, tied or not (Kaplan et al. 2020; PaLM appendix B). Recomputation from activation
    checkpointing is not counted, so MFU stays comparable across strategies.
    """
    n = count_params(cfg) - (cfg.seq_len * cfg.d_model if cfg.pos_emb == "learned" else 0)
    return 6.0 * n + 12.0 * cfg.n_layer * cfg.d_model * cfg.seq_len


def rope_cache(T: int, D: int, device, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (T, D/2) for rotary position embeddings (Su et al. 2021)."""
    inv = 1.0 / (base ** (torch.arange(0, D, 2, device=device, dtype=torch.float32) / D))
    ang = torch.outer(torch.arange(T, device=device, dtype=torch.float32), inv)  # (T, D/2)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., 2i], x[..., 2i+1]) of x (B, H, T, D) by position-dependent angles."""
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()  # (B, H, T, D/2) each
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # (B, H, T, D/2, 2)
    return out.flatten(-2).to(x.dtype)


class AttentionCore(nn.Module):
    """softmax(q k^T / sqrt(D) + causal mask) v, without parameters.

    ``impl`` chooses the kernel: ``sdpa`` (PyTorch's fused attention) or ``naive`` (explicit (T, T)
    score matrix: the reference, and what FlashAttention saves memory against). The Triton kernel
    replaces this module through the ``attention_core`` slot (``+strategy=flash_attn``).
    """

    def __init__(self, impl: str, dropout: float):
        super().__init__()
        if impl not in ("sdpa", "naive"):
            raise ValueError(f"model.attention={impl!r} is not one of: sdpa, naive")
        self.impl = impl
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q, k, v: (B, H, T, D) -> (B, H, T, D)
        p = self.dropout if self.training else 0.0
        if self.impl == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        T = q.size(-2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))  # (B, H, T, T)
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        att = att.masked_fill(~mask, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = F.dropout(att, p=p, training=self.training)
        return att @ v  # (B, H, T, D)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.d_model % cfg.n_head:
            raise ValueError(f"model.d_model={cfg.d_model} is not divisible by model.n_head={cfg.n_head}")
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.core = AttentionCore(cfg.attention, cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        B, T = x.shape[:2]
        qkv = self.qkv(x)  # (B, T, 3C); tensor parallelism: 3C/tp columns, the q, k, v of this rank's heads
        C = qkv.size(-1) // 3
        q, k, v = qkv.split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, D)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, D)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        y = self.core(q, k, v)  # (B, H, T, D)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.ff, bias=cfg.bias)
        self.proj = nn.Linear(cfg.ff, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (B, T, C) -> (B, T, 4C) -> (B, T, C)
        return self.drop(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), rope)  # (B, T, C)
        x = x + self.mlp(self.ln2(x))  # (B, T, C)
        return x


class GPT(Model):
    SLOTS = {"attention_core": "attn.core", "mlp": "mlp"}

    def __init__(self, cfg: GPTConfig):
        super().__init__(cfg)
        if cfg.pos_emb not in ("learned", "rope"):
            raise ValueError(f"model.pos_emb={cfg.pos_emb!r} is not one of: learned, rope")
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)  # (V, C)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model) if cfg.pos_emb == "learned" else None  # (T, C)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)  # (V, C)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx, targets: (B, T) int64 token ids. Returns logits (B, T, V) and the mean loss (or None).

        The logits are None when the ``loss_head`` slot never materialises them (``chunked_loss``)."""
        B, T = idx.shape
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length {T} exceeds model.seq_len={self.cfg.seq_len}")
        x = self.wte(idx)  # (B, T, C)
        rope = None
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(T, device=idx.device))  # (B, T, C)
        else:
            rope = rope_cache(T, self.cfg.head_dim, idx.device, self.cfg.rope_theta)
        x = self.drop(x)
        x = self.block_runner(self.blocks, x, rope)  # (B, T, C)
        x = self.ln_f(x)
        return self.loss_head(x, self.lm_head, targets)  # logits (B, T, V) or None (chunked_loss), loss

    # ---- the model interface (memopt.models.base) ---------------------------------------------
    @classmethod
    def num_params(cls, cfg: GPTConfig) -> int:
        return count_params(cfg)

    @classmethod
    def flops_per_token(cls, cfg: GPTConfig) -> float:
        return flops_per_token(cfg)

    @classmethod
    def mlp_params(cls, cfg: GPTConfig, d_ff: int | None = None) -> int:
        return mlp_params(cfg, d_ff)

    @classmethod
    def validate(cls, cfg: GPTConfig) -> None:
        super().validate(cfg)
        if cfg.d_model % cfg.n_head:
            raise ConfigError(f"model.d_model={cfg.d_model} is not divisible by model.n_head={cfg.n_head}")
        if cfg.pos_emb not in ("learned", "rope"):
            raise ConfigError(f"model.pos_emb={cfg.pos_emb!r} is not one of: learned, rope")
        if cfg.pos_emb == "rope" and cfg.head_dim % 2:
            raise ConfigError(f"model.pos_emb=rope needs an even head dim; d_model/n_head = {cfg.head_dim}")
        if cfg.kv_heads != cfg.n_head:
            raise ConfigError(f"model.n_kv_head={cfg.n_kv_head}: model.arch=gpt has multi-head attention only (n_kv_head "
                              f"null or n_head={cfg.n_head}); grouped-query attention is model.arch=llama")
        if cfg.rope_scaling is not None:
            raise ConfigError(f"model.rope_scaling={cfg.rope_scaling!r}: model.arch=gpt has no rotary frequency scaling "
                              "(set it to null); Llama 3.1's is model.arch=llama")
        if cfg.rope_theta <= 0:
            raise ConfigError(f"model.rope_theta={cfg.rope_theta} must be > 0")
        if cfg.attention not in ("sdpa", "naive"):
            hint = " (FlashAttention is a strategy: +strategy=flash_attn checks the head dim and the device)" \
                if cfg.attention == "flash" else ""
            raise ConfigError(f"model.attention={cfg.attention!r} is not one of: sdpa, naive{hint}")

    def init_tensor(self, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        """GPT-2 init from (seed, name): see ``init_tensor``."""
        return init_tensor(name, shape, seed, self.cfg)


def init_tensor(name: str, shape: tuple[int, ...], seed: int, cfg: GPTConfig) -> torch.Tensor:
    """The initial value of parameter ``name`` (a float32 CPU tensor).

    GPT-2 init: normal(0, init_std) for matrices and embeddings, init_std / sqrt(2 L) for the
    residual output projections (every ``proj`` of attention and MLP, MoE experts' included), zeros for biases, ones for LayerNorm weights. Values are drawn on
    the CPU in float32 with a per-parameter generator seeded from (seed, name), then copied to the
    parameter's device and dtype, so they are identical on every device, rank and partitioning.
    """
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias":
        return torch.zeros(shape)
    if ".ln" in "." + name:  # LayerNorm weights: blocks.i.ln1/ln2, ln_f
        return torch.ones(shape)
    std = cfg.init_std
    if name.endswith(".proj.weight") and (".attn." in name or ".mlp." in name):  # mlp.experts.<e>.proj too
        std = cfg.init_std / math.sqrt(2 * cfg.n_layer)
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return torch.randn(shape, generator=g) * std
