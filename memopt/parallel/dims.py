"""Named parallel dimensions on a device mesh: which ranks each collective runs over.

The world is ``pp x dp_replicate x dp_shard x tp`` ranks. The expert dimension ``ep`` is carved out of
``dp_shard`` (``dp_shard = dp_shard_mod_ep x ep``), as DeepSpeed-MoE and torchtitan do: expert
groups are consecutive data-parallel ranks, and dense parameters stay data-parallel over all of
them. Mesh dimensions, outermost first: ``pp, dp_replicate, dp_shard_mod_ep, ep, tp`` (tp innermost,
so the chattiest dimension spans the nearest ranks; pp outermost, as in torchtitan and Megatron: a
pipeline sends one activation per micro-batch, the least traffic, so its stages may span nodes).

The groups the code names (``dims.<name>``):

    world     every rank (run records, barriers)
    dp        every data-parallel rank, replicate x shard: data sharding, dense gradients, loss mean
    dp_shard  ZeRO / FSDP / chunk partitioning
    ep        expert parallelism (the all_to_all of tokens)
    edp       ranks that hold the same experts (replicate x shard_mod_ep): expert gradients
    tp        tensor parallelism
    pp        pipeline parallelism (+strategy=pipeline): the ranks holding the stages of one replica

A dimension of size 1 has no process group and its collectives return at once, so a single process
never touches ``torch.distributed``; with every size but data-parallel equal to 1, ``dp`` and
``dp_shard`` are the whole world and behave exactly like the default group.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from memopt.errors import ConfigError

# torch 2.13 names the single-tensor collectives *_single (the *_tensor names are deprecated aliases)
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reduce_scatter_single(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """``inp`` summed over the group, this rank's contiguous share of it into ``out``. On gloo the list form,
    over views of ``inp`` (no copy): gloo runs the single-tensor form 1.6-2.8x slower (two processes on this
    CPU, fp32: 43.7 against 27.6 ms at 25.6 MB, 8.6 against 3.1 at 4 MB; docs/design.md, "Decisions")."""
    if inp.device.type == "cpu" and dist.get_backend(group) == "gloo":
        return dist.reduce_scatter(out, list(inp.chunk(dist.get_world_size(group))), group=group, async_op=async_op)
    return _reduce_scatter_tensor(out, inp, group=group, async_op=async_op)

MESH_DIMS = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "tp")
# named groups -> the mesh dimensions they flatten
GROUPS = {
    "dp": ("dp_replicate", "dp_shard_mod_ep", "ep"),
    "dp_shard": ("dp_shard_mod_ep", "ep"),
    "ep": ("ep",),
    "edp": ("dp_replicate", "dp_shard_mod_ep"),
    "tp": ("tp",),
    "pp": ("pp",),
}


@dataclass
class ParallelConfig:
    """The ``parallel`` group: how the world is split. Sizes multiply to the world size."""

    pp: int = 1  # pipeline-parallel degree: stages of the model (+strategy=pipeline); the outermost dimension
    dp_replicate: int = 1  # data-parallel replicas (HSDP's outer dimension)
    dp_shard: int = -1  # data-parallel ranks that partition states; -1: world / (dp_replicate * tp)
    ep: int = 1  # expert-parallel degree (divides dp_shard)
    tp: int = 1  # tensor-parallel degree


def resolve_sizes(cfg: ParallelConfig, world: int) -> dict[str, int]:
    """Sizes of the mesh dimensions for ``world`` ranks; ConfigError naming the numbers otherwise."""
    for name in ("pp", "dp_replicate", "ep", "tp"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"parallel.{name}={getattr(cfg, name)} must be >= 1")
    if cfg.dp_shard == 0 or cfg.dp_shard < -1:
        raise ConfigError(f"parallel.dp_shard={cfg.dp_shard} must be >= 1, or -1 to take what the world leaves")
    pp = cfg.pp
    rest = pp * cfg.dp_replicate * cfg.tp
    shard = cfg.dp_shard
    if shard == -1:
        if world % rest:
            raise ConfigError(
                f"parallel.pp={pp} x parallel.dp_replicate={cfg.dp_replicate} x parallel.tp={cfg.tp} = {rest} does not "
                f"divide the world size {world}; choose sizes whose product is {world}")
        shard = world // rest
    if pp * cfg.dp_replicate * shard * cfg.tp != world:
        raise ConfigError(
            f"parallel sizes pp={pp} x dp_replicate={cfg.dp_replicate} x dp_shard={shard} x tp={cfg.tp} = "
            f"{pp * cfg.dp_replicate * shard * cfg.tp} ranks, but the world has {world} "
            f"(trainer.nproc_per_node x nodes); make the product {world}, e.g. parallel.dp_shard=-1")
    if shard % cfg.ep:
        raise ConfigError(
            f"parallel.ep={cfg.ep} does not divide the data-parallel shard size dp_shard={shard} (world {world}): "
            f"experts are split over data-parallel ranks; use an ep among "
            f"{[d for d in range(1, shard + 1) if shard % d == 0]}")
    return {"pp": pp, "dp_replicate": cfg.dp_replicate, "dp_shard_mod_ep": shard // cfg.ep, "ep": cfg.ep, "tp": cfg.tp}


def expected_world(cfg) -> int:
    """The world size a run will have: the launcher's (torchrun, multi-node) or trainer.nproc_per_node x
    trainer.nnodes (nodes other than this one: planned, or started by an external launcher)."""
    return int(os.environ.get("WORLD_SIZE", "0")) or cfg.trainer.nproc_per_node * cfg.trainer.nnodes


class Dim:
    """One named dimension: this rank's coordinate, the size, and the process group (None at size 1)."""

    def __init__(self, name: str, size: int = 1, rank: int = 0, group=None, mesh=None):
        self.name, self.size, self.rank, self.group, self.mesh = name, size, rank, group, mesh

    def __repr__(self) -> str:
        return f"Dim({self.name}, rank {self.rank} of {self.size})"

    @property
    def enabled(self) -> bool:
        return self.size > 1

    # the collectives; each is a no-op (or a copy) on a dimension of size 1
    def all_reduce_(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.enabled:
            dist.all_reduce(t, op=op, group=self.group)
        return t

    def all_reduce(self, t: torch.Tensor, async_op: bool = False):
        return dist.all_reduce(t, group=self.group, async_op=async_op) if self.enabled else None

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        return reduce_scatter_single(out, inp, group=self.group, async_op=async_op)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        return all_gather_single(out, inp, group=self.group, async_op=async_op)

    def gather_objects(self, obj) -> list:
        """Every rank's ``obj`` in rank order (on every rank of the dimension)."""
        if not self.enabled:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj):
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier(group=self.group)


