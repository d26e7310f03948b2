"""What the planner's step time needs to know of this CPU, measured in 12-20 seconds (plan mode and auto).

A CPU rank's step is not its FLOPs at the matmul peak: on gpt_small the plan said 0.37 s where 2 ranks
took 1.2-2.0 s, and on gpt_tiny 0.026 s against 0.19 s (issue #30). The rest is memory-bound ops, the
host's cost of every op (Python, autograd, the dispatcher, the memory tracker every run has on), gloo's
collectives (a copy through the kernel's sockets, not a memcpy), and on DTensors tensor parallelism's
sharding propagation. Each probe measures one of these, for the fields of ``HardwareConfig`` a profile
leaves unset:

- ``compute_efficiency``, ``attention_efficiency``, ``memory_gbps`` and ``activation_gbps`` (per fast compute
  dtype: fp32, and bf16 where its products are fast, ``dtype_efficiency`` / ``dtype_memory_gbps``, whose
  ``bf16_weights`` is a block with bf16 weights too): a GPT block at
  the run's shapes (``probe_shape``), its products timed alone, its fused attention alone, its GELU alone, and the
  other memory-bound ops in the whole block with those skipped (``block_rates``);
- ``op_overhead_us``: a tiny training step (LayerNorm, Linear, GELU, residual, cross entropy, AdamW)
  under the memory tracker, timed after a warm-up, divided by the ops it dispatches, on one thread;
- ``dtensor_op_overhead_us``: the same kind of step with its Linear layers column/row parallel over a
  fake 2-rank mesh, less the plain ops' share, per op on DTensors (the tracker sees those once);
- ``collective_latency_us_by_kind`` / ``collective_gbps_by_kind`` (and the all-reduce's as
  ``collective_latency_us`` / ``device_device_gbps``): two gloo processes of their own (``workers.py``) calling
  each kind at 64 KiB and 16 MiB per rank between bursts of products (``gloo_step_collectives``: what a blocking
  call of a step pays, the wait for the slower rank included); where processes cannot be started, two threads of
  this process all-reducing (``gloo_allreduce``);
- ``host_adam_gparams_s``: GELU (tanh), LayerNorm and an add's bytes per second / 28 (CPUAdamW is memory bound at 28 bytes a parameter:
  experiments/cpu_adam).
"""
from __future__ import annotations

import datetime
import statistics
import sys
import threading
import time
from typing import NamedTuple

import torch

ADAM_BYTES_PER_PARAM = 28  # CPUAdamW reads p, g, m, v and writes p, m, v (fp32)
_CACHE: dict[tuple, object] = {}


def complete(profile, hw, device: torch.device, model=None):
    """``hw`` (``profile`` resolved) with the step-time rates ``profile`` leaves unset measured here, when
    the profile describes this CPU (``hardware=auto``: no peaks given; its ranks then share the cores, a
    device budget or not); any other profile as it is (a GPU's measured compute_efficiency stands for these
    terms; planning an H100 on a laptop must not take the laptop's rates). ``model``: the run's model
    config, whose shapes the block probes take (``probe_shape``)."""
    from dataclasses import replace

    if device.type != "cpu" or profile.peak_tflops:  # a GPU, or a profile of another machine (its peaks given)
        return hw
    return replace(hw, ranks_share_device=True, **measured(profile, hw.peak_tflops, probe_shape(model)))


