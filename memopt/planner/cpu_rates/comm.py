"""gloo's collectives as a 2-rank CPU step pays them: latency and bus bandwidth per kind, between two processes of
their own with products between calls (``gloo_step_collectives``), or between two threads of this process where
no process can be started (``gloo_allreduce``)."""
from __future__ import annotations

import datetime
import statistics
import threading
import time

import torch


PROBED_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def gloo_step_collectives(sizes: tuple[int, int] = (2**14, 2**22), calls: int = 8,
                          compute_s: float = 0.03, timeout_s: float = 120.0) -> dict[str, tuple[float, float]]:
    """Per collective kind, (latency in microseconds, bus GB/s) of gloo as a 2-process step pays it: two
    processes (their own interpreters, as the ranks are: ``workers.context``), each call preceded by ``compute_s`` of
    products on the rank's share of the threads, so a blocking call also waits for the slower rank and
    starts with cold caches. t = latency + bus bytes / bandwidth through the medians of ``calls`` calls at
    the two ``sizes`` (fp32 elements per rank; their line, as ``gloo_allreduce`` draws it).

    Why not the threads of ``gloo_allreduce``: on 2 processes of this CPU the chunk engine's 124
    all-gathers and reduce-scatters of moe_small took 0.55-0.87 s of a step its plan gave 0.17 s; gloo's
    reduce-scatter costs about twice its all-reduce per bus byte, its all-to-all about half
    (experiments/step_time/LOG.md)."""
    import os
    import tempfile

    from memopt.planner.workers import context, in_callers_state

    ctx = context()  # forked from the planner's server: its imports made once, for the search's workers too
    threads = max(1, torch.get_num_threads() // 2)
    with tempfile.TemporaryDirectory() as d:
        queue = ctx.SimpleQueue()  # each rank puts one item: rank 0 its timings, either one its error
        group_timeout = timeout_s / 2  # a rank whose peer never joins reports before the parent gives up
        procs = [ctx.Process(target=in_callers_state(_collective_rank), args=(r, os.path.join(d, "store"), queue, sizes, calls,
                                                             compute_s, threads, group_timeout)) for r in range(2)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
            p.join(5)
        items = []
        while not alive and not queue.empty():  # read only once no child can be writing
            items.append(queue.get())
        queue.close()
    got = next((x for x in items if isinstance(x, dict)), None)
    if got is None:
        why = "timed out" if alive else "; ".join(str(x) for x in items) or "no result"
        raise RuntimeError(f"the 2-process gloo probe failed: {why}")
    # bus bytes (nccl-tests', as the simulation counts them) of 2 ranks: an all-reduce's buffer, (n-1)/n of the
    # others' full buffer (2 x the rank's), so 4 x n for every kind here, as for gloo_allreduce's buffers
    return {kind: _latency_and_rate(times, *sizes) for kind, times in got.items()}  # times: {size: seconds}


def _collective_rank(rank: int, path: str, queue, sizes, calls: int, compute_s: float, threads: int,
                     timeout_s: float) -> None:
    """One rank of ``gloo_step_collectives`` (a process of its own): rank 0 puts {kind: {size: seconds}} on
    ``queue``, or the error's text."""
    import torch.distributed as dist

    try:
        torch.set_num_threads(threads)
        pg = dist.ProcessGroupGloo(dist.FileStore(path, 2), rank, 2, datetime.timedelta(seconds=timeout_s))
        a = torch.randn(256, 256)

        def compute() -> None:
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < compute_s:
                a @ a

        got: dict[str, dict[int, float]] = {}
        for kind in PROBED_KINDS:
            for n in sizes:
                own, parts, full = torch.ones(n), [torch.ones(n) for _ in range(2)], torch.ones(2 * n)
                out_full = torch.empty(2 * n)
                call = {"all_reduce": lambda: pg.allreduce([own]),
                        "all_gather": lambda: pg.allgather([parts], [own]),
                        "reduce_scatter": lambda: pg.reduce_scatter([own], [parts]),
                        "all_to_all": lambda: pg.alltoall_base(out_full, full, [], [])}[kind]
                times = []
                for i in range(calls + 2):  # two warm-up calls
                    compute()
                    t0 = time.perf_counter()
                    call().wait()
                    if i >= 2:
                        times.append(time.perf_counter() - t0)
                got.setdefault(kind, {})[n] = statistics.median(times)
        if rank == 0:
            queue.put(got)
    except BaseException as e:  # noqa: BLE001 - reported by the caller, which falls back
        queue.put(f"rank {rank}: {type(e).__name__}: {e}")


def gloo_allreduce(small: int = 2**14, large: int = 2**22) -> tuple[float, float]:
    """(latency in microseconds, bus GB/s) of a gloo all-reduce between two threads of this process:
    t(n) = latency + bus bytes / bandwidth, from fp32 buffers of ``small`` and ``large`` elements
    (bus bytes of an all-reduce of 2 ranks: the buffer's)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=30)
    store = dist.HashStore()
    times: dict[int, float] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            pg = dist.ProcessGroupGloo(dist.PrefixStore("memopt-probe", store), r, 2, timeout)
            for n in (small, large):
                x = torch.ones(n)
                pg.allreduce([x]).wait()
                best = float("inf")
                for _ in range(3):
                    t0 = time.perf_counter()
                    pg.allreduce([x]).wait()
                    best = min(best, time.perf_counter() - t0)
                if r == 0:
                    times[n] = best
        except BaseException as e:  # reported below: a probe that failed must not pass for a measurement
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors or len(times) < 2:
        raise RuntimeError(f"the gloo all-reduce probe failed: {errors[0] if errors else 'timed out'}")
    return _latency_and_rate(times, small, large)


def _latency_and_rate(times: dict[int, float], small: int, large: int) -> tuple[float, float]:
    """(latency in microseconds, bus GB/s): the line t = latency + bus bytes / bandwidth through the times of
    fp32 buffers of ``small`` and ``large`` elements whose bus bytes are the buffer's (4 B an element)."""
    per_byte = max(1e-12, (times[large] - times[small]) / (4 * (large - small)))
    latency = max(0.0, times[small] - 4 * small * per_byte)
    return latency * 1e6, 1 / per_byte / 1e9
