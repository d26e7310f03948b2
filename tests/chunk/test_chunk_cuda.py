"""The chunk engine's host step on a CUDA device (the GPU check runs these; skipped without CUDA).

On a CPU the "device" chunks are host memory and the staging copies are memcpy; only on CUDA do the
pinned buffers, the side stream and its events order real transfers (``engines/chunk/staging.py``). A
missing wait shows up here as parameters read before their copy finished, i.e. a loss trajectory that
leaves the plain run's. References and tolerances: test_chunk_parity's (the memopt engine's run of the
same job; fp32 1e-5, fp16 5e-3 relative per step).
"""
from __future__ import annotations

import pytest
import torch

from tests.chunk.test_chunk_parity import BASE, FP16, REFS, TOL
from tests.conftest import losses, train

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="the staging's CUDA stream path needs a CUDA device")]

CASES = {  # every optimizer group on the host, the chunks on the device: every chunk goes through staging
    "chunk_fp32": (["+strategy=chunk"], "fp32"),
    "hybrid_adam_fp16_host": (["+strategy=hybrid_adam", *FP16, "strategy.hybrid_adam.max_device_chunks=0"], "fp16"),
    "hybrid_adam_fp16_split": (["+strategy=hybrid_adam", *FP16, "strategy.hybrid_adam.max_device_chunks=1"], "fp16"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_staged_host_step_on_cuda_follows_the_plain_run(tmp_path, name):
    extra, dtype = CASES[name]
    ref = train([*BASE, *REFS[dtype]], str(tmp_path / "ref"))
    got = train([*BASE, *extra], str(tmp_path / name))
    assert ref["status"] == got["status"] == "ok"
    a, b = losses(str(tmp_path / "ref")), losses(str(tmp_path / name))
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert abs(x - y) <= TOL[dtype] * abs(x), (name, a, b)
