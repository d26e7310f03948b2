"""The model interface: everything strategies, engines and the trainer may rely on, for any model.

torchtitan's model spec is the anchor: a model says how many parameters and FLOPs it has, how each
parameter is initialised, which modules repeat, and which parts strategies may replace. Nothing
outside ``memopt/models/`` names a model's attributes.

    blocks                   ``nn.ModuleList`` of the repeated units, in forward order (checkpoint
                             segments, ZeRO-3 groups, FSDP2 units, chunk order)
    block_runner             slot: ``block_runner(blocks, x, *extra) -> x`` runs the stack; activation
                             checkpointing replaces it. ``extra`` is model-specific (GPT: rotary tables)
    loss_head                slot: ``loss_head(x, head, targets) -> (logits | None, loss | None)`` turns the
                             last hidden states into the mean cross-entropy through the output layer
                             ``head``; ``chunked_loss`` replaces it (and returns no logits)
    slot(i, name)            replaceable parts of block i, named in ``SLOTS`` ("attention_core": q,k,v -> y
    set_slot(i, name, m)     without parameters; "mlp": x -> x), for FlashAttention, selective
                             checkpointing and MoE
    init_tensor(name, shape, seed)   a parameter's initial value from (seed, name) alone, so every
                             partitioning starts from the single-process weights
    num_params(cfg), flops_per_token(cfg)   from the config alone (classmethods); mlp_params(cfg, d_ff)
                             the parameters of one block's dense ``mlp`` slot (MoE counts its experts);
                             activation_bytes(cfg, batch) what one block keeps for its backward (or None)
    aux_loss()               loss terms the model's parts added in the last training forward (MoE load
                             balancing, router z-loss); engines add them to the loss they differentiate
    step_metrics()           statistics the parts kept since the last call (MoE routing), logged per step
    tensor_parallel          None, or the TPLayout of +strategy=tp (which parameters are split over dims.tp)
    full_state(state)        the single-process tensors from this rank's state dict (gathered over tp)
    local_state(state)       its inverse: this rank's rows of single-process tensors (resume)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from memopt.errors import ConfigError


@dataclass
class ModelConfig:
    """Architecture hyper-parameters (the ``model`` config group); ``arch`` picks the implementation."""

    name: str = "gpt_tiny"
    arch: str = "gpt"  # a key of memopt.models.MODELS
    n_layer: int = 2  # transformer blocks
    n_head: int = 4  # attention heads
    d_model: int = 128  # residual width C
    d_ff: int | None = None  # MLP hidden width; None means 4 * d_model
    seq_len: int = 128  # maximum (and training) context length T
    vocab_size: int = 256  # V; 256 covers the byte-level tokenizer
    dropout: float = 0.0  # dropout on attention probs, residual branches and embeddings
    pos_emb: str = "learned"  # learned | rope
    attention: str = "sdpa"  # sdpa | naive (FlashAttention is a strategy: +strategy=flash_attn)
    bias: bool = True  # biases in Linear and LayerNorm layers (GPT-2 has them)
    tie_embeddings: bool = True  # lm_head shares the token embedding matrix
    init_std: float = 0.02  # GPT-2 init; residual projections get init_std / sqrt(2 * n_layer)
    ln_eps: float = 1e-5  # LayerNorm (gpt) / RMSNorm (llama) epsilon
    n_kv_head: int | None = None  # key/value heads of grouped-query attention (llama); None: n_head (multi-head)
    rope_theta: float = 10000.0  # base of the rotary frequencies (pos_emb=rope); Llama 3: 500000
    rope_scaling: str | None = None  # None | llama3: Llama 3.1's long-context scaling of the rotary frequencies (llama)
    rope_factor: float = 8.0  # llama3 scaling: low frequencies divided by this
    rope_low_freq_factor: float = 1.0  # llama3 scaling: wavelengths above original_max_pos / this are scaled
    rope_high_freq_factor: float = 4.0  # llama3 scaling: wavelengths below original_max_pos / this are kept
    rope_original_max_pos: int = 8192  # llama3 scaling: the context length the frequencies were trained at
    init_from: str | None = None  # a Hugging Face checkpoint directory (GPT-2, Llama): its config.json gives the
    # shapes, its safetensors the initial weights (memopt/hf_checkpoint.py); None: the seeded init
    freeze: list[str] = field(default_factory=list)  # fnmatch globs over parameter names (e.g. [wte.*,blocks.0.*]):
    # those parameters keep their initial values and hold no gradient and no optimizer state (memopt/freeze.py)

    @property
    def ff(self) -> int:
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head if self.n_kv_head is not None else self.n_head

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


def run_sequential(blocks, x: torch.Tensor, *extra) -> torch.Tensor:
    """The default ``block_runner``: each block in turn."""
    for block in blocks:
        x = block(x, *extra)
    return x


def dense_lm_loss(x: torch.Tensor, head: nn.Module, targets: torch.Tensor | None):
    """The default ``loss_head``: logits = head(x) (B, T, V), then the mean cross-entropy in fp32.

    The full logits and their fp32 log-softmax (kept by autograd) are the largest activation of a
    step at large vocabularies; ``+strategy=chunked_loss`` computes the same loss without them."""
    logits = head(x)  # (B, T, V)
    if targets is None:
        return logits, None
    return logits, F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


class Model(nn.Module):
    """Base class of memopt's models (see the module docstring for the contract)."""

    SLOTS: ClassVar[dict[str, str]] = {}  # slot name -> attribute path inside a block

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.loss_head = dense_lm_loss  # a callable, not a module: it holds no parameters
        self.block_runner = run_sequential  # subclasses register their modules (``blocks`` included) in forward order
        self.tensor_parallel = None  # +strategy=tp: its TPLayout (which parameters are split over dims.tp, and how)

    # ---- from the config alone ---------------------------------------------------------------
    @classmethod
    def num_params(cls, cfg: ModelConfig) -> int:
        raise NotImplementedError

    @classmethod
    def flops_per_token(cls, cfg: ModelConfig) -> float:
        """Training FLOPs per token (forward + backward), recomputation not counted."""
        raise NotImplementedError

    @classmethod
    def mlp_params(cls, cfg: ModelConfig, d_ff: int | None = None) -> int:
        """Parameters of one block's dense MLP with hidden width ``d_ff`` (None: the model's)."""
        raise NotImplementedError

    @classmethod
    def activation_bytes(cls, cfg: ModelConfig, batch: int, bytes_per_value: int = 4) -> int | None:
        """Bytes one block keeps for its backward at micro-batch ``batch`` and ``cfg.seq_len`` (no
        checkpointing); None when the model does not say (the preflight bound then uses Korthikanti
        et al.'s GPT terms alone)."""
        return None

    @classmethod
    def validate(cls, cfg: ModelConfig) -> None:
        """Shape rules; raise ConfigError naming the fields. These hold for every model; a model adds its own
        after calling this."""
        for name in ("n_layer", "n_head", "d_model", "seq_len", "vocab_size"):
            if getattr(cfg, name) < 1:
                raise ConfigError(f"model.{name}={getattr(cfg, name)} must be >= 1")
        if not 0 <= cfg.dropout < 1:
            raise ConfigError(f"model.dropout={cfg.dropout} must be in [0, 1) (the probability an activation is zeroed; "
                              "0 turns dropout off, GPT-2 trained with 0.1)")

    # ---- initialisation ----------------------------------------------------------------------
    def init_tensor(self, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        """The initial value of parameter ``name``: a float32 CPU tensor that depends on (seed, name) only."""
        raise NotImplementedError

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        for name, p in self.named_parameters():
            p.copy_(self.init_tensor(name, tuple(p.shape), seed))

    # ---- what the model's parts add to the objective and to the run records ------------------
    # A part (module) may define ``take_aux_loss() -> Tensor | None`` (its weighted loss term of the
    # last training forward, handed out once) and carry ``stats``, an object with ``report() -> dict``
    # shared by the parts of one kind (nested metrics, reset on report). Models without such parts
    # return None / {} and their runs are unchanged.
    def aux_loss(self) -> torch.Tensor | None:
        """The sum of the parts' loss terms of the last training forward; None when there are none.
        Call once per training forward: engines differentiate ``loss + aux_loss()`` and record ``loss``."""
        terms = [t for m in self.modules() if hasattr(m, "take_aux_loss") and (t := m.take_aux_loss()) is not None]
        return sum(terms[1:], terms[0]) if terms else None

    def step_metrics(self) -> dict:
        """The parts' statistics since the last call, merged (MoE: ``{"moe": {...}}``); {} without any.
        Parts may average over data-parallel ranks: call on every rank."""
        out, seen = {}, set()
        for m in self.modules():
            stats = getattr(m, "stats", None)
            if stats is not None and hasattr(stats, "report") and id(stats) not in seen:
                seen.add(id(stats))
                out.update(stats.report())
        return out

    def param_dims(self) -> dict[str, str]:
        """Parameter name -> the data-parallel dimension (a ``ParallelDims`` name) that averages its
        gradients and partitions its states, for the parameters of modules that set ``dp_dim``
        (expert-parallel MoE experts: ``edp``, the ranks holding the same experts); the others are
        absent and use the engine's own dimension (``dp_shard``)."""
        out: dict[str, str] = {}
        for prefix, mod in self.named_modules():
            dim = getattr(mod, "dp_dim", None)
            if dim:
                out.update({n: dim for n, _ in mod.named_parameters(prefix=prefix)})
        return out

    def full_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The single-process tensors from this rank's ``state`` dict: itself, or under tensor parallelism
        the split parameters gathered over tp (a collective: call on every rank)."""
        return state if self.tensor_parallel is None else self.tensor_parallel.full_state(state)

    def local_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's tensors from single-process ones (``full_state``'s inverse: under tensor
        parallelism a split parameter's rows; no communication)."""
        return state if self.tensor_parallel is None else self.tensor_parallel.local_state(state)

    # ---- slots -------------------------------------------------------------------------------
    def slot(self, i: int, name: str) -> nn.Module:
        return self.blocks[i].get_submodule(self._slot_path(name))

    def set_slot(self, i: int, name: str, module: nn.Module) -> None:
        parent, _, leaf = self._slot_path(name).rpartition(".")
        setattr(self.blocks[i].get_submodule(parent) if parent else self.blocks[i], leaf, module)

    def _slot_path(self, name: str) -> str:
        if name not in self.SLOTS:
            raise KeyError(f"{type(self).__name__} has no slot {name!r}; slots: {', '.join(self.SLOTS)}")
        return self.SLOTS[name]

    def block_params(self) -> list[list[str]]:
        """Parameter names of each block (first name of tied parameters), then the rest as one last list."""
        owner: dict[int, int] = {}
        for i, b in enumerate(self.blocks):
            for p in b.parameters():
                owner.setdefault(id(p), i)
        out: list[list[str]] = [[] for _ in range(len(self.blocks) + 1)]
        for name, p in self.named_parameters():
            out[owner.get(id(p), len(self.blocks))].append(name)
        return out