@dataclass
class ParallelDims:
    """The mesh and its named dimensions for this process (see the module docstring)."""

    sizes: dict[str, int] = field(default_factory=lambda: {d: 1 for d in MESH_DIMS})
    mesh: object = None  # DeviceMesh over MESH_DIMS of size > 1 (None for one process)
    local_rank: int = 0
    dims: dict[str, Dim] = field(default_factory=dict)

    def __post_init__(self):
        for name in ("world", *GROUPS):
            self.dims.setdefault(name, Dim(name))

    def __getattr__(self, name: str) -> Dim:
        dims = self.__dict__.get("dims", {})
        if name in dims:
            return dims[name]
        raise AttributeError(name)

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def world_size(self) -> int:
        return self.world.size

    @property
    def is_main(self) -> bool:
        return self.world.rank == 0

    def describe(self) -> str:
        return ", ".join(f"{n}={self.dims[n].size}" for n in ("pp", "dp", "dp_shard", "ep", "tp")) + f" (world {self.world.size})"

    def summary(self) -> dict[str, int]:
        """What the run records keep: the size of every named dimension (pp only where it is used, so
        the records and resumable checkpoints written before the dimension existed still compare equal)."""
        return {n: d.size for n, d in self.dims.items() if n != "pp" or d.size > 1}


def build_dims(cfg: ParallelConfig, device_type: str) -> ParallelDims:
    """This rank's dimensions: sizes from ``cfg`` and the launcher's world, groups from a DeviceMesh."""
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    sizes = resolve_sizes(cfg, world)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world == 1:
        return ParallelDims(sizes, None, local_rank)
    from torch.distributed.device_mesh import init_device_mesh

    names = tuple(d for d in MESH_DIMS if sizes[d] > 1)
    mesh = init_device_mesh(device_type, tuple(sizes[d] for d in names), mesh_dim_names=names)
    dims = {"world": Dim("world", world, dist.get_rank(), dist.group.WORLD, mesh)}
    for name, parts in GROUPS.items():
        present = tuple(p for p in parts if p in names)
        if not present:
            dims[name] = Dim(name)
            continue
        sub = mesh[present[0]] if len(present) == 1 else mesh[present]._flatten(name)
        if len(present) == len(names):  # the whole world: the default group (same collectives, no new group)
            dims[name] = Dim(name, world, dist.get_rank(), dist.group.WORLD, sub)
        else:
            dims[name] = Dim(name, sub.size(), sub.get_local_rank(), sub.get_group(), sub)
    return ParallelDims(sizes, mesh, local_rank, dims)