def measured(hw, peaks: dict[str, float], shape: tuple[int, int, int, int] | None = None) -> dict[str, object]:
    """The step-time fields the profile ``hw`` leaves unset, measured here (cached for the process).
    ``peaks``: the resolved matmul peaks per dtype (whether bf16 is fast here); ``shape``: the block the
    probes time (``probe_shape``)."""
    out: dict[str, object] = {}
    shape = shape or probe_shape()
    threads = torch.get_num_threads()
    ovh = hw.op_overhead_us
    if ovh is None:
        ovh = out["op_overhead_us"] = _cached(("op",), op_overhead_us)
    dtypes = {"fp32": torch.float32}
    if peaks.get("bf16", 0) >= peaks["fp32"]:
        # bf16 products fast here (AVX-512-BF16 / AMX): rates of their own (on an AVX2 CPU a bf16 block takes
        # seconds, and auto ranks bf16 last there anyway)
        dtypes["bf16"] = torch.bfloat16
    # bf16's block also times its memory-bound ops with bf16 weights, in the same rounds (runs that keep them:
    # the chunk engine's, ``bf16.params=bf16``; their residual stream and norms in bf16 move half the bytes in
    # about the same time: 0.71-0.76 of the autocast block's rate, gpt_small's block, the AMX CPU)
    rates = {name: _cached(("block", ovh, peaks[name], threads, shape, name),
                           lambda d=d, name=name: block_rates(ovh, peaks[name] / threads * 1e12, shape, d,
                                                              bf16_weights_too=name == "bf16"))
             for name, d in dtypes.items()}  # one thread's peak, as step_time divides by
    if hw.compute_efficiency == 1.0:  # the default: nothing measured; a profile's own value wins
        out["compute_efficiency"] = rates["fp32"].products
        if not hw.dtype_efficiency and "bf16" in rates:
            out["dtype_efficiency"] = {"bf16": rates["bf16"].products}
    if not hw.attention_efficiency:
        out["attention_efficiency"] = {name: r.attention for name, r in rates.items()}
    if hw.memory_gbps is None:
        out["memory_gbps"] = rates["fp32"].memory_gbps
        if not hw.dtype_memory_gbps and "bf16" in rates:
            out["dtype_memory_gbps"] = {"bf16": rates["bf16"].memory_gbps,
                                        "bf16_weights": rates["bf16"].weights_memory_gbps}
    if not hw.activation_gbps:
        out["activation_gbps"] = {name: r.activation_gbps for name, r in rates.items()}
    if hw.dtensor_op_overhead_us is None:
        got = _tried(("dtensor", ovh, threads), lambda: dtensor_op_overhead_us(ovh))
        if got is not None:
            out["dtensor_op_overhead_us"] = got
    kinds, comm_unset = None, hw.device_device_gbps is None or hw.collective_latency_us is None
    if comm_unset and not hw.collective_gbps_by_kind:
        kinds = _tried(("gloo-processes",), gloo_step_collectives)  # None: no spawn here; threads below
        if kinds is not None:  # a rate the profile gives stays the only one of its kind (latency or bandwidth)
            if hw.device_device_gbps is None:  # the kinds not probed (broadcast, reduce, send) as an all-reduce
                out["collective_gbps_by_kind"] = {k: v[1] for k, v in kinds.items()}
                out["device_device_gbps"] = kinds["all_reduce"][1]
            if hw.collective_latency_us is None:
                out["collective_latency_us_by_kind"] = {k: v[0] for k, v in kinds.items()}
                out["collective_latency_us"] = kinds["all_reduce"][0]
    if comm_unset and kinds is None:
        got = _tried(("gloo",), gloo_allreduce)  # failed (no gloo, no address): the copy rate stays, no latency term
        if got is not None:
            if hw.device_device_gbps is None:
                out["device_device_gbps"] = got[1]
            if hw.collective_latency_us is None:
                out["collective_latency_us"] = got[0]
    if hw.host_adam_gparams_s is None:
        out["host_adam_gparams_s"] = _cached(("elementwise", threads), elementwise_gbps) / ADAM_BYTES_PER_PARAM
    return out


def elementwise_gbps(rows: int = 2048, width: int = 512) -> float:
    """Bytes read + written per second by a transformer's memory-bound ops (GELU (tanh), LayerNorm, a
    residual add, each over a 4 MiB fp32 activation), on one thread, times torch's threads (as the matmul
    peak is taken). A large ``copy_`` or an ``add`` alone overstates them many times: on one core of an EPYC
    an add of 4 MiB moved 116 GB/s (in cache), exact GELU 39, the tanh GELU GPT-2 uses 6.9."""
    from memopt.planner.simulate import _moved_bytes

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x, r = torch.randn(rows, width), torch.randn(rows, width)
        w, b = torch.ones(width), torch.zeros(width)
        def gelu(t):
            return torch.nn.functional.gelu(t, approximate="tanh")  # GPT-2's, as memopt's GPT runs it

        ops = [(gelu, (x,)), (torch.nn.functional.layer_norm, (x, (width,), w, b)), (torch.add, (x, r))]
        moved = sum(_moved_bytes(a, {}, f(*a)) for f, a in ops)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for f, a in ops:
                f(*a)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return moved / best / 1e9 * threads


PROBE_ROWS = 2048  # tokens of the block the probes time: gpt_small's micro-batch 4 x 512, out of a core's L2


