"""Typed configuration schema (registered in Hydra's ConfigStore) and the cross-cutting validation.

Every group in ``conf/`` is checked against these dataclasses, so a typo in a field or a value of
the wrong type fails at composition with Hydra's message. The ``strategy`` node is assembled from
the strategy registry (one optional field per strategy). ``validate`` runs the rules that belong to
no single part (data, trainer, optimizer, logger fields), then asks the model, the strategies and the
engine for theirs; each names the fields and the fix.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from memopt import engines
from memopt.data import DataConfig
from memopt.errors import ConfigError
from memopt.memory.hardware import HardwareConfig, check_hardware
from memopt.models import ModelConfig, model_class
from memopt.parallel.dims import ParallelConfig
from memopt.strategies.base import schema
from memopt.strategies.base import validate as validate_strategies


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

    mode: str = "train"  # train | plan (predict every rank's peak bytes, the fit and the step time; no training but
    # +strategy=auto's trials, strategy.auto.trials > 0, which are the search's measurements)
    preflight: bool = True  # plan before launching ranks and refuse (status refused) what would not fit
    plan_exact: bool = False  # plan every block and micro-batch (else deep models are planned from two shallow ones,
    # planner/extrapolate.py, and a step's middle micro-batches from its second, simulate.sampled_micro_batches)
    nnodes: int = 1  # nodes of the world (plan mode; a multi-node run is started by an external launcher)
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
    count_comm: bool = False  # count the collectives of step 0 (kinds, calls, bytes) into summary.json comm_per_step
    profile_step: int = -1  # this step under torch.profiler on every rank, into <run dir>/profile/ (memopt/profiling.py); -1: none
    profile_trace: bool = True  # with profile_step: the Chrome trace too (else the op table and phases only)
    save_checkpoint: bool = True  # write model.pt (atomic) at the end of the run
    num_threads: int = 0  # torch intra-op threads on CPU; 0 keeps PyTorch's default
    cpu_malloc_cache: bool = True  # on a CPU device, glibc's malloc keeps freed blocks for the next step's instead of
    # faulting pages in again every step (memory/host_malloc.py; every engine alike); false: malloc's defaults
    checkpoint_every: int = 0  # steps between resumable checkpoints (<run dir>/checkpoints/step_<n>); 0: none
    keep_checkpoints: int = 2  # newest resumable checkpoints kept
    resume: str | None = None  # auto (this run directory's newest checkpoint, if any) | true (the newest, which must exist) | a checkpoint path
    overwrite: bool = False  # a run directory that already holds a run is refused unless this (or resume) is set
    watchdog_s: float = 0.0  # a rank without progress this long stops the job, named with its phase; 0: off
    divergence_steps: int = 20  # consecutive non-finite losses (or fp16 skipped steps) that stop the run: diverged; 0: never


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

    name: str = "memopt"  # memopt | deepspeed | fsdp2 (the registry: memopt/engines/__init__.py)
    deepspeed: dict[str, Any] = field(default_factory=dict)  # extra DeepSpeed config keys, deep-merged last


StrategyConfig = schema()  # one optional field per registered strategy: strategy.NAME
StrategyConfig.__module__ = __name__  # pickled by name (the search's worker processes get typed candidates)


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    seed: int = 0
    experiment: str | None = None  # set by experiment/ configs; becomes the W&B group


def register_configs() -> None:
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def _one_of(field_name: str, value, options) -> None:
    if value not in options:
        raise ConfigError(f"{field_name}={value!r} is not one of: {', '.join(map(str, options))}")


def validate(cfg: TrainConfig) -> None:
    """Every rule, checked before anything big is allocated: the fields here, then the model's, the
    strategies' (registry) and the engine's (its support of the strategies and parallel dimensions)."""
    t, o = cfg.trainer, cfg.optim
    model_class(cfg.model).validate(cfg.model)
    if cfg.model.init_from:  # the directory's architecture, shards and tensor shapes: headers only, nothing allocated
        from memopt.hf_checkpoint import check
        from memopt.strategies.base import selected

        changed = [s.name for s, _ in selected(cfg) if s.architecture]
        if changed:
            raise ConfigError(f"model.init_from with +strategy={changed[0]}: the strategy changes the architecture, so the "
                              "checkpoint's tensors have no place in it (start from the checkpoint without it)")
        check(cfg.model)
    _one_of("data.name", cfg.data.name, ("pydoc", "text_file", "synthetic"))
    if cfg.data.name == "text_file":
        if not cfg.data.path:
            raise ConfigError("data=text_file needs data.path (e.g. data.path=/path/to/corpus.txt)")
        if not os.path.isfile(os.path.expanduser(cfg.data.path)):
            raise ConfigError(f"data.path={cfg.data.path!r}: no such file; give a UTF-8 text file")
    elif cfg.data.path:  # the pydoc corpus or random bytes train, the file never read (warned, not refused: a
        # sweep over data=pydoc,text_file gives every job the text file's data.path)
        warnings.warn(f"data.path={cfg.data.path!r} is not read: it is read only with data=text_file, and this run's "
                      f"data is {cfg.data.name} (add data=text_file to train on the file)", stacklevel=2)
    if not 0 <= cfg.data.val_fraction < 1:
        raise ConfigError(f"data.val_fraction={cfg.data.val_fraction} must be in [0, 1)")
    _one_of("trainer.mode", t.mode, ("train", "plan"))
    if t.nnodes < 1:
        raise ConfigError(f"trainer.nnodes={t.nnodes} must be >= 1")
    if t.mode == "train" and t.nnodes > 1 and not os.environ.get("WORLD_SIZE"):
        raise ConfigError(f"trainer.nnodes={t.nnodes}: a multi-node run is started by an external launcher (torchrun on "
                          "each node, or hydra/launcher=submitit); here use trainer.nnodes=1, or trainer.mode=plan to plan it")
    _one_of("trainer.device", t.device, ("auto", "cpu", "cuda"))
    if t.device == "cuda" and not _cuda_available():
        raise ConfigError("trainer.device=cuda but no CUDA device is available here; use trainer.device=cpu or auto")
    cores = os.cpu_count() or 1
    if t.mode == "train" and t.device != "cuda" and not _cuda_available() and t.nproc_per_node > cores:  # plan: nothing runs
        warnings.warn(f"trainer.nproc_per_node={t.nproc_per_node} CPU ranks on {cores} cores: each rank gets a fraction "
                      f"of a core and steps slow down accordingly (use at most {cores})", stacklevel=2)
    hw = cfg.hardware
    on_cpu = t.device == "cpu" or (t.device == "auto" and not _cuda_available())
    if t.mode == "train" and on_cpu and hw.name != "auto" and hw.peak_tflops and hw.device_memory_gb and not hw.device_is_host:
        peak = ", ".join(f"{k} {v:g}" for k, v in hw.peak_tflops.items())
        warnings.warn(f"hardware={hw.name} describes an accelerator (peak TFLOP/s {peak}; {hw.device_memory_gb} GB a "
                      "device) but this run trains on the CPU: its MFU is against that peak and its device budget that "
                      "memory; leave hardware=auto to describe this machine, or plan for that one with trainer.mode=plan",
                      stacklevel=2)
    for name in ("max_steps", "micro_batch_size", "grad_accum", "log_every", "nproc_per_node"):
        if getattr(t, name) < 1:
            raise ConfigError(f"trainer.{name}={getattr(t, name)} must be >= 1")
    if not -1 <= t.profile_step < t.max_steps:
        raise ConfigError(f"trainer.profile_step={t.profile_step}: give a step of this run, 0 to {t.max_steps - 1} "
                          "(trainer.max_steps - 1; after the warm-up steps for a representative one), or -1 for none")
    for name in ("checkpoint_every", "divergence_steps"):
        if getattr(t, name) < 0:
            raise ConfigError(f"trainer.{name}={getattr(t, name)} must be >= 0 (0 disables it)")
    if t.watchdog_s < 0 or 0 < t.watchdog_s < 1:
        raise ConfigError(f"trainer.watchdog_s={t.watchdog_s} must be 0 (no watchdog) or at least 1 second (a busy process's "
                          "heartbeats run late by more than a shorter limit); choose it above the longest step and "
                          "checkpoint save")
    if t.keep_checkpoints < 1:
        raise ConfigError(f"trainer.keep_checkpoints={t.keep_checkpoints} must be >= 1")
    if t.eval_every < 0:
        raise ConfigError(f"trainer.eval_every={t.eval_every} must be >= 0 (0 disables evaluation)")
    if t.eval_every and t.eval_batches < 1:  # it had turned evaluation off without a word
        raise ConfigError(f"trainer.eval_batches={t.eval_batches} must be >= 1 with trainer.eval_every={t.eval_every}; "
                          "trainer.eval_every=0 disables evaluation")
    if t.num_threads < 0:
        raise ConfigError(f"trainer.num_threads={t.num_threads} must be >= 0 (0 keeps PyTorch's default, one share of the "
                          f"cores per rank)")
    if t.throughput_warmup_steps < 0:
        raise ConfigError(f"trainer.throughput_warmup_steps={t.throughput_warmup_steps} must be >= 0 (the steps left out "
                          f"of the median tokens/s)")
    _one_of("optim.name", o.name, ("adamw",))
    _one_of("optim.schedule", o.schedule, ("cosine", "constant"))
    if o.lr <= 0:
        raise ConfigError(f"optim.lr={o.lr} must be > 0 (a run that should not learn: model.freeze, or trainer.mode=plan)")
    if o.grad_clip < 0:
        raise ConfigError(f"optim.grad_clip={o.grad_clip} must be >= 0 (0 disables clipping)")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        raise ConfigError(f"optim.betas={list(o.betas)} must be two values in [0, 1) (e.g. [0.9,0.95])")
    for name, value, ok, want in (("eps", o.eps, o.eps > 0, "> 0"), ("weight_decay", o.weight_decay, o.weight_decay >= 0, ">= 0"),
                                  ("min_lr_ratio", o.min_lr_ratio, 0 <= o.min_lr_ratio <= 1, "in [0, 1]"),
                                  ("warmup_steps", o.warmup_steps, o.warmup_steps >= 0, ">= 0")):
        if not ok:
            raise ConfigError(f"optim.{name}={value} must be {want}")
    from memopt.data import vocab_size

    ids = vocab_size(cfg.data)  # a data.tokenizer is read here: refused before anything is built
    if cfg.model.vocab_size < ids:
        what = f"data.tokenizer={cfg.data.tokenizer!r}" if cfg.data.tokenizer else "the byte-level vocabulary of " \
            f"data={cfg.data.name}"
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than {what} ({ids} token ids); use "
                          f"model.vocab_size>={ids}")
    _one_of("logger.name", cfg.logger.name, ("wandb", "none"))
    _one_of("logger.mode", cfg.logger.mode, ("auto", "online", "offline", "disabled"))
    check_hardware(cfg.hardware)
    from memopt.planner.cpu_rates.saved import check as check_rates_file

    check_rates_file(cfg.hardware.rates_file)  # readable, in a folder that exists: before anything is measured
    validate_strategies(cfg)
    from memopt.freeze import check as check_freeze

    check_freeze(cfg)  # model.freeze's globs against the composed model's names (on meta)
    engines.validate(cfg)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


def compose_config(overrides: list[str] | None = None) -> DictConfig:
    """The DictConfig that ``python -m memopt.train <overrides>`` would run."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    if GlobalHydra.instance().is_initialized():  # inside the CLI (largest_model composes its command there)
        return compose(config_name="train", overrides=list(overrides or []))
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides or []))


