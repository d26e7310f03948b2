"""The collective counter (``memopt/parallel/comm.py``) against PyTorch's own ``CommDebugMode`` and
against payloads known by construction, on 2 gloo ranks: a column-then-row MLP under
``parallelize_module`` (DTensor's functional collectives) plus the ProcessGroup collectives that
flat groups and ZeRO call (``dist.all_reduce`` / ``all_gather_single`` / ``reduce_scatter_single``)."""
from __future__ import annotations

import pytest


def _count_on_rank():
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from memopt.parallel.comm import CommCounter
    from memopt.parallel.dims import all_gather_single, reduce_scatter_single

    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (2,))
        torch.manual_seed(0)
        mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
        parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        x = torch.randn(4, 8, requires_grad=True)
        with CommDebugMode() as ref, CommCounter() as mine:
            mlp(x).sum().backward()  # forward: all-reduce of the (4, 8) output; backward: of x's gradient
        pg = torch.ones(1000)
        with CommCounter() as raw:
            dist.all_reduce(pg)
            all_gather_single(torch.empty(2000), pg)
            reduce_scatter_single(torch.empty(500), pg)
        return {"ref_total": ref.get_total_counts(), "mine": mine.summary(), "raw": raw.summary()}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_counter_matches_comm_debug_mode_and_known_payloads():
    from memopt.parallel.launch import launch

    out = launch(2, _count_on_rank)[0]
    mine = out["mine"]
    assert mine["count"] == out["ref_total"] == 2
    assert mine["ops"] == {"all_reduce": {"count": 2, "bytes": 2 * 4 * 8 * 4}}
    assert out["raw"]["ops"] == {"all_reduce": {"count": 1, "bytes": 4000}, "all_gather": {"count": 1, "bytes": 8000},
                                 "reduce_scatter": {"count": 1, "bytes": 4000}}
