"""The interface the training loop drives; every engine (memopt, chunk, DeepSpeed, FSDP2) implements
it, so the loop, the clock and the memory tracker are shared by construction.

An engine is a module (or package) with ``NAME``, ``LABEL`` (for messages), ``SUPPORTS`` (the strategy
names it implements; None: every strategy that names no engine of its own), ``PARALLEL`` (the mesh
dimensions it can use; the others must have size 1), ``validate(cfg)`` (its own refusals; optional)
and ``build(cfg, device, dims, tracker) -> Engine``, plus one line in ``memopt.engines.ENGINES``.
"""
from __future__ import annotations

import zlib
from collections.abc import Iterator

import torch

from memopt.errors import ConfigError
from memopt.optim.step import StepResult


class Engine:
    model: torch.nn.Module
    device: torch.device

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, micro: int, n_micro: int) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns the (detached) mean loss."""
        raise NotImplementedError

    def step(self, lr: float) -> StepResult:
        """Apply the accumulated gradients with learning rate ``lr``."""
        raise NotImplementedError

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> float:
        raise NotImplementedError

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 CPU copies of every model weight (a collective: call on every rank)."""
        raise NotImplementedError

    def iter_full_state(self):
        """The weights as ``(name, tensor)`` pairs, streamed (a collective: every rank iterates to the
        end): model.pt is written from it (``memopt.model_file``) and checkpoints keep their part.
        A tensor is valid until the next one is asked for, in whatever dtype and device the engine
        holds it (a view of a gathered buffer): a consumer copies what it keeps (``.to(..., copy=True)``),
        so ranks that keep nothing copy nothing. Tied weights may come once under one of their names.
        Default: ``full_state_dict``'s copies; engines with sharded weights yield one gathered unit at
        a time, so no rank holds every weight."""
        yield from self.full_state_dict().items()

    # ---- resumable checkpoints (memopt.checkpoint); an engine module without them sets CHECKPOINTS = False
    def checkpoint_model(self) -> dict[str, torch.Tensor]:
        """The weights by name for a checkpoint save (a collective). Default: every rank streams the
        fp32 weights (``iter_full_state``) and keeps the tensors whose name hashes to it (with their tied names): DCP
        writes each from the rank that kept it and ``merge`` reads their union, so a save holds ~1/W
        of the model per rank, not all of it. An engine with sharded parameters may return DTensors."""
        import torch.distributed as dist

        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        tied: dict[int, list[str]] = {}
        state = self.model.state_dict(keep_vars=True)
        for name, t in state.items():
            tied.setdefault(id(t), []).append(name)
        out = {}
        for name, value in self.iter_full_state():
            names = tied[id(state[name])] if name in state else [name]
            if zlib.crc32(min(names).encode()) % world == rank:  # by name: every rank agrees whatever its order
                kept = value.detach().to("cpu", torch.float32, copy=True)  # (``value`` lives until the next one)
                out.update((n, kept) for n in names)
        return out

    def checkpoint_model_to_load(self) -> dict[str, torch.Tensor]:
        """What a checkpoint load fills in place before ``load_checkpoint``: every weight this rank
        needs. Default: the full fp32 copies (``full_state_dict``)."""
        return self.full_state_dict()

    def checkpoint_model_units(self) -> Iterator[dict[str, torch.Tensor]]:
        """What a checkpoint load fills, a unit at a time (every rank loads as many units, each a DCP
        collective); each filled unit goes to ``load_model_unit`` before the next is made, so an engine
        that applies units as they come never holds every weight's copy. Default: one unit,
        ``checkpoint_model_to_load``."""
        yield self.checkpoint_model_to_load()

    def load_model_unit(self, unit: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Apply a filled unit of ``checkpoint_model_units``; returns what ``load_checkpoint`` still gets
        as its ``model`` (default: all of it, applied there)."""
        return unit

    def checkpoint_state(self) -> dict:
        """Everything besides the weights that the next step depends on (optimizer states, step
        counters, loss scaler), as live tensors that DCP loads in place where possible. Keys of
        rank-local entries name the rank (``rank_key``)."""
        raise NotImplementedError

    def load_checkpoint(self, model: dict[str, torch.Tensor], state: dict) -> None:
        """Restore from the parts ``checkpoint_model`` / ``checkpoint_state`` returned, loaded by DCP."""
        raise NotImplementedError

    def save_files(self, path: str) -> None:
        """Files of the engine's own format written beside the DCP parts (DeepSpeed's checkpoint); a
        collective. Default: none."""

    def load_files(self, path: str) -> None:
        """Read back what ``save_files`` wrote (after ``load_checkpoint``)."""

    @property
    def loss_scale(self) -> float:
        return 1.0

    @property
    def skipped_steps(self) -> int:
        return 0

    @property
    def compute_dtype_name(self) -> str:
        return "fp32"


class PrecisionEngine(Engine):
    """An engine whose mixed precision is memopt's own ``Precision`` (memopt, chunk, FSDP2 engines):
    loss scale, skipped steps, dtype name and the evaluation forward come from it. Subclasses set
    ``self.precision``, ``self.tracker``, ``self.model`` and ``self.device``."""

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.model.eval()
        try:
            with self.tracker.category("temp"), self.precision.autocast(self.device):
                loss = self.model(x, y)[1]  # the logits die here: nothing holds them through the backward
            return float(loss.float().item())
        finally:
            self.model.train()

    @property
    def loss_scale(self) -> float:
        return self.precision.loss_scale

    def scaler_state(self) -> dict:
        return self.precision.scaler.state_dict() if self.precision.scaler is not None else {}

    def load_scaler_state(self, state: dict) -> None:
        if self.precision.scaler is not None:
            self.precision.scaler.load_state_dict(state)

    @property
    def skipped_steps(self) -> int:
        return self.precision.scaler.skipped_steps if self.precision.scaler is not None else 0

    @property
    def compute_dtype_name(self) -> str:
        return self.precision.name


def rank_key() -> str:
    """The key under which a rank's own checkpoint entries live (each rank writes and reads its own)."""
    import torch.distributed as dist

    return f"rank{dist.get_rank() if dist.is_initialized() else 0}"