def to_dataclass(cfg: DictConfig, overrides: list[str] | None = None) -> TrainConfig:
    """The composed DictConfig as the typed TrainConfig object; a key the schema does not have (added with
    ``+``, as Hydra's own error message suggests for a typo) is refused, naming the nearest field.
    ``overrides``: the command's (default: Hydra's record of them, inside the CLI), so that a model field the
    command sets is checked against ``model.init_from``'s config.json even where it equals the preset's value."""
    from memopt.hf_checkpoint import apply_shapes

    _refuse_unknown_keys(cfg, "")
    apply_shapes(cfg.model, _model_fields_set(overrides))  # model.init_from: its config.json decides the shapes
    return OmegaConf.to_object(cfg)


def _model_fields_set(overrides: list[str] | None) -> set[str]:
    """The ``model.<field>`` names the command sets (``overrides``, or Hydra's task overrides in the CLI)."""
    if overrides is None:
        from hydra.core.hydra_config import HydraConfig

        overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    keys = (o.lstrip("+~").split("=", 1)[0] for o in overrides)
    return {k[len("model."):] for k in keys if k.startswith("model.")}


# what users of DeepSpeed, Lightning and Hugging Face type for a setting memopt names otherwise, and keys memopt
# itself had and replaced (the key's last part)
FOREIGN_KEYS = {
    "precision": "precision is a strategy here: +strategy=bf16 or +strategy=fp16",
    "zero_stage": "a ZeRO stage is a strategy here: +strategy=zero1, zero2 or zero3",
    "stage": "a ZeRO stage is a strategy here: +strategy=zero1, zero2 or zero3",
    "gradient_accumulation_steps": "trainer.grad_accum", "accumulate_grad_batches": "trainer.grad_accum",
    "train_micro_batch_size_per_gpu": "trainer.micro_batch_size", "per_device_train_batch_size": "trainer.micro_batch_size",
    "batch_size": "trainer.micro_batch_size (per rank; the global batch is it x trainer.grad_accum x the data-parallel ranks)",
    "gradient_checkpointing": "checkpointing is a strategy here: +strategy=ckpt",
    "activation_checkpointing": "checkpointing is a strategy here: +strategy=ckpt",
    "trial_margin": "strategy.auto.trial_weight (since 2026-11-29 the trials are ordered by planned^(1-w) x measured^w, "
                    "not by a margin; 1: the fastest measured)",
    "devices": "trainer.nproc_per_node", "num_gpus": "trainer.nproc_per_node", "gpus": "trainer.nproc_per_node",
    "learning_rate": "optim.lr", "lr": "optim.lr", "max_steps": "trainer.max_steps",
    "gradient_clipping": "optim.grad_clip", "max_grad_norm": "optim.grad_clip",
}


def _refuse_unknown_keys(node, path: str) -> None:
    import dataclasses
    import difflib

    kind = OmegaConf.get_type(node)
    if not (isinstance(node, DictConfig) and dataclasses.is_dataclass(kind)):
        return
    fields = {f.name for f in dataclasses.fields(kind)}
    for key in node.keys():
        name = f"{path}{key}"
        if key not in fields:
            near = difflib.get_close_matches(str(key), sorted(fields), n=1)
            hint = f"did you mean {path}{near[0]}?" if near else f"the fields of {path.rstrip('.') or 'the config'} are: " + ", ".join(sorted(fields))
            if str(key) in FOREIGN_KEYS:
                hint = f"memopt's name for it: {FOREIGN_KEYS[str(key)]}"
            raise ConfigError(f"{name} is not a field of the configuration ({hint}); a '+' override adds a key "
                              f"only where the schema has a place for it")
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            _refuse_unknown_keys(child, f"{name}.")
