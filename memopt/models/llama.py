"""The Llama 3 decoder (Meta's Llama 3 / 3.1 / 3.2 text models) in one readable file.

What differs from ``gpt.py``, and why each piece is there:
- RMSNorm instead of LayerNorm: no mean subtraction and no bias; Llama's norms have a weight only.
- Rotary positions (Su et al. 2021) with Llama 3's base ``rope_theta`` = 500000 and, for Llama 3.1 /
  3.2, its frequency scaling (``rope_scaling=llama3``): low frequencies (wavelengths longer than the
  original context) are divided by ``rope_factor``, high ones kept, the band between interpolated.
  Pairs are (i, i + D/2) ("rotate half"), the layout of Hugging Face checkpoints, so their q and k
  weights load as they are (Meta's own checkpoints pair (2i, 2i+1) and are permuted on conversion).
- SwiGLU MLP (Shazeer 2020): down(silu(gate(x)) * up(x)), hidden width ``d_ff`` (14336 for 8B).
- Grouped-query attention (Ainslie et al. 2023): ``n_kv_head`` key/value heads, each shared by
  n_head / n_kv_head query heads; k and v are 1/4 of q's size for Llama 3 8B and 70B.
- Separate q, k, v projections (their sizes differ under GQA) and no biases (``bias=false``; a
  ``bias=true`` Llama puts them on every Linear, Hugging Face's attention_bias + mlp_bias).
- Untied embedding and output layer (8B, 70B); Llama 3.2 1B and 3B tie them (``tie_embeddings``).

Shape legend: B batch, T sequence length, C d_model, H query heads, K key/value heads (H % K == 0),
D head dim (C = H * D), F the MLP width d_ff, V vocabulary.

The model interface (``memopt/models/base.py``) is the GPT's: ``blocks`` (the repeated unit for
checkpointing, ZeRO-3, the chunk engine, FSDP2), ``block_runner`` and ``loss_head`` slots, the
``attention_core`` slot (q (B,H,T,D), k and v (B,K,T,D) -> (B,H,T,D): the core owns the grouping, so
SDPA runs grouped without copying k and v) and ``mlp``; weights created on any device (``meta``) and
filled from (seed, name) by ``init_weights``.
"""
from __future__ import annotations

import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from memopt.errors import ConfigError
from memopt.models.base import Model, ModelConfig

ROPE_SCALINGS = ("llama3",)


# ---- counts from the config alone (the planner, MFU and the presets' tests read these) -------------

def count_params(cfg: ModelConfig) -> int:
    """Parameters, from the config alone (a tied head counted once).

    Per block: q and o (C x H D each), k and v (C x K D each), gate, up and down (C x F each), two
    RMSNorm weights (C each); biases when ``bias``. Plus the embedding V C, the final norm C and the
    untied head V C. Llama 3.1 8B: 8,030,261,248."""
    C, L, V, D = cfg.d_model, cfg.n_layer, cfg.vocab_size, cfg.head_dim
    H, K, b = cfg.n_head, cfg.kv_heads, 1 if cfg.bias else 0
    attn = C * H * D + 2 * C * K * D + H * D * C + b * (H * D + 2 * K * D + C)
    block = attn + mlp_params(cfg) + 2 * C
    return L * block + V * C + C + (0 if cfg.tie_embeddings else V * C)


def mlp_params(cfg: ModelConfig, d_ff: int | None = None) -> int:
    """Parameters of one SwiGLU MLP (gate, up, down and their biases) of hidden width d_ff (None: cfg.ff)."""
    C, F_, b = cfg.d_model, d_ff if d_ff is not None else cfg.ff, 1 if cfg.bias else 0
    return 3 * C * F_ + b * (2 * F_ + C)


def flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token: 6 N over the parameters that multiply (the embedding table is a lookup
    and not counted when untied; a tied one is the output layer's matrix) plus 12 L C T for the
    scores and the weighted sum of attention (GQA shares k and v, not the work: every query head
    computes its T x T scores). torchtitan's count for Llama 3. Recomputation is not counted."""
    n = count_params(cfg) - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model)
    return 6.0 * n + 12.0 * cfg.n_layer * cfg.d_model * cfg.seq_len


