"""The host's cost of a dispatched op (Python, autograd, the dispatcher, the memory tracker every run has on), on
plain tensors and on DTensors (tensor parallelism's sharding propagation): a tiny training step timed and divided
by the ops it dispatches."""
from __future__ import annotations

import statistics
import time

import torch

from memopt.planner.cpu_rates.block import _counted


def _tiny_step(model: torch.nn.Module, opt, x: torch.Tensor, y: torch.Tensor) -> None:
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, -2), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


class _Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm, self.up, self.down = torch.nn.LayerNorm(width), torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _model(width: int = 16, blocks: int = 3) -> torch.nn.Module:
    return torch.nn.Sequential(*[_Block(width) for _ in range(blocks)])


def _time_per_call(fn, repeats: int = 5) -> float:
    from memopt.memory.tracker import MemoryTracker

    fn()  # warm-up: lazily made optimizer states, caches
    times = []
    with MemoryTracker(torch.device("cpu")):
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def op_overhead_us() -> float:
    """Host microseconds per dispatched op of a training step too small to compute anything."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), foreach=False)
        x, y = torch.randn(2, 4, 16), torch.randint(0, 16, (2, 4))

        def step():
            _tiny_step(model, opt, x, y)

        step()
        return 1e6 * _time_per_call(step) / _counted(step).ops
    finally:
        torch.set_num_threads(threads)


def dtensor_op_overhead_us(plain_us: float) -> float:
    """Host microseconds an op on DTensors costs beyond a plain op's: the tiny step with its Linear layers
    split column/row over a fake mesh of 2 ranks (no-op collectives), whose plain ops are charged at
    ``plain_us``. Raises where no process group can be made here (this process is a rank already)."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("this process has a process group of its own")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from memopt.planner.simulate import _forget_dtensor_plans

    threads = torch.get_num_threads()
    started = False
    try:
        torch.set_num_threads(1)
        dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
        started = True
        mesh = init_device_mesh("cpu", (2,))
        torch.manual_seed(0)
        model = _model()
        for block in model:
            parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        opt = torch.optim.AdamW(model.parameters(), foreach=False)
        x, y = torch.randn(2, 4, 16), torch.randint(0, 16, (2, 4))

        def step():
            _tiny_step(model, opt, x, y)

        step()
        count = _counted(step)  # every op, and those on DTensors (the tracker sees those once)
        n_all, n_dt = count.ops, count.dtensor_ops
        took = _time_per_call(step)
        return max(0.0, 1e6 * took - n_all * plain_us) / max(1, n_dt)
    finally:
        if started:
            dist.destroy_process_group()
            _forget_dtensor_plans()  # DTensor's caches would keep this mesh's specs (simulate.py)
        torch.set_num_threads(threads)
