"""The chunk engine on 2 ranks (gloo): chunk groups, all-gather / reduce-scatter, mem_saving_comm,
mem_cache, release_after_init + res_check.

Parity: every 2-rank job (micro-batch 4 per rank) follows the single-process memopt trajectory of
the same global batch (micro-batch 8), with test_zero_parity's tolerances: fp32 1e-5 relative per
step (the only difference is the order of the gradient sum, rank 0 + rank 1), fp16 5e-3 and bf16
4e-2 (10 unit roundoffs; low-precision gradients are summed over ranks in their dtype, as in
DeepSpeed).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from memopt.api import run_jobs_on_ranks
from tests.conftest import cases, losses, selected, train

STEPS = 5
BASE = ["model=gpt_tiny", "model.seq_len=64", f"trainer.max_steps={STEPS}", "trainer.log_every=1", "trainer.eval_every=0",
        "optim.lr=3e-3", "optim.warmup_steps=2", "logger=none", "trainer.progress_bar=false", "trainer.save_checkpoint=false",
        "trainer.count_comm=true"]
TOL = {"fp32": 1e-5, "fp16": 5e-3, "bf16": 4e-2}
FP16 = ["strategy.fp16.init_scale=1024"]
MSC, NOCACHE = "strategy.chunk.mem_saving_comm=true", "strategy.chunk.mem_cache=0"
ACCUM = ["trainer.grad_accum=2", "trainer.micro_batch_size=2"]


def tight(mib: float) -> list[str]:
    """A per-rank device budget of ``mib`` MiB: below one rank's share of gpt_tiny's param+grad chunks
    plus the gathered units and the non-model peak of the case, so that chunks are evicted, with about
    two chunks (0.5 MiB) of headroom at the tightest moment (the warm-up's non-model samples vary by
    a chunk-sized temporary from run to run). Static partition: its budget 0.3 x that (1.5 MiB at 5)
    is below a rank's own fp32 param chunks (1.8 MiB: 7 of 266 KB, gradients written over them)."""
    return [f"strategy.chunk.device_budget_gb={mib / 1024}", "strategy.chunk.warmup_gpu_chunk_mem_ratio=0.3"]


# name -> (overrides on top of micro-batch 4, reference dtype)
CASES = {
    "chunk": (["+strategy=chunk"], "fp32"),
    "chunk_msc_nocache": (["+strategy=chunk", MSC, NOCACHE], "fp32"),
    "chunk_ckpt_tight": (["+strategy=[chunk,ckpt]", *tight(5.5)], "fp32"),
    "chunk_ckpt_act_offload_msc_accum_tight": (["+strategy=[chunk,ckpt,act_offload]", MSC, *ACCUM, *tight(4)], "fp32"),
    "chunk_accum_nocache": (["+strategy=chunk", NOCACHE, *ACCUM], "fp32"),
    "static_partition_tight": (["+strategy=static_partition", *tight(5)], "fp32"),
    "static_partition_msc_tight": (["+strategy=static_partition", MSC, *tight(5)], "fp32"),
    "hybrid_adam": (["+strategy=hybrid_adam", *FP16], "fp16"),
    "hybrid_adam_msc_ckpt_accum_tight": (["+strategy=[hybrid_adam,ckpt]", *FP16, MSC, *ACCUM, *tight(3)], "fp16"),
    "hybrid_adam_act_offload_nocache": (["+strategy=[hybrid_adam,ckpt,act_offload]", *FP16, NOCACHE], "fp16"),
    "hybrid_adam_bf16_msc": (["+strategy=hybrid_adam_bf16", MSC], "bf16"),
}
REFS = {"fp32": [], "fp16": ["+strategy=fp16", *FP16], "bf16": ["+strategy=bf16", "strategy.bf16.params=bf16"]}
# the default suite keeps both communication forms and cache settings, a tight budget and Hybrid Adam in fp16
SLOW_CASES = {"chunk_ckpt_tight", "chunk_ckpt_act_offload_msc_accum_tight", "chunk_accum_nocache",
              "static_partition_msc_tight", "hybrid_adam_msc_ckpt_accum_tight", "hybrid_adam_act_offload_nocache",
              "hybrid_adam_bf16_msc"}


