"""Host bytes per parameter of the chunk engine, measured by the tracker through the run as the CLI builds it.

The reference is a formula from the model's shapes, not the engine's accounting: P parameters, packed
greedily in registration order into chunks of the run's chunk size (a tensor never spans two chunks;
re-derived here from the shapes), give C chunk elements, C - P of them padding (at most 5% of P:
the stated slack). Model states
(``chunks`` on the host: parameter payloads, gradients, fp32 master / momentum / variance):

* fp16, ``grad_accum`` = 1: gradients are written over the parameters (PatrickStar's reuse), so
  2 B (parameters, then gradients) + 12 B (optimizer) per chunk element: <= 14 C;
* fp16 with accumulation: a gradient companion of 2 B more: <= 16 C;
* fp32: the 4 B payload is parameters, then gradients, beside the 12 B of master / momentum /
  variance (the master is what the parameters are refreshed from): <= 16 C.

The device budget is below one step's chunks, so the optimizer chunks all stay on the host (12 C is
also a lower bound) and the host step streams: its ``temp`` is at most two chunks of the payload dtype
(the staging buffers a device chunk's gradients are copied into and its parameters written over: 4 B
per chunk element in fp16/bf16, 8 in fp32) plus scalars, not a rank's gradient.
"""
from __future__ import annotations

import pytest

from tests.chunk.helpers import records
from tests.conftest import train

BASE = ["model=gpt_tiny", "model.seq_len=32", "trainer.micro_batch_size=2", "trainer.max_steps=2", "trainer.eval_every=0",
        "strategy.chunk.device_budget_gb=0.004", "strategy.chunk.warmup_gpu_chunk_mem_ratio=0.5"]
SCALARS = 64 * 1024  # the step's 0-dim tensors and the norm's partial sums


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def packed_elements(shapes: list[tuple[int, ...]], chunk: int) -> int:
    """Chunk elements of the greedy in-order packing of ``shapes`` into chunks of ``chunk`` elements."""
    n, used = 0, chunk
    for s in shapes:
        k = numel(s)
        if used + k > chunk:
            n, used = n + 1, 0
        used += k
    return n * chunk


def model_shapes(overrides: list[str]) -> list[tuple[int, ...]]:
    """The distinct parameters' shapes in registration order (tied weights once), from a meta model."""
    import torch

    from memopt.models import model_class
    from tests.conftest import typed

    cfg = typed(overrides).model
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    return [tuple(p.shape) for p in model.parameters()]


CASES = {  # name -> (overrides, model-state bytes per chunk element, payload bytes per element)
    "fp16": (["+strategy=hybrid_adam", "strategy.fp16.init_scale=1024"], 14, 2),
    "fp16_accum": (["+strategy=hybrid_adam", "strategy.fp16.init_scale=1024", "trainer.grad_accum=2",
                    "trainer.micro_batch_size=1"], 16, 2),
    "bf16": (["+strategy=hybrid_adam_bf16"], 14, 2),
    "fp32": (["+strategy=hybrid_adam_fp32"], 16, 4),
}


@pytest.mark.parametrize("name", list(CASES))
def test_host_model_states_meet_the_formula(tmp_path, name):
    extra, per_element, payload = CASES[name]
    summary = train([*BASE, *extra], str(tmp_path / name))
    assert summary["status"] == "ok"
    chunk = records(str(tmp_path / name))[-1]["chunk"]["chunk_size"]
    host = summary["peak_bytes"]["0"]["host"]
    P = summary["params"]
    shapes = model_shapes([*BASE, *extra])
    assert sum(numel(s) for s in shapes) == P
    C = packed_elements(shapes, chunk)
    assert C <= 1.05 * P  # the stated slack: the searched chunk size pads this gpt_tiny (seq_len 32) by 4.2%
    assert host["chunks"] <= per_element * C, (host["chunks"] / P, per_element * C / P)
    assert host["chunks"] >= 12 * P  # the optimizer states all live on the host under this budget
    assert host["params"] == host["grads"] == host["optim"] == 0  # model states are chunks, nothing else
    staging = 2 * payload * chunk
    assert host["temp"] <= staging + SCALARS, f"host temp {host['temp']} B > two staging chunks ({staging} B)"



@pytest.mark.slow  # 4.5 s; one rank's formula runs by default, 2 ranks' chunks in test_strategy_effects
def test_each_of_two_ranks_holds_its_own_chunks_formula(tmp_path):
    """2 ranks: the chunks are padded to a multiple of 2 and dealt in groups of 2 (rank r owns the r-th
    chunk of every group), so rank r's host holds, at most, its own payloads (2 B per element in fp16,
    4 in fp32; the padding chunk's too) and 12 B per element of its own chunks that hold tensors."""
    from memopt.api import run_jobs_on_ranks

    cases = {"fp16": (CASES["fp16"][0], 2), "fp32": (CASES["fp32"][0], 4)}  # payload bytes per element
    common = ["logger=none", "trainer.progress_bar=false", "trainer.save_checkpoint=false"]
    jobs = [([*BASE, *extra, *common], str(tmp_path / name)) for name, (extra, _) in cases.items()]
    for (name, (extra, payload)), summary, (_, run_dir) in zip(cases.items(), run_jobs_on_ranks(2, jobs), jobs):
        assert summary["status"] == "ok", name
        chunk = records(run_dir)[-1]["chunk"]["chunk_size"]
        shapes = model_shapes([*BASE, *extra])
        real = packed_elements(shapes, chunk) // chunk
        total = real + real % 2  # padded to whole groups of 2
        for r in (0, 1):
            own = len(range(r, total, 2))
            own_real = len(range(r, real, 2))
            host = summary["peak_bytes"][str(r)]["host"]
            assert 12 * own_real * chunk <= host["chunks"] <= (payload * own + 12 * own_real) * chunk, (name, r, host)
            assert host["temp"] <= 2 * payload * chunk + SCALARS, (name, r, host["temp"])
