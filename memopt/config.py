"""Typed configuration schema (registered in Hydra's ConfigStore) and cross-field validation.

Every group in ``conf/`` is checked against these dataclasses, so a typo in a field or a value of
the wrong type fails at composition with Hydra's message. ``validate`` adds the rules that involve
several fields (conflicting strategies, impossible shapes) and names the fields and the fix.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from memopt.data import DataConfig
from memopt.errors import ConfigError
from memopt.memory.hardware import HardwareConfig
from memopt.models.gpt import GPTConfig
from memopt.strategies.checkpointing import ActOffloadConfig, CkptConfig
from memopt.strategies.chunk.config import ChunkConfig, HybridAdamConfig, StaticPartitionConfig
from memopt.strategies.flash_attention import FlashAttnConfig
from memopt.strategies.precision import Bf16Config, Fp16Config
from memopt.strategies.zero import CpuOffloadConfig, DdpConfig, Zero1Config, Zero2Config, Zero3Config


@dataclass
class OptimConfig:
    """AdamW with linear warm-up and cosine decay (the ``optim`` group)."""

    name: str = "adamw"  # adamw (the only optimizer; every engine implements the same math)
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1  # applied to matrices and embeddings, not to biases and LayerNorm
    warmup_steps: int = 20
    schedule: str = "cosine"  # cosine | constant
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at trainer.max_steps
    grad_clip: float = 1.0  # global gradient-norm clip; 0 disables


@dataclass
class TrainerConfig:
    """The loop (the ``trainer`` group)."""

    mode: str = "train"  # train (the memory planner will add "plan": predict peak bytes and exit)
    max_steps: int = 300
    micro_batch_size: int = 16  # sequences per rank per micro-step
    grad_accum: int = 1  # micro-steps per optimizer step
    log_every: int = 10  # steps between metrics.jsonl records (the first and last step always log)
    eval_every: int = 100  # steps between held-out evaluations; 0 disables
    eval_batches: int = 4  # held-out batches per evaluation
    device: str = "auto"  # auto | cpu | cuda
    nproc_per_node: int = 1  # local ranks this command launches (1: run in-process)
    progress_bar: bool = True
    throughput_warmup_steps: int = 3  # steps excluded from the median tokens/s
    track_memory: bool = True  # dispatch-mode tracker on every step
    save_checkpoint: bool = True  # write model.pt (atomic) at the end of the run
    num_threads: int = 0  # torch intra-op threads on CPU; 0 keeps PyTorch's default


@dataclass
class LoggerConfig:
    """Weights & Biases (the ``logger`` group). ``name=none`` disables it."""

    name: str = "wandb"  # wandb | none
    project: str = "memopt"
    entity: str | None = None
    mode: str = "auto"  # auto (online with credentials, else offline) | online | offline | disabled
    group: str | None = None  # default: the experiment name, or the sweep directory's name
    tags: list[str] = field(default_factory=list)  # added to the strategy names and the engine


@dataclass
class EngineConfig:
    """Who implements the selected strategies (the ``engine`` group)."""

    name: str = "memopt"  # memopt | deepspeed | fsdp2 (the baselines: memopt/engines/deepspeed.py, fsdp2.py)
    deepspeed: dict[str, Any] = field(default_factory=dict)  # extra DeepSpeed config keys, deep-merged last


@dataclass
class StrategyConfig:
    """The selected strategies: ``+strategy=NAME`` sets ``strategy.NAME``; unset means not selected."""

    fp16: Fp16Config | None = None
    bf16: Bf16Config | None = None
    ckpt: CkptConfig | None = None
    act_offload: ActOffloadConfig | None = None
    flash_attn: FlashAttnConfig | None = None
    ddp: DdpConfig | None = None
    zero1: Zero1Config | None = None
    zero2: Zero2Config | None = None
    zero3: Zero3Config | None = None
    cpu_offload: CpuOffloadConfig | None = None
    chunk: ChunkConfig | None = None
    static_partition: StaticPartitionConfig | None = None
    hybrid_adam: HybridAdamConfig | None = None

    def selected(self) -> list[str]:
        return [k for k, v in self.__dict__.items() if v is not None]


@dataclass
class TrainConfig:
    model: GPTConfig = field(default_factory=GPTConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    seed: int = 0
    experiment: str | None = None  # set by experiment/ configs; becomes the W&B group


def register_configs() -> None:
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def _one_of(field_name: str, value, options) -> None:
    if value not in options:
        raise ConfigError(f"{field_name}={value!r} is not one of: {', '.join(map(str, options))}")


def validate(cfg: TrainConfig) -> None:
    """Cross-field rules, checked before anything big is allocated."""
    from memopt.strategies import checkpointing
    from memopt.strategies.precision import Precision

    m, t, o = cfg.model, cfg.trainer, cfg.optim
    for name in ("n_layer", "n_head", "d_model", "seq_len", "vocab_size"):
        if getattr(m, name) < 1:
            raise ConfigError(f"model.{name}={getattr(m, name)} must be >= 1")
    if m.d_model % m.n_head:
        raise ConfigError(f"model.d_model={m.d_model} is not divisible by model.n_head={m.n_head}")
    if m.pos_emb == "rope" and m.head_dim % 2:
        raise ConfigError(f"model.pos_emb=rope needs an even head dim; d_model/n_head = {m.head_dim}")
    _one_of("model.pos_emb", m.pos_emb, ("learned", "rope"))
    _one_of("model.attention", m.attention, ("sdpa", "naive", "flash"))
    _one_of("data.name", cfg.data.name, ("pydoc", "text_file", "synthetic"))
    if cfg.data.name == "text_file":
        import os

        if not cfg.data.path:
            raise ConfigError("data=text_file needs data.path (e.g. data.path=/path/to/corpus.txt)")
        if not os.path.isfile(os.path.expanduser(cfg.data.path)):
            raise ConfigError(f"data.path={cfg.data.path!r}: no such file; give a UTF-8 text file")
    if not 0 <= cfg.data.val_fraction < 1:
        raise ConfigError(f"data.val_fraction={cfg.data.val_fraction} must be in [0, 1)")
    _one_of("trainer.mode", t.mode, ("train",))
    _one_of("trainer.device", t.device, ("auto", "cpu", "cuda"))
    for name in ("max_steps", "micro_batch_size", "grad_accum", "log_every", "nproc_per_node"):
        if getattr(t, name) < 1:
            raise ConfigError(f"trainer.{name}={getattr(t, name)} must be >= 1")
    if t.eval_every < 0:
        raise ConfigError(f"trainer.eval_every={t.eval_every} must be >= 0 (0 disables evaluation)")
    _one_of("optim.name", o.name, ("adamw",))
    _one_of("optim.schedule", o.schedule, ("cosine", "constant"))
    if o.lr <= 0 or o.grad_clip < 0:
        raise ConfigError(f"optim.lr={o.lr} must be > 0 and optim.grad_clip={o.grad_clip} >= 0")
    _one_of("logger.name", cfg.logger.name, ("wandb", "none"))
    _one_of("logger.mode", cfg.logger.mode, ("auto", "online", "offline", "disabled"))
    _one_of("engine.name", cfg.engine.name, ("memopt", "deepspeed", "fsdp2"))

    s = cfg.strategy
    try:
        Precision.from_strategies(s.fp16, s.bf16)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    stages = [n for n in ("ddp", "zero1", "zero2", "zero3") if getattr(s, n) is not None]
    if len(stages) > 1:
        raise ConfigError(
            f"strategies {' and '.join(stages)} are mutually exclusive: select one data-parallel/ZeRO stage "
            f"(e.g. +strategy={stages[-1]})"
        )
    if s.chunk is not None:
        for n in stages + (["cpu_offload"] if s.cpu_offload is not None else []):
            raise ConfigError(
                f"strategies chunk and {n} are mutually exclusive: the chunk engine is its own partitioner "
                f"(and keeps optimizer states on the host); drop +strategy={n}, or drop chunk to use {n}"
            )
    try:
        from memopt.strategies.chunk import config as chunk_config

        chunk_config.validate(s.chunk, s.static_partition, s.hybrid_adam)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for n in stages:
        bucket = getattr(getattr(s, n), "bucket_mb", 1.0)
        if bucket <= 0:
            raise ConfigError(f"strategy.{n}.bucket_mb={bucket} must be > 0")
    if s.flash_attn is not None:
        from memopt.strategies import flash_attention

        try:
            flash_attention.validate(m)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if s.act_offload is not None and s.ckpt is None:
        raise ConfigError(
            "strategy act_offload needs strategy ckpt: it offloads the checkpointed activations "
            "(use +strategy=[ckpt,act_offload])"
        )
    if s.ckpt is not None:
        try:
            checkpointing.validate(s.ckpt, m.n_layer)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if s.act_offload is not None and s.ckpt.policy == "selective":
            raise ConfigError(
                "strategy act_offload needs strategy.ckpt.policy=full or every_k "
                "(selective recomputes only the attention core and keeps block inputs on the device)"
            )
    from memopt.engines import deepspeed as ds_engine, fsdp2 as fsdp2_engine

    ds_engine.validate(cfg)  # engine-specific refusals (each returns at once for another engine)
    fsdp2_engine.validate(cfg)


def to_dataclass(cfg: DictConfig) -> TrainConfig:
    """The composed DictConfig as the typed TrainConfig object."""
    return OmegaConf.to_object(cfg)