def gather_over_ep(state: dict[str, torch.Tensor], expert_names, dims) -> dict[str, torch.Tensor]:
    """The whole model's weights when experts are split over ``dims.ep``: each rank adds the experts
    the other ranks of its ep group hold (their names carry the global expert index). A collective
    over ep; the identity without expert parallelism."""
    if not dims.ep.enabled:
        return state
    mine = {k: state[k] for k in expert_names if k in state}
    parts = _fake_ep_parts(mine, dims.ep) if _is_fake(mine) else dims.ep.gather_objects(mine)
    for part in parts:
        state.update(part)
    return state


def _is_fake(tensors: dict) -> bool:
    return any(type(t).__name__ == "FakeTensor" for t in tensors.values())


def _fake_ep_parts(mine: dict[str, torch.Tensor], ep) -> list[dict[str, torch.Tensor]]:
    """What ``gather_objects`` allocates and returns, for the planner's fake tensors (which do not
    pickle): ``all_gather_object`` pickles this rank's experts into a byte tensor, gathers every rank's
    into one buffer of ep x that size, and unpickles every rank's part, its own included, into new
    tensors. Every ep rank holds as many experts of the same shapes under its own global indices (rank
    j: j x per + i). The pickle's own framing (a few hundred bytes per tensor) is not counted."""
    import re

    per = len({m[1] for k in mine if (m := re.search(r"experts\.(\d+)\.", k))})

    def renamed(k: str, j: int) -> str:
        return re.sub(r"experts\.(\d+)\.", lambda m: f"experts.{int(m[1]) + (j - ep.rank) * per}.", k, count=1)

    first = next(iter(mine.values()), None)
    if first is None:
        return [{} for _ in range(ep.size)]
    payload = sum(v.untyped_storage().nbytes() for v in mine.values())
    buffers = [first.new_empty(payload, dtype=torch.uint8), first.new_empty(payload * ep.size, dtype=torch.uint8)]
    parts = [{renamed(k, j): torch.empty_like(v) for k, v in mine.items()} for j in range(ep.size)]
    del buffers  # the pickled input and the gathered output live until the gather returns
    return parts


def with_aux_loss(model, loss: torch.Tensor) -> torch.Tensor:
    """The objective to differentiate: the language-model loss plus the model's auxiliary loss terms
    (``Model.aux_loss``: MoE load balancing, router z-loss), which engines keep out of the reported loss.
    Without such terms it is ``loss`` itself (no extra operation, so dense runs are unchanged)."""
    aux = model.aux_loss()
    return loss if aux is None else loss + aux.to(loss.dtype)


def model_forward(model, precision, tracker, device, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A micro-batch's loss: the model's forward under the precision's autocast, what it keeps tracked as activations.
    The model's half of every engine's ``forward_backward`` (with ``model_backward``), and the planner's pass of the
    model alone (``planner/model_work.py``), whose bound holds because it runs these same lines."""
    with tracker.retained("activations"), precision.autocast(device):
        return model(x, y)[1]  # the logits die here: nothing holds them through the backward


def model_backward(model, loss: torch.Tensor, precision, tracker, n_micro: int) -> None:
    """A micro-batch's backward: its objective (``with_aux_loss``) over the step's micro-batches, loss-scaled."""
    with tracker.category("temp"):
        ((with_aux_loss(model, loss) / n_micro) * precision.loss_scale).backward()


def refuse_unsupported(cfg, name: str, label: str, supports) -> None:
    """ConfigError naming every selected strategy that engine ``name`` does not implement, those that select an
    engine of their own first (the chunk engine's: the cause, where a preset such as hybrid_adam brought several)."""
    if supports is None:
        return
    from memopt.strategies.base import registry

    reg = registry()
    other = [n for n in cfg.strategy.selected() if n not in supports]
    other.sort(key=lambda n: getattr(reg.get(n), "engine", None) is None)  # stable: composition order otherwise
    if not other:
        return
    if len(other) == 1:
        what, drop = f"strategy {other[0]}", f"drop +strategy={other[0]}"
    else:
        listed = f"{', '.join(other[:-1])} and {other[-1]}"
        what, drop = f"strategies {listed}", f"drop {listed} from +strategy (or the preset that selected them)"
    if name == cfg.engine.name and name != "memopt":
        raise ConfigError(f"{what} {'has' if len(other) == 1 else 'have'} no {label} equivalent: engine={name} "
                          f"implements {', '.join(supports)}; {drop} or use engine=memopt")
    # an engine a strategy selected (the chunk engine) under engine=memopt: name the way out that exists
    raise ConfigError(f"{what} {'is' if len(other) == 1 else 'are'} not built for {label}, which implements "
                      f"{', '.join(supports)}; {drop} or leave out the strategy that selects {label}")