def rel_err(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def records(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f]


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("chunk_dist")
    run = {n: v for n, v in CASES.items() if n in selected(request) | {"chunk", "chunk_msc_nocache"}}
    jobs = [(BASE + ["trainer.micro_batch_size=4", *extra], str(root / name)) for name, (extra, _) in run.items()]
    summaries = run_jobs_on_ranks(2, jobs)
    refs = {}
    for dtype, extra in REFS.items():
        if not any(d == dtype for _, d in run.values()):
            continue
        d = str(root / f"ref_{dtype}")
        assert train(BASE + ["trainer.micro_batch_size=8", *extra], d)["status"] == "ok"
        refs[dtype] = losses(d)
    one = str(root / "one_rank_chunk")
    one_summary = train(BASE + ["trainer.micro_batch_size=8", "+strategy=chunk"], one)
    out = {name: (s, str(root / name)) for name, s in zip(run, summaries)}
    return out, refs, (one_summary, one)


@pytest.mark.parametrize("name", cases(CASES, SLOW_CASES))
def test_two_ranks_follow_the_memopt_trajectory(runs, name):
    out, refs, _ = runs
    summary, run_dir = out[name]
    assert summary["status"] == "ok"
    got = losses(run_dir)
    assert len(got) == STEPS
    dtype = CASES[name][1]
    err = rel_err(got, refs[dtype])
    assert err <= TOL[dtype], f"{name}: max relative loss error {err:.2e} > {TOL[dtype]:.0e}"


@pytest.mark.parametrize("name", cases(CASES, SLOW_CASES))
def test_every_unit_is_reduced_once_per_micro_step(runs, name):
    """Communication follows the units: one gradient reduction per unit (a group of 2 chunks: a
    reduce-scatter; or one chunk with mem_saving_comm: a reduce to its owner) per micro-step, at least
    one gather per unit and micro-step (an all-gather, or a broadcast from the owner). Counted by the
    collectives spy of step 0 (``trainer.count_comm``), not by the engine's own counters."""
    out, _, _ = runs
    summary, run_dir = out[name]
    extra = CASES[name][0]
    accum = 2 if "trainer.grad_accum=2" in extra else 1
    last = records(run_dir)[-1]["chunk"]  # the layout: how many chunks, and which are padding
    assert last["chunks_local"] * 2 == last["chunks_total"]  # padded to groups of W=2, one chunk of each per rank
    units = last["chunks_total"] - last["padding_chunks"] if MSC in extra else last["chunks_total"] // 2
    ops = summary["comm_per_step"]["ops"]
    reduce, gather = ("reduce", "broadcast") if MSC in extra else ("reduce_scatter", "all_gather")
    assert ops[reduce]["count"] == accum * units, ops
    assert ops[gather]["count"] >= accum * units, ops


@pytest.mark.parametrize("name", cases({n: v for n, v in CASES.items() if n.endswith("tight")},
                                       {n for n in SLOW_CASES if n.endswith("tight")}))
def test_budget_holds_on_every_rank_and_chunks_move(runs, name):
    out, _, _ = runs
    summary, run_dir = out[name]
    mib = float(next(o for o in CASES[name][0] if o.startswith("strategy.chunk.device_budget_gb=")).split("=")[1]) * 1024
    for rank, devices in summary["peak_bytes"].items():  # the tracker's peaks over the whole run, every rank
        assert 0 < devices["cpu"]["chunks"] <= mib * 2**20, (rank, devices["cpu"]["chunks"], mib)
        assert devices["host"]["chunks"] > 0
    assert records(run_dir)[-1]["chunk"]["evictions"] > 0


def test_mem_cache_reuses_buffers(runs):
    out, _, _ = runs
    with_cache = records(out["chunk"][1])[-1]["chunk"]
    without = records(out["chunk_msc_nocache"][1])[-1]["chunk"]
    assert with_cache["mem_cache_hits"] > 0 and without["mem_cache_hits"] == 0


def test_each_rank_holds_half_of_the_model_states(runs):
    """Model states (param, grad and optimizer chunks) per rank are half of the one-rank run's:
    compare rank peaks of the tracker's ``chunks`` category on the host (all optimizer chunks and
    the evicted param chunks live there without hybrid placement) and on the device together."""
    out, _, (one_summary, _) = runs
    two = out["chunk"][0]["peak_bytes"]  # the same job as one_rank_chunk, on 2 ranks

    def chunk_bytes(peaks):
        return sum(v.get("chunks", 0) for v in peaks.values())

    one = chunk_bytes(one_summary["peak_bytes"]["0"])
    for r in ("0", "1"):
        mine = chunk_bytes(two[r])
        assert mine < 0.75 * one, f"rank {r}: {mine} chunk bytes vs {one} on one rank"


def built_state(container: dict):
    """(Runs in each rank, or in-process for one rank.) Build the engine of ``container`` and return
    its full fp32 state (a collective with 2 ranks) and whether res_check ran and passed."""
    from omegaconf import OmegaConf

    from memopt.config import TrainConfig
    from memopt.engines import build_engine
    from memopt.memory.tracker import NullTracker
    from memopt.parallel import setup, teardown

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), container))
    device = torch.device("cpu")
    dims = setup(device, cfg.parallel)
    try:
        engine = build_engine(cfg, device, dims, NullTracker())
        return engine.full_state_dict(), getattr(getattr(engine, "mgr", None), "res_check_passed", False)
    finally:
        teardown()