def activation_bytes(cfg: ModelConfig, batch: int, bytes_per_value: int = 4) -> int:
    """Bytes one block keeps for its backward (no checkpointing, SDPA core, no dropout), at micro-batch
    ``batch`` and ``cfg.seq_len`` tokens, computing in the parameters' dtype of ``bytes_per_value``
    bytes (fp32: 4; bf16: 2).

    Per token: each RMSNorm keeps its input in fp32 (the input itself at fp32, an fp32 copy at bf16:
    4 C bytes), its normalised input and its output (the next Linear's input): 2 C values, twice;
    attention keeps q and k after the rotation (C, K D), v (K D) and the core's output (the o
    projection's input, C); the MLP keeps gate, silu(gate), up and their product (4 F). The
    per-token statistics are fp32: each norm's 1/rms (1 value) and SDPA's log-sum-exp (H values).
    Llama 3 8B (K D = C / 4, F = 3.5 C) at fp32: 6 + 2.5 + 14 = 22.5 C values, against 16 C for a
    GPT-2 block of the same width (gpt.py; Korthikanti et al.'s 34 bytes at 16 bits with dropout masks)."""
    C, K, D, H, F_ = cfg.d_model, cfg.kv_heads, cfg.head_dim, cfg.n_head, cfg.ff
    values = 2 * 2 * C + 2 * C + 2 * K * D + 4 * F_
    fp32 = 2 * C + 2 + H  # the norms' fp32 inputs, their 1/rms, the log-sum-exp
    return batch * cfg.seq_len * (bytes_per_value * values + 4 * fp32)


# ---- rotary positions --------------------------------------------------------------------------------

def rope_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """The D/2 rotation frequencies (radians per position), float64, with Llama 3's scaling if set.

    llama3 scaling (Llama 3.1's long context): a frequency whose wavelength 2 pi / f is longer than
    original_max_pos / low_freq_factor is divided by ``rope_factor``; one shorter than original_max_pos
    / high_freq_factor is kept; in between the two are mixed linearly in original_max_pos / wavelength."""
    D = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))  # (D/2,)
    if cfg.rope_scaling is None:
        return inv
    L0, factor, lo, hi = cfg.rope_original_max_pos, cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = ((L0 / wavelen - lo) / (hi - lo)).clamp(0.0, 1.0)  # 0: scaled, 1: kept
    return (1 - smooth) * inv / factor + smooth * inv


