"""Chunks across ranks (PatrickStar's distributed chunk manager).

Layout. Each chunk list (trainable, frozen) is padded with empty chunks to a multiple of the world
size W and cut into *groups* of W consecutive chunks; the i-th chunk of a group belongs to rank i.
A rank keeps the payload of its own chunks for the whole run (on the host or the device, moved by
the same budget and eviction as on one rank) and the fp32 optimizer chunks of its own trainable
chunks only: model states per rank are 1/W of the model, as with ZeRO-3. The chunks of other ranks
("remote") have no payload except while their unit is gathered.

Communication unit: a group (default), or a single chunk with ``mem_saving_comm``.

Expert parallelism (``parallel.ep`` > 1, MoE): each rank holds only its ep group's experts, so the
expert chunks (chunks of their own, ``manager.pack``) are not partitioned over ``dp_shard`` but over
the ranks that hold the same experts (``edp`` = dp_shard / ep), as the memopt engine partitions its
expert groups: they form lists of their own, padded to multiples of edp and cut into groups of edp.
With edp = 1 (ep = the data-parallel size) every expert chunk is this rank's own: its units gather and
reduce nothing, and a step moves only the dense chunks (moe_small: 80% of the parameters stay put).
The reduction still sums every rank's contribution: the all-to-all's backward brought each token's
gradient to the rank holding its expert.

* gather: before a module computes with a tensor whose unit is not gathered, every rank makes the
  whole unit resident on the device and fills it: ``all_gather`` of the group (each rank sends its
  own chunk), or one ``broadcast`` from the chunk's owner.
* release: in a forward, once every tensor of the unit has finished its forward (HOLD_AFTER_FWD),
  the remote payloads are freed; a frozen unit likewise once all its tensors are HOLD_AFTER_BWD.
* reduce: in the backward, once every trainable tensor of the unit has its gradient, the gradient
  companions are summed into the owner's: ``reduce_scatter`` over the group, or one ``reduce`` to
  the chunk's owner; then the remote payloads and gradients are freed.
* end of a backward (or an evaluation): a unit still gathered (a tensor that got no gradient) is
  reduced if any of its tensors got one, then released.

``mem_saving_comm`` is PatrickStar's trade: a unit of one chunk needs one chunk of buffer per
access instead of W (the group), for W broadcasts / reduces instead of one all-gather /
reduce-scatter per group.

Every rank runs the same hooks in the same order, so gather, release and reduce decisions (taken
on tensor states and gradient arrivals, never on placement) are identical on every rank and the
collectives match. Placement (host or device, evictions) is local and never changes them.

Gradient accumulation: the owner's gradient companion keeps the reduced sum of the earlier
micro-steps and receives its own local gradient on top; the other ranks' copies of that chunk start
from zero each micro-step. The reduction therefore yields ``earlier sum + sum of this micro-step``,
with no extra buffer (``ChunkAdam`` divides by W once, at the step, as the memopt engine does).

``mem_cache`` (PatrickStar's "memory allocation caching"): the payloads of the last ``mem_cache``
released units stay allocated on the device, in a FIFO queue; a unit gathered again while queued
refills those buffers instead of allocating (the communication is always done: the owner's data may
have changed). Cached buffers count as device chunk bytes and are the first thing freed when a
moment needs room. 0 turns the cache off.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass

import torch
import torch.distributed as dist

from memopt.engines.chunk.chunk import DEVICE, Chunk


@dataclass(eq=False)
class CommUnit:
    """Chunks gathered and reduced together: one group of W chunks, or one chunk (mem_saving_comm)."""

    index: int
    chunks: list[Chunk]
    trainable: bool
    rank: int = 0  # this rank's place in the unit's dimension (its chunk of a group)
    world: int = 1  # ranks of that dimension: 1 means every chunk is this rank's own, nothing to communicate
    group: object = None  # its process group
    gathered: bool = False
    reduced: bool = False  # reduced in the current micro-step
    cached: bool = False
    tensors: list = None  # every tensor of its chunks (fixed once the chunks are packed)

    def __post_init__(self):
        self.tensors = [t for c in self.chunks for t in c.tensors]

    def __repr__(self) -> str:
        return f"unit{self.index}{[c.index for c in self.chunks]}"


@dataclass
class CommStats:
    gathers: int = 0
    reduces: int = 0
    sent_bytes: int = 0  # payload bytes moved by collectives, as seen by this rank (in + out)
    cache_hits: int = 0


class ChunkComm:
    def __init__(self, dim, mem_saving_comm: bool, mem_cache: int, tracker, expert_dim=None):
        """``dim``: the parallel dimension the chunks are partitioned over (``dims.dp_shard``); ``expert_dim``:
        the one expert chunks are partitioned over with expert parallelism (``dims.edp``), else None (with the rest)."""
        self.rank, self.world, self.group = dim.rank, dim.size, dim.group
        self.dim, self.expert_dim = dim, expert_dim
        self.mem_saving, self.cache_size = mem_saving_comm, mem_cache
        self.tracker = tracker
        self.units: list[CommUnit] = []
        self.cache: collections.deque[CommUnit] = collections.deque()
        self.stats = CommStats()
        self.mgr = None

    # ---- layout -------------------------------------------------------------------------------
    def assign(self, mgr) -> None:
        """Pad each chunk list to a multiple of its dimension's size, set owners, build the units."""
        self.mgr = mgr
        kinds = (False, True) if self.expert_dim is not None else (None,)  # None: experts with the rest
        for trainable in (True, False):
            for expert in kinds:
                lst = [c for c in mgr.chunks if c.trainable == trainable and expert in (None, c.expert)]
                if lst:
                    self._assign_list(mgr, lst, trainable, bool(expert), self.expert_dim if expert else self.dim)

    def _assign_list(self, mgr, lst: list[Chunk], trainable: bool, expert: bool, dim) -> None:
        W = dim.size
        while len(lst) % W:
            pad = Chunk(len(mgr.chunks), "param", mgr.chunk_size, mgr.dtype, mgr.device, mgr.tracker,
                        trainable=trainable, with_grad=trainable)
            pad.expert = expert
            mgr.chunks.append(pad)
            lst.append(pad)
        for g in range(0, len(lst), W):
            group = lst[g: g + W]
            for i, c in enumerate(group):
                c.owner = i
                c.local = i == dim.rank
            parts = [[c] for c in group] if self.mem_saving else [group]
            for part in parts:
                u = CommUnit(len(self.units), part, trainable, rank=dim.rank, world=W, group=dim.group)
                self.units.append(u)
                for c in part:
                    c.unit = u

    def _temp(self):
        return self.tracker.category("temp")

    # ---- collectives ----------------------------------------------------------------------------
    def gather(self, u: CommUnit) -> None:
        """Fill the unit's remote chunks from their owners (its chunks are resident on the device)."""
        if u.cached:
            self.cache.remove(u)
            u.cached = False
            self.stats.cache_hits += 1
            for c in u.chunks:
                c.cached = False
        u.gathered = True
        if u.world == 1:  # this rank's own chunks (experts with edp = 1)
            return
        if len(u.chunks) == 1:
            c = u.chunks[0]
            dist.broadcast(c.data, group=u.group, group_src=c.owner)
        else:
            dist.all_gather([c.data for c in u.chunks], u.chunks[u.rank].data, group=u.group)
        self.stats.gathers += 1
        self.stats.sent_bytes += sum(c.payload_bytes for c in u.chunks)

    def reduce(self, u: CommUnit) -> None:
        """Sum the unit's gradient companions into their owners' (resident, allocated), then release."""
        u.reduced = True
        if u.world == 1:  # this rank's own chunks: the gradient is complete where it is
            self.release(u)
            return
        if len(u.chunks) == 1:
            c = u.chunks[0]
            dist.reduce(c.grad, group=u.group, group_dst=c.owner)
        else:
            own = u.chunks[u.rank]
            with self._temp():
                out = torch.empty_like(own.grad)
            dist.reduce_scatter(out, [c.grad for c in u.chunks], group=u.group)
            own.grad.copy_(out)
            del out
        self.stats.reduces += 1
        self.stats.sent_bytes += sum(c.payload_bytes for c in u.chunks)
        self.release(u)

    def release(self, u: CommUnit) -> None:
        """Free the unit's remote payloads and gradients (keep the payloads in the cache if enabled)."""
        keep = self.cache_size > 0 and u.world > 1  # a unit of this rank's own chunks has nothing to cache
        for c in u.chunks:
            if c.local:
                continue
            c.free_grad()
            if keep and c.where == DEVICE:
                c.cached = True
            else:
                c.release()
        u.gathered = False
        if keep:
            u.cached = True
            self.cache.append(u)
            while len(self.cache) > self.cache_size:
                self.drop(self.cache.popleft())

    def drop(self, u: CommUnit) -> None:
        """Free a cached unit's buffers for good."""
        u.cached = False
        for c in u.chunks:
            if not c.local and c.cached:
                c.cached = False
                c.release()

    def drop_chunk(self, c: Chunk) -> None:
        """Free one cached remote buffer (the manager needs the room); its unit stays queued."""
        c.cached = False
        c.release()
