"""Units: chunk-size search, chunk moves and accounting, Belady eviction order, frozen parameters."""
from __future__ import annotations

import itertools

import pytest
import torch

from memopt.engines.chunk.chunk import DEVICE, HOST, Chunk, TensorInfo, TensorState
from memopt.engines.chunk.manager import ALIGN, ChunkManager, pack_sizes, search_chunk_size
from memopt.engines.chunk.tracer import MemTracer
from memopt.memory.tracker import NullTracker


def test_search_minimises_padding_over_the_candidates():
    groups = [[3000, 5000, 2000, 7000, 1000, 4000], [1500]]
    best = search_chunk_size(groups)
    total = sum(itertools.chain(*groups))

    def waste(c):
        return sum(pack_sizes(g, c) for g in groups) * c - total

    lo = 7 * ALIGN  # 7000 rounded up to the alignment
    assert best % ALIGN == 0 and lo <= best <= 4 * lo
    assert waste(best) == min(waste(c) for c in range(lo, 4 * lo + 1, ALIGN))
    assert pack_sizes([5, 5, 5], 10) == 2 and pack_sizes([10, 1], 10) == 2


def test_chunk_moves_whole_and_the_tracker_sees_it():
    from memopt.memory.tracker import MemoryTracker

    tr = MemoryTracker("cpu")
    p = torch.nn.Parameter(torch.empty(0))
    with tr:
        c = Chunk(0, "param", 8, torch.float32, torch.device("cpu"), tr, with_grad=True)
        c.add(TensorInfo("w", p, (2, 3)))
        c.allocate(HOST)
        c.host[:6].copy_(torch.arange(6.0))
        assert tr.live["host"]["chunks"] == 32 and tr.live["cpu"]["chunks"] == 0
        c.move(DEVICE)
        assert tr.live["host"]["chunks"] == 0 and tr.live["cpu"]["chunks"] == 32
        assert torch.equal(p.detach(), torch.arange(6.0).view(2, 3))  # the parameter is a view of the chunk
        saved = p.detach().t()  # what autograd may keep (a view of the device storage)
        c.alloc_grad().fill_(1)
        assert tr.live["cpu"]["chunks"] == 64
        c.move(HOST)
        assert tr.live["cpu"]["chunks"] == 0 and tr.live["host"]["chunks"] == 64
        c.host[0] = 7.0
        c.move(DEVICE)  # the same storage is refilled: old views see the data again
        assert saved[0, 0].item() == 7.0 and c.grad.sum().item() == 8
        c.free_grad()
        assert tr.live["cpu"]["chunks"] == 32


def _manager(n_chunks=4, budget=2 * 32, warm=True):
    tracer = MemTracer(torch.device("cpu"), NullTracker())
    mgr = ChunkManager(torch.device("cpu"), NullTracker(), torch.float32, 8, device_budget=budget, warmup_budget=budget,
                       static=False, tracer=tracer)
    params = [torch.nn.Parameter(torch.empty(0)) for _ in range(n_chunks)]
    mgr.pack([(f"p{i}", p, (8,), []) for i, p in enumerate(params)])
    for c in mgr.chunks:
        c.allocate(HOST)
    return mgr, [mgr.info(p) for p in params]


def test_belady_evicts_the_chunk_used_farthest_in_the_future():
    mgr, infos = _manager()
    order = [0, 1, 2, 0, 3, 1]  # the access pattern of one "step"
    mgr.phase = "fwd"
    for i in order:  # warm-up: records the trace (LRU eviction)
        mgr.access([infos[i]], ("fwd", f"m{i}"))
        mgr.release([infos[i]], TensorState.HOLD_AFTER_FWD)
    mgr.tracer.end_warmup()
    mgr.device_budget = 2 * 32  # non-model memory is 0 without a tracker: budget = 2 chunks
    evicted = []
    orig = Chunk.move

    def spy(self, where):
        if where == HOST and self.where == DEVICE:
            evicted.append(self.index)
        orig(self, where)

    Chunk.move = spy
    try:
        for i in order:
            mgr.access([infos[i]], ("fwd", f"m{i}"))
            mgr.release([infos[i]], TensorState.HOLD_AFTER_FWD)
    finally:
        Chunk.move = orig
    # warm-up (LRU) leaves {3, 1}. Then: 0 misses (next uses: 3 at +4, 1 at +1) -> evict 3; 1 hits;
    # 2 misses (1 at +3, 0 at +1) -> evict 1; 0 hits; 3 misses (0 at +2, 2 at +4) -> evict 2;
    # 1 misses (0 at +1, 3 at +5) -> evict 3. LRU would have evicted 0 at the third miss.
    assert evicted == [3, 1, 2, 3]
    assert mgr.device_bytes <= 2 * 32


def test_pinned_chunks_are_never_evicted_and_overflow_is_diagnosed():
    from memopt.engines.chunk.manager import ChunkOutOfMemoryError

    mgr, infos = _manager(budget=2 * 32)
    mgr.phase = "fwd"
    mgr.access([infos[0], infos[1]], ("fwd", "big"))  # both COMPUTE
    with pytest.raises(ChunkOutOfMemoryError, match=r"forward of other .*\(32 B\).*\(64 B\) are pinned"):
        mgr.access([infos[2]], ("fwd", "other"))
    assert {c.index for c in mgr.chunks if c.where == DEVICE} == {0, 1}


def test_frozen_parameters_live_in_chunks_without_optimizer_state():
    from memopt.engines.chunk import build_chunk_engine
    from memopt.models.gpt import GPT, init_tensor
    from memopt.parallel import ParallelDims
    from memopt.strategies.precision import Precision
    from tests.conftest import typed

    cfg = typed(["model=gpt_tiny", "model.seq_len=32", "+strategy=chunk"])
    with torch.device("meta"):
        model = GPT(cfg.model)
    frozen = {n for n, _ in model.named_parameters() if n.startswith(("wpe.", "blocks.0."))}
    for n, p in model.named_parameters():
        if n in frozen:
            p.requires_grad_(False)
    engine = build_chunk_engine(cfg, torch.device("cpu"), ParallelDims(), NullTracker(), model, Precision())
    mgr = engine.mgr
    assert all(not c.trainable for c in mgr.chunks if any(t.name in frozen for t in c.tensors))
    assert all(c.trainable for c in mgr.chunks if any(t.name not in frozen for t in c.tensors))
    assert len(engine.optimizer.groups) == len(mgr.trainable_chunks) < len(mgr.chunks)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        x = torch.randint(0, 256, (2, 32), generator=g)
        engine.forward_backward(x, x.roll(1, 1), 0, 1)
        assert not any(c.has_grad for c in mgr.chunks if not c.trainable)
        engine.step(1e-2)
    sd = engine.full_state_dict()
    for n in sd:
        init = init_tensor(n if n != "lm_head.weight" else "wte.weight", tuple(sd[n].shape), cfg.seed, cfg.model)
        if n in frozen:
            assert torch.equal(sd[n], init), n
        elif n.endswith("weight") and ".ln" not in n:
            assert not torch.equal(sd[n], init), n
    assert torch.equal(sd["lm_head.weight"], sd["wte.weight"])  # the tie survives