def rope_cache(cfg: ModelConfig, T: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (T, D) in float32: each of the D/2 angles twice, for the halves of a head."""
    inv = rope_frequencies(cfg).to(torch.float32).to(device)
    ang = torch.outer(torch.arange(T, device=device, dtype=torch.float32), inv)  # (T, D/2)
    ang = torch.cat((ang, ang), dim=-1)  # (T, D)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (x[..., i], x[..., i + D/2]) of x (B, heads, T, D) by position-dependent angles,
    in float32 (the angles of late positions need its precision), back in x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)  # (B, h, T, D/2) each
    rotated = torch.cat((-x2, x1), dim=-1)  # "rotate half"
    return (xf * cos + rotated * sin).to(x.dtype)


# ---- modules --------------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight (Zhang & Sennrich 2019), the statistics in float32.

    The normalised value is cast back to x's dtype before the weight multiplies it, as Llama's
    reference code does, so bf16 runs round where theirs do."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)  # (B, T, C)
        return self.weight * h.to(x.dtype)


class GQACore(nn.Module):
    """softmax(q k^T / sqrt(D) + causal mask) v with K key/value heads shared by H query heads; no parameters.

    ``sdpa`` runs grouped (``enable_gqa``: k and v are not copied H / K times); ``naive`` repeats
    them and writes the (T, T) scores: the reference. The ``attention_core`` slot holds it, so
    selective checkpointing can recompute it and FlashAttention replace it."""

    def __init__(self, impl: str, dropout: float):
        super().__init__()
        if impl not in ("sdpa", "naive"):
            raise ValueError(f"model.attention={impl!r} is not one of: sdpa, naive")
        self.impl, self.dropout = impl, dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: (B, H, T, D); k, v: (B, K, T, D) -> (B, H, T, D)
        p = self.dropout if self.training else 0.0
        if self.impl == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=k.size(1) != q.size(1))
        k, v = repeat_kv(k, q.size(1)), repeat_kv(v, q.size(1))  # (B, H, T, D)
        T = q.size(-2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))  # (B, H, T, T)
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        att = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
        return F.dropout(att, p=p, training=self.training) @ v  # (B, H, T, D)


def repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, K, T, D) -> (B, heads, T, D): key/value head j serves query heads j*g .. j*g+g-1 (g = heads/K)."""
    return x if x.size(1) == heads else x.repeat_interleave(heads // x.size(1), dim=1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        C, D = cfg.d_model, cfg.head_dim
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, D
        self.q_proj = nn.Linear(C, cfg.n_head * D, bias=cfg.bias)
        self.k_proj = nn.Linear(C, cfg.kv_heads * D, bias=cfg.bias)
        self.v_proj = nn.Linear(C, cfg.kv_heads * D, bias=cfg.bias)
        self.o_proj = nn.Linear(cfg.n_head * D, C, bias=cfg.bias)
        self.core = GQACore(cfg.attention, cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        B, T, _ = x.shape
        D = self.head_dim
        q = self.q_proj(x).view(B, T, -1, D).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, -1, D).transpose(1, 2)  # (B, K, T, D)
        v = self.v_proj(x).view(B, T, -1, D).transpose(1, 2)  # (B, K, T, D)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        y = self.core(q, k, v)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, H D)
        return self.resid_drop(self.o_proj(y))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): the gated MLP of PaLM and Llama, (B, T, C) -> (B, T, F) -> (B, T, C)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ff, bias=cfg.bias)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ff, bias=cfg.bias)
        self.down_proj = nn.Linear(cfg.ff, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class Block(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.ln_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.ln_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope)  # (B, T, C)
        return x + self.mlp(self.mlp_norm(x))  # (B, T, C)


class Llama(Model):
    SLOTS = {"attention_core": "attn.core", "mlp": "mlp"}

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)  # (V, C)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.ln_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)  # (V, C)
        if cfg.tie_embeddings:  # Llama 3.2 1B / 3B
            self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx, targets: (B, T) int64 token ids. Returns logits (B, T, V) (None under chunked_loss) and
        the mean loss (or None)."""
        B, T = idx.shape
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length {T} exceeds model.seq_len={self.cfg.seq_len}")
        x = self.drop(self.wte(idx))  # (B, T, C)
        rope = rope_cache(self.cfg, T, idx.device)  # 2 x (T, D), no parameters: rebuilt each forward
        x = self.block_runner(self.blocks, x, rope)  # (B, T, C)
        x = self.norm(x)
        return self.loss_head(x, self.lm_head, targets)

    # ---- the model interface (memopt.models.base) ---------------------------------------------
    @classmethod
    def num_params(cls, cfg: ModelConfig) -> int:
        return count_params(cfg)

    @classmethod
    def flops_per_token(cls, cfg: ModelConfig) -> float:
        return flops_per_token(cfg)

    @classmethod
    def mlp_params(cls, cfg: ModelConfig, d_ff: int | None = None) -> int:
        return mlp_params(cfg, d_ff)

    @classmethod
    def activation_bytes(cls, cfg: ModelConfig, batch: int, bytes_per_value: int = 4) -> int:
        return activation_bytes(cfg, batch, bytes_per_value)

    @classmethod
    def validate(cls, cfg: ModelConfig) -> None:
        """Shape rules, checked before anything is allocated; each names the field, its value and what works."""
        super().validate(cfg)
        if cfg.d_ff is not None and cfg.d_ff < 1:
            raise ConfigError(f"model.d_ff={cfg.d_ff} must be >= 1 (the SwiGLU hidden width; Llama 3 8B: 14336)")
        if cfg.d_model % cfg.n_head:
            raise ConfigError(f"model.d_model={cfg.d_model} is not divisible by model.n_head={cfg.n_head}: "
                              f"the head dim is d_model / n_head; use n_head among {_divisors(cfg.d_model)[:12]}")
        if cfg.head_dim % 2:
            raise ConfigError(f"model.arch=llama rotates pairs of a head's dimensions: the head dim d_model/n_head = "
                              f"{cfg.d_model}/{cfg.n_head} = {cfg.head_dim} must be even")
        if cfg.n_kv_head is not None and (cfg.n_kv_head < 1 or cfg.n_head % cfg.n_kv_head):
            raise ConfigError(f"model.n_kv_head={cfg.n_kv_head} must divide model.n_head={cfg.n_head}: each key/value "
                              f"head serves n_head / n_kv_head query heads; use one of {_divisors(cfg.n_head)} "
                              f"(or null for multi-head attention)")
        if cfg.pos_emb != "rope":
            raise ConfigError(f"model.arch=llama has rotary positions only: model.pos_emb={cfg.pos_emb!r} must be rope")
        if cfg.attention not in ("sdpa", "naive"):
            hint = " (FlashAttention is a strategy: +strategy=flash_attn)" if cfg.attention == "flash" else ""
            raise ConfigError(f"model.attention={cfg.attention!r} is not one of: sdpa, naive{hint}")
        if cfg.ln_eps <= 0:
            raise ConfigError(f"model.ln_eps={cfg.ln_eps} must be > 0 (the RMSNorm epsilon; Llama 3: 1e-5)")
        if cfg.rope_theta <= 0:
            raise ConfigError(f"model.rope_theta={cfg.rope_theta} must be > 0 (Llama 3: 500000)")
        if cfg.rope_scaling is not None:
            if cfg.rope_scaling not in ROPE_SCALINGS:
                raise ConfigError(f"model.rope_scaling={cfg.rope_scaling!r} is not one of: null, {', '.join(ROPE_SCALINGS)}")
            if cfg.rope_factor < 1:
                raise ConfigError(f"model.rope_factor={cfg.rope_factor} must be >= 1 (low frequencies are divided by it)")
            if not 0 < cfg.rope_low_freq_factor < cfg.rope_high_freq_factor:
                raise ConfigError(f"model.rope_low_freq_factor={cfg.rope_low_freq_factor} and model.rope_high_freq_factor="
                                  f"{cfg.rope_high_freq_factor} must satisfy 0 < low < high (Llama 3.1: 1 and 4)")
            if cfg.rope_original_max_pos < 1:
                raise ConfigError(f"model.rope_original_max_pos={cfg.rope_original_max_pos} must be >= 1 (Llama 3.1: 8192)")

    def init_tensor(self, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        """Initial value from (seed, name): see ``init_tensor``."""
        return init_tensor(name, shape, seed, self.cfg)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def init_tensor(name: str, shape: tuple[int, ...], seed: int, cfg: ModelConfig) -> torch.Tensor:
    """The initial value of parameter ``name`` (a float32 CPU tensor).

    normal(0, init_std) for matrices and the embedding (Hugging Face's Llama init, initializer_range
    0.02), init_std / sqrt(2 L) for the projections that write into the residual stream (o_proj,
    down_proj, as in GPT-2 and torchtitan's depth init), ones for RMSNorm weights, zeros for biases.
    Drawn on the CPU with a generator seeded from (seed, name), so identical on every rank and
    partitioning (the GPT's rule)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias":
        return torch.zeros(shape)
    if "norm." in name:  # blocks.i.attn_norm / mlp_norm, norm
        return torch.ones(shape)
    std = cfg.init_std
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        std = cfg.init_std / math.sqrt(2 * cfg.n_layer)
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return torch.randn(shape, generator=g) * std