@pytest.mark.slow  # 20 s; the default suite keeps res_check's refusal test
def test_release_after_init_and_res_check_give_the_serial_init():
    """2-rank init (each rank fills its own chunks; or release_after_init: every chunk, then the
    remote ones are freed; res_check gathers and compares) is bit-identical to the 1-rank chunk
    engine's init and to the plain memopt engine's."""
    from memopt.api import compose_config
    from memopt.parallel import launch
    from omegaconf import OmegaConf

    def container(extra):
        return OmegaConf.to_container(compose_config([*BASE[:2], "logger=none", *extra]), resolve=True)

    res = ["+strategy=chunk", "strategy.chunk.release_after_init=true", "strategy.chunk.res_check=true"]
    two = {
        "res": launch(2, built_state, container(res))[0],
        "res_msc": launch(2, built_state, container([*res, MSC]))[0],
        "plain": launch(2, built_state, container(["+strategy=chunk"]))[0],
    }
    assert two["res"][1] and two["res_msc"][1] and not two["plain"][1]  # res_check ran (and passed) where asked
    one = {"one_rank": built_state(container(["+strategy=chunk"])), "memopt": built_state(container([]))}
    ref = one["memopt"][0]
    for name, (sd, _) in {**two, **one}.items():
        assert sd.keys() == ref.keys()
        for k in ref:
            assert torch.equal(sd[k], ref[k]), f"{name}: {k} differs from the serial init"


@pytest.mark.slow  # 7 s on an AVX2 CPU; res_check passing is checked in the default suite (the 2-rank trajectory fixture)
def test_res_check_names_a_parameter_that_differs():
    """A rank whose chunk is corrupted after init (one element of one parameter) makes res_check fail
    with the parameter's name."""
    from memopt.api import compose_config
    from memopt.parallel import RankFailure, launch
    from omegaconf import OmegaConf

    cfg = compose_config([*BASE[:2], "logger=none", "+strategy=chunk", "strategy.chunk.release_after_init=true",
                          "strategy.chunk.res_check=true"])
    with pytest.raises(RankFailure, match=r"res_check.*differs.*1 parameter\(s\): \S+"):
        launch(2, corrupt_then_build, OmegaConf.to_container(cfg, resolve=True))


