"""Ranks: launching local workers, the process group, and the few collectives the loop needs.

``trainer.nproc_per_node=N`` makes ``python -m memopt.train`` start N local workers through
PyTorch's elastic launch API (the machinery behind ``torchrun``): a worker that crashes brings
the others down and the error names the rank and its cause. The same program also runs unchanged
under an external ``torchrun`` (multi-node): then ``WORLD_SIZE`` is already set and no launch happens.
Backends: NCCL on CUDA, gloo on CPU.
"""
from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce_(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.enabled:
            dist.all_reduce(t, op=op)
        return t

    def gather_objects(self, obj) -> list:
        """Every rank's ``obj``, in rank order (on every rank)."""
        if not self.enabled:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj):
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()


# torch 2.13 names the single-tensor collectives *_single (the *_tensor names are deprecated aliases)
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def under_launcher() -> bool:
    """True inside a worker started by torchrun / elastic launch (or any WORLD_SIZE>1 launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def setup(device: torch.device) -> DistContext:
    """Join the process group described by the launcher's environment (no-op for one process)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistContext()
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=timedelta(minutes=10))
    return DistContext(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def launch(nproc: int, entrypoint, *args) -> dict[int, object]:
    """Run ``entrypoint(*args)`` in ``nproc`` local worker processes; returns {rank: return value}.

    Raises ``RankFailure`` naming the first failed rank and its error when any worker fails.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"memopt-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
        start_method="spawn",
    )
    try:
        return elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        msg = failure.message
        if isinstance(msg, dict):
            msg = msg.get("message", str(msg))
        raise RankFailure(rank, str(msg).strip().splitlines()[-1] if msg else f"exit code {failure.exitcode}") from None


class RankFailure(RuntimeError):
    def __init__(self, rank: int, cause: str):
        super().__init__(f"rank {rank} failed: {cause}")
        self.rank, self.cause = rank, cause
