"""The GPT block probe: its products', fused attention's and GELU's rates and its other memory-bound ops' GB/s at
the run's shapes, each timed apart in interleaved rounds (``block_rates``); and the element-wise rate the host
Adam step is priced from (``elementwise_gbps``)."""
from __future__ import annotations

import time
from typing import NamedTuple

import torch


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
    block's time, read 5.6-22.6 GB/s in one minute (experiments/step_time/LOG.md). The FLOPs, bytes and ops
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
    """What ``fn()`` dispatched, by the planner's rules (``simulate.op_work``, ``simulate._on_dtensors``): ``ops`` (those
    on DTensors also in ``dtensor_ops``), ``flops`` (fused attention's also in ``attention``) and bytes ``moved`` (the
    activation function's also in ``act``). The block probe and the op-overhead probes count with it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from memopt.planner.simulate import ACTIVATION_FNS, ATTENTION, _on_dtensors, op_work

    class Count(TorchDispatchMode):
        flops = attention = moved = act = ops = dtensor_ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            flops, moved = op_work(func, args, kwargs, out)
            self.ops, self.flops, self.moved = self.ops + 1, self.flops + flops, self.moved + moved
            self.dtensor_ops += _on_dtensors(args)
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
    against 5-6; experiments/step_time/LOG.md)."""
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