def corrupt_then_build(container: dict):
    """(Runs in each rank.) Rank 1 adds 1 to the first element of its first parameter right after
    init; res_check, which runs next in the build, must catch it."""
    import memopt.engines.chunk.engine as engine

    orig = engine.init_chunks

    def init_and_corrupt(mgr, *a, **k):
        orig(mgr, *a, **k)
        if os.environ.get("RANK") == "1":
            c = next(c for c in mgr.local_chunks if c.tensors)
            c.view_of(c.tensors[0])[0] += 1

    engine.init_chunks = init_and_corrupt
    return built_state(container)


FROZEN = ("wpe.", "blocks.0.")


def frozen_run(container: dict):
    """(Runs in each rank, or in-process for one rank.) gpt_tiny with wpe and block 0 frozen: build
    the chunk engine, train 3 steps on this rank's share of a fixed batch of 4, return the gathered
    state, the comm counters and whether any remote payload is left after the backward."""
    from omegaconf import OmegaConf

    from memopt.config import TrainConfig
    from memopt.engines.chunk import build_chunk_engine
    from memopt.memory.tracker import NullTracker
    from memopt.models.gpt import GPT
    from memopt.parallel import setup, teardown
    from memopt.strategies.precision import Precision

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), container))
    device = torch.device("cpu")
    dims = setup(device, cfg.parallel)
    ctx = dims.world
    try:
        with torch.device("meta"):
            model = GPT(cfg.model)
        for n, p in model.named_parameters():
            if n.startswith(FROZEN):
                p.requires_grad_(False)
        engine = build_chunk_engine(cfg, device, dims, NullTracker(), model, Precision())
        mgr = engine.mgr
        g = torch.Generator().manual_seed(0)
        per = 4 // ctx.size
        leftover, losses = [], []
        for _ in range(3):
            x = torch.randint(0, 256, (4, 32), generator=g)
            mine = x[ctx.rank * per: (ctx.rank + 1) * per]
            loss = engine.forward_backward(mine, mine.roll(1, 1), 0, 1)
            losses.append(float(ctx.all_reduce_(loss.reshape(1).clone())) / ctx.size)
            assert not any(c.has_grad for c in mgr.chunks if not c.trainable)
            leftover.append(sum(c.where is not None and not c.cached for c in mgr.chunks if not c.local))
            engine.step(1e-2)
        units = sum(bool(u.tensors) and u.trainable for u in mgr.comm.units) if mgr.comm else 0
        reduces = mgr.comm.stats.reduces if mgr.comm else 0
        return engine.full_state_dict(), leftover, units, reduces, losses
    finally:
        teardown()


@pytest.mark.slow  # 4 s; frozen parameters in chunks run by default in test_chunk_units.py
def test_frozen_parameters_on_two_ranks():
    """Frozen chunks are gathered for the forward and the backward and released after it, never
    reduced, never updated; the losses follow the one-rank run of the same batch."""
    from memopt.api import compose_config
    from memopt.parallel import launch
    from memopt.models.gpt import init_tensor
    from omegaconf import OmegaConf

    cfg = compose_config(["model=gpt_tiny", "model.seq_len=32", "logger=none", "+strategy=chunk",
                          "strategy.chunk.mem_cache=0"])
    container = OmegaConf.to_container(cfg, resolve=True)
    two = launch(2, frozen_run, container)[0]
    one = frozen_run(container)
    sd, leftover, units, reduces, losses = two
    assert leftover == [0, 0, 0]  # no remote payload survives a backward, frozen units included
    assert units > 0 and reduces == 3 * units  # only trainable units are reduced, once per step
    typed_model = OmegaConf.to_object(cfg).model
    for n, v in sd.items():
        if n.startswith(FROZEN):
            assert torch.equal(v, init_tensor(n, tuple(v.shape), 0, typed_model)), n
    # same global batch: the trajectory follows one rank (fp32, sum order only: 1e-5 as test_zero_parity;
    # weights are not compared elementwise: Adam turns last-bit differences of near-zero gradients
    # into steps of up to lr)
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, one[4])) <= 1e-5, (losses, one[4])