def probe_shape(model=None) -> tuple[int, int, int, int]:
    """(batch, seq, width, heads) of the block the probes time: the model's sequence (up to 4096) and head
    size, its width up to 1024, ``PROBE_ROWS`` tokens; gpt_small's where no model is given. The rates are
    read at the run's own shapes because they move with them: the CPU's fused attention does about as many
    FLOP/s at sequence 2048 as 1.5x at 512 (causal blocks skipped), and bf16 reaches a fifth of the bf16
    matmul peak there against three fifths for the products."""
    if model is None:
        return PROBE_ROWS // 512, 512, 512, 8
    head = model.d_model // model.n_head
    heads = max(1, min(model.d_model, 1024) // head)
    seq = min(model.seq_len, 4096)
    return max(1, PROBE_ROWS // seq), seq, heads * head, heads


class BlockRates(NamedTuple):
    """What ``block_rates`` measured: fractions of one thread's matmul peak and GB/s, all of them scaled to
    the process's threads as ``step_time`` divides by them."""

    products: float  # the block's four products' fraction of the matmul peak
    attention: float  # its fused attention's fraction of the peak
    memory_gbps: float  # its other memory-bound ops (LayerNorm, residual adds, casts)
    activation_gbps: float  # its GELU, forward and backward
    weights_memory_gbps: float | None = None  # the memory-bound ops of the same block with bf16 weights


def block_rates(overhead_us: float, peak_flops: float, shape: tuple[int, int, int, int],
                dtype: torch.dtype = torch.float32, bf16_weights_too: bool = False) -> BlockRates:
    """The products' and fused attention's fractions of the matmul peak, the memory-bound GB/s and the
    activation function's GB/s of a GPT block's forward + backward at ``shape`` (``probe_shape``) in ``dtype``
    (bf16: under the bf16 strategy's autocast), on one thread, under the memory tracker as runs have it.
    ``peak_flops``: one thread's resolved matmul peak. The block's four products are timed alone and its
    attention alone, each less its ops at ``overhead_us``; its GELU (forward and backward) alone; the other
    memory-bound ops (LayerNorm, residual adds, autocast's casts: in bf16 some move half the bytes in about the
    same time per element, so each dtype has its own rate) in the whole block with its products, attention and
    GELU skipped (``Skipping``), less its ops at ``overhead_us`` (GELU (tanh) moves 1.5-5 GB/s on a thread of the
    AMX CPU, adds and casts 20-45: one rate for both priced a step by its mix of them; simulate.ACTIVATION_FNS).
    ``bf16_weights_too``: also the memory-bound ops of the same block with bf16 parameters (runs that keep bf16
    weights: their residual stream and norms in bf16), in the same rounds, so that both rates read one phase of
    the machine (a probe of its own cost ~4 s, products and attention timed again for nothing). Why not the
    block's time less its products at their own rate: on the AMX CPU a thread's bf16 products switch between
    ~0.45 and ~1.15 TFLOP/s every few seconds (a neighbour on the core), and that remainder, a tenth of the
    block's time, read 5.6-22.6 GB/s in one minute (experiments/step_time/README.md). The FLOPs, bytes and ops
    are counted by the planner's own rule (``simulate.op_work``)."""
    from memopt.memory.tracker import MemoryTracker
    from memopt.planner.simulate import _FLOPS, ACTIVATION_FNS

    batch, seq, width, heads = shape
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        autocast = torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32, cache_enabled=False)
        block, (qkv, proj, up, down) = _gpt_block(shape, autocast, torch.float32)
        a_in = [torch.randn(batch, seq, n, dtype=dtype, requires_grad=True) for n in (width, width, 4 * width)]
        a_grad = [torch.ones(batch, seq, n, dtype=dtype) for n in (3 * width, 4 * width, width)]
        qkv_in = [torch.randn(batch, heads, seq, width // heads, dtype=dtype, requires_grad=True) for _ in range(3)]
        qkv_grad = torch.ones(batch, heads, seq, width // heads, dtype=dtype)

        def products():  # the block's four products at its shapes, nothing else (their gradients given)
            with autocast:
                outs = [qkv(a_in[0]), proj(a_in[1]), up(a_in[0]), down(a_in[2])]
            torch.autograd.backward(outs, [a_grad[0], a_grad[2], a_grad[1], a_grad[2]])

        def attention():
            with autocast:
                out = torch.nn.functional.scaled_dot_product_attention(*qkv_in, is_causal=True)
            out.backward(qkv_grad)

        hidden = torch.randn(batch, seq, 4 * width, dtype=dtype, requires_grad=True)  # the up-projection's output
        hidden_grad = torch.ones(batch, seq, 4 * width, dtype=dtype)

        def activation():  # the block's GELU, forward and backward, at its shape and dtype
            with autocast:
                out = torch.nn.functional.gelu(hidden, approximate="tanh")
            out.backward(hidden_grad)

        skipping = Skipping(frozenset(_FLOPS) | ACTIVATION_FNS)

        def skipped(fn):  # the whole block, its products, attention and GELU skipped (their outputs zeros)
            def memory_bound():
                with skipping:
                    fn()
            return memory_bound

        fns = [products, attention, activation, skipped(block)]
        whole = [block]  # counted whole: the bytes of the memory-bound ops, the GELU's apart
        if bf16_weights_too:
            weights_block, _ = _gpt_block(shape, autocast, torch.bfloat16)
            fns.append(skipped(weights_block))
            whole.append(weights_block)
        # each counted once, which is also its warm-up (first calls build kernels; the skipped runs' zeros
        # and layouts included, whose ops each pay the host's cost)
        counts, wholes = [_counted(fn) for fn in fns], [_counted(fn) for fn in whole]
        with MemoryTracker(torch.device("cpu")):
            times = settled_best(fns)
    finally:
        torch.set_num_threads(threads)
    ovh = overhead_us * 1e-6
    (c_mm, c_att, c_act, *c_rest), (t_mm, t_att, t_act, *t_rest) = counts, times

    def gbps(moved: int, t: float, ops: int) -> float:  # the overhead misread: never a free memory term
        return moved / max(t - ops * ovh, 0.05 * t) / 1e9 * threads

    mm = c_mm.flops / max(t_mm - c_mm.ops * ovh, 1e-9) / peak_flops
    att = c_att.attention / max(t_att - c_att.ops * ovh, 1e-9) / peak_flops
    mm, att = (min(1.0, max(0.01, e)) for e in (mm, att))
    mem = [gbps(w.moved - w.act, t, c.ops) for w, t, c in zip(wholes, t_rest, c_rest)]
    return BlockRates(mm, att, mem[0], gbps(c_act.act, t_act, c_act.ops), mem[1] if bf16_weights_too else None)


def _gpt_block(shape: tuple[int, int, int, int], autocast, weights: torch.dtype):
    """GPT-2's block (memopt's GPT) at ``shape`` with parameters of ``weights``: a closure running its forward
    under ``autocast`` and its backward, and its four Linear layers (the products ``block_rates`` times alone)."""
    batch, seq, width, heads = shape
    ln1, ln2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
    qkv, proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
    up, down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)
    for m in (ln1, ln2, qkv, proj, up, down):
        m.to(weights)
    x = torch.randn(batch, seq, width, dtype=weights, requires_grad=True)
    grad = torch.ones(batch, seq, width, dtype=weights)

    def block():
        with autocast:
            q, k, v = qkv(ln1(x)).view(batch, seq, 3, heads, width // heads).permute(2, 0, 3, 1, 4)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = x + proj(a.transpose(1, 2).reshape(batch, seq, width))
            out = h + down(torch.nn.functional.gelu(up(ln2(h)), approximate="tanh"))
        out.backward(grad)

    return block, (qkv, proj, up, down)


def _counted(fn):
    """What ``fn()`` dispatched, by ``simulate.op_work``'s rule: ``ops``, ``flops`` (fused attention's also in
    ``attention``) and bytes ``moved`` (the activation function's also in ``act``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from memopt.planner.simulate import ACTIVATION_FNS, ATTENTION, op_work

    class Count(TorchDispatchMode):
        flops = attention = moved = act = ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            flops, moved = op_work(func, args, kwargs, out)
            self.ops, self.flops, self.moved = self.ops + 1, self.flops + flops, self.moved + moved
            if func._overloadpacket in ATTENTION:
                self.attention += flops
            if func._overloadpacket in ACTIVATION_FNS:
                self.act += moved
            return out

    with Count() as count:
        fn()
    return count


class Skipping:
    """Inside it, the ops of ``packets`` (overload packets: the products and fused attention of
    ``simulate._FLOPS``, GELU) return zeros of their outputs' shapes, strides and dtypes
    without computing anything; every other op runs. A block run so takes the time of its other memory-bound
    ops and its ops' host cost, none of the skipped ops' (``block_rates``). The outputs' layouts are read once per
    op and argument layout (a meta kernel's call costs ~100 us, a tenth of a small model's memory-bound time)."""

    def __init__(self, packets: frozenset):
        self.packets = packets
        self._layouts: dict = {}

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
        from torch.utils._pytree import tree_map

        packets, layouts = self.packets, self._layouts

        def zeros_like_out(args, kwargs, func):
            key = (func, repr(tree_map(lambda t: (t.shape, t.stride(), t.dtype) if isinstance(t, torch.Tensor) else t,
                                       (args, kwargs))))
            out = layouts.get(key)
            if out is None:
                with _disable_current_modes():  # the output's shape and strides, from the op's meta kernel, unseen
                    meta = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, (args, kwargs))
                    out = layouts[key] = func(*meta[0], **meta[1])  # by the tracker and the counting modes outside
            return tree_map(lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).zero_()
                            if isinstance(t, torch.Tensor) else t, out)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func._overloadpacket in packets:
                    return zeros_like_out(args, kwargs or {}, func)
                return func(*args, **(kwargs or {}))

        self._mode = Mode()
        return self._mode.__enter__()

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


def settled_best(fns, least: int = 3, most: int = 6, within: float = 0.05) -> list[float]:
    """The best time of each of ``fns``, timed in interleaved rounds (so that the machine's drift reaches them
    alike: the memory rate is a difference of their times) until each best has been met again within
    ``within`` by a later round, ``least`` to ``most`` rounds. Why: on a shared 2-core VM a round can run
    20-30% slow for seconds, and the memory rate, ~12% of the block's time, magnifies that 8-fold: five probes
    of three fixed rounds read it at 4.0-13.0 GB/s, five settled ones, alternating with them, 7.2-13.6 (8-9 s
    against 5-6; experiments/step_time/README.md)."""
    best = [float("inf")] * len(fns)
    confirmed = [False] * len(fns)
    for r in range(most):
        for k, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            t = time.perf_counter() - t0
            if t < best[k] * (1 - within):  # a new best: to be met again
                best[k], confirmed[k] = t, False
            elif t <= best[k] * (1 + within):  # met again (a slow round confirms nothing)
                best[k], confirmed[k] = min(best[k], t), True
        if r + 1 >= least and all(confirmed):
            break
    return best


def _cached(key: tuple, fn):
    """``fn()``, once per process for ``key`` (the probe's name and every argument it depends on). The first probe
    of a process says so first: the probes take 15-30 s, in which a plan or a search printed nothing."""
    if key not in _CACHE:
        if not _CACHE:
            print("memopt planner: measuring this CPU's step-time rates (products, memory-bound ops, the cost of an "
                  "op, gloo's collectives: 15-30 s, once a process)", file=sys.stderr, flush=True)
        _CACHE[key] = fn()
    return _CACHE[key]


def _tried(key: tuple, fn):
    """``_cached`` for a probe that may not run here (no gloo, no usable address, a process group of this
    process's own): None, with a warning, and the term it feeds is then not estimated."""
    try:
        return _cached(key, fn)
    except Exception as e:  # noqa: BLE001 - a probe that cannot run must not stop the plan
        import warnings

        _CACHE[key] = None  # not tried again in this process (a failed spawn or group would fail, slowly, again)
        warnings.warn(f"memopt planner: the CPU probe {key[0]} could not run here ({type(e).__name__}: {e}); "
                      "its step-time term is not estimated", stacklevel=2)
        return None


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


def _count_ops(fn, only_dtensor: bool = False) -> int:
    """Ops ``fn`` dispatches as the memory tracker (and the planner's counting) sees them."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not only_dtensor or any(type(a).__name__ == "DTensor" for a in tree_leaves(args)):
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


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
        n = _count_ops(step)
        return 1e6 * _time_per_call(step) / n
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
        n_all, n_dt = _count_ops(step), _count_ops(step, only_dtensor=True)
        took = _time_per_call(step)
        return max(0.0, 1e6 * took - n_all * plain_us) / max(1, n_dt)
    finally:
        if started:
            dist.destroy_process_group()
            _forget_dtensor_plans()  # DTensor's caches would keep this mesh's specs (simulate.py)
        torch.set_num_threads(threads)


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
    (experiments/step_time/README.md)."""
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
