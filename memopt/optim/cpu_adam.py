"""Host-side AdamW for ZeRO-Offload and the chunk engine's Hybrid Adam (``CPUAdamW``).

What it computes
----------------
``torch.optim.AdamW``'s math (Loshchilov & Hutter decoupled weight decay, bias-corrected), in
fp32, in place on fp32 CPU tensors (typically flat master-weight shards), with one step counter
shared by all tensors. For step ``t`` (1-based), per element::

    g  = grad / grad_scale
    m  = beta1 * m + (1 - beta1) * g
    v  = beta2 * v + (1 - beta2) * g * g
    p  = p * (1 - lr * wd) - lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

The gradients may be fp16 or bf16 (the chunk engine's payloads), read and widened in the same pass, and
may share their memory with ``out`` (a chunk's payload holds the gradients and receives the parameters).

Optionally the updated ``p`` is also written into a second tensor in the same pass (``out``;
DeepSpeed's "fused copy back"): fp16 or bf16 (rounded to nearest even), or fp32 (a plain copy: the
fp32 parameters of a ZeRO-Offload run on a CPU device, whose host master is a separate tensor).
That costs 2 (4) more bytes per parameter instead of a second pass that reads 4 and writes 2 (4)
plus the write-allocate.

Implementations (chosen on measurements: ``experiments/cpu_adam/README.md``)
----------------------------------------------------------------------------
The step is memory bound: it reads p, g, m, v (16 B/param) and writes p, m, v (12 B/param),
28 B/param (30 with the low-precision copy). Candidates timed on the same tensors:

* ``"cpp"`` (the default when it builds): memopt's own C++ kernel (``cpu_adam.cpp``), compiled
  on first use with ``torch.utils.cpp_extension.load_inline`` (``-O3 -march=native -fopenmp``).
  - SIMD body with AVX-512 (or AVX2+FMA+F16C) intrinsics that moves each stream in 128-float
    tiles (8 consecutive cache lines of g, then m, v, p; stores likewise). On one core this ran
    ~6 % faster than the same math as a plain ``#pragma omp simd`` loop, which interleaves the
    four streams line by line, and matched DeepSpeed's AVX-512 kernel (which also moves 8 vectors
    per stream at a time). Without those ISAs (or with ``-DMEMOPT_PORTABLE``) the ``omp simd``
    loop is used. Scalar tails use the same FMA sequence, so every element's result is
    independent of tensor splits, alignment and thread count.
  - One parallel region per step: all tensors of a step form one list of 32 Ki-element chunks
    handed to ``at::parallel_for`` (ATen's OpenMP pool, so ``torch.set_num_threads`` applies).
    DeepSpeed and ``torch._fused_adamw_`` open at least one region per tensor; on a shared,
    oversubscribed 2-core machine each extra fork/join can wait a scheduler time slice, which is
    where most of the 2-thread gap in the benchmark comes from.
  - Fused extras: the fp16/bf16/fp32 copy-out (``out``, written from registers with
    non-temporal stores when 64-B aligned, so it costs ~2 (4) B/param and no read-for-ownership) and
    the gradient unscale (``grad_scale``).
  - Compile cost: the source includes only ``torch/library.h`` and ATen's parallel header (no
    pybind, no ``torch/extension.h``) and registers a ``torch.ops.memopt_cpu_adam`` op, which
    keeps the one-time build at ~7 s on 2 cores (``torch/extension.h`` alone took ~23 s). The
    build is cached in torch's extension directory (``~/.cache/torch_extensions/...`` or
    ``$TORCH_EXTENSIONS_DIR``) under a name hashing the source, flags, torch version and the
    CPU's feature flags, so a ``-march=native`` binary is never reused on a different CPU.
* ``"torch"`` (fallback): ``torch._fused_adamw_``, PyTorch's own fused CPU kernel (what
  ``torch.optim.AdamW(fused=True)`` calls), one call per distinct weight decay; the
  copy into ``out`` (any of the three dtypes) is a second pass (``out.copy_(p)``): torch's
  kernel has no second output. Used when the kernel cannot be built
  (no compiler / ninja: a warning says why), or when asked for with ``impl="torch"`` or
  ``MEMOPT_CPU_ADAM=torch``. About as fast on one thread, slower on two and with the copy-out.
* ``_foreach_*`` ops (``torch.optim.AdamW(foreach=True)``) make one memory pass per elementary
  op and were ~8x slower; they appear only in the benchmark.

The two paths differ by fp32 rounding only (the kernel uses FMAs and multiplies by
``1/grad_scale``; torch divides).
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
import warnings
from pathlib import Path

import torch

__all__ = ["CPUAdamW", "kernel_available", "kernel_error", "kernel_simd_width", "load_kernel", "sumsq"]

log = logging.getLogger(__name__)

_NAMESPACE = "memopt_cpu_adam"


def _source() -> str:
    """The kernel's source (``cpu_adam.cpp``), read when it is built: its hash names the cached build. Missing (an
    install without the package data), the build fails in ``load_kernel``'s ``try`` and torch's kernel is used."""
    return Path(__file__).with_name("cpu_adam.cpp").read_text(encoding="utf-8")


_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]
_LDFLAGS = ["-fopenmp"]


def _cflags() -> list[str]:
    """``_CFLAGS`` plus ``$MEMOPT_CPU_ADAM_CFLAGS`` (``-mno-avx512f``: the AVX2 path; ``-DMEMOPT_PORTABLE``: the
    portable loop)."""
    return _CFLAGS + os.environ.get("MEMOPT_CPU_ADAM_CFLAGS", "").split()


_lock = threading.Lock()
_kernel = None  # the torch.ops op once loaded
_kernel_error: str | None = None
_tried = False


def _cpu_tag() -> str:
    """The CPU's feature flags (Linux) so a ``-march=native`` build is never reused on another CPU."""
    from memopt.memory.hardware import cpuinfo_field

    return cpuinfo_field("flags", "Features") or platform.processor() or platform.machine()


def _extension_name() -> str:
    key = "\n".join([_source(), " ".join(_cflags() + _LDFLAGS), torch.__version__, _cpu_tag()])
    return f"memopt_cpu_adam_{hashlib.sha1(key.encode()).hexdigest()[:12]}"


def load_kernel():
    """Compile (first use; cached in torch's extension dir) and load the C++ kernel.

    Returns the op, or ``None`` when it cannot be built here; ``kernel_error()`` then says why.
    """
    global _kernel, _kernel_error, _tried
    with _lock:
        if _tried:
            return _kernel
        _tried = True
        if hasattr(torch.ops, _NAMESPACE) and hasattr(getattr(torch.ops, _NAMESPACE), "adamw_step"):
            _kernel = torch.ops.memopt_cpu_adam.adamw_step  # already registered in this process
            return _kernel
        try:
            from torch.utils.cpp_extension import load_inline, verify_ninja_availability

            verify_ninja_availability()
            log.info("memopt CPUAdamW: compiling the C++ kernel (one time, ~10 s; cached in torch's extension dir)")
            load_inline(
                name=_extension_name(),
                cpp_sources=_source(),
                extra_cflags=_cflags(),
                extra_ldflags=_LDFLAGS,
                is_python_module=False,
                no_implicit_headers=True,
                verbose=False,
            )
            _kernel = torch.ops.memopt_cpu_adam.adamw_step
        except Exception as e:  # no compiler, no ninja, unsupported flags, ...
            _kernel_error = _summarize(e)
            _kernel = None
        return _kernel


_SUMSQ_SLICE = 1 << 22  # elements per fp32 temporary of sumsq's torch path (16 MiB)


def sumsq(xs: list[torch.Tensor]) -> float:
    """Sum of the squares of every element of ``xs`` (contiguous fp32/fp16/bf16 CPU tensors), accumulated in
    double: not finite when an element is inf or NaN. Why not ``torch.linalg.vector_norm(x, dtype=float32)``:
    on a CPU it reads 2e8 bf16 elements 3% low (its fp32 accumulator), and ``x.float().pow(2).sum()`` holds a
    4 B/element copy. The C++ kernel reads each element once; without it, slices of 4 Mi elements are
    converted one at a time. Fake tensors (the planner's step) have no values: 0.0."""
    if any(type(x).__name__ == "FakeTensor" for x in xs):
        return 0.0
    if load_kernel() is not None and os.environ.get("MEMOPT_CPU_ADAM", "") != "torch":
        return float(torch.ops.memopt_cpu_adam.sumsq([x.contiguous() for x in xs]))
    acc = 0.0
    for x in xs:
        flat = x.reshape(-1)
        for a in range(0, flat.numel(), _SUMSQ_SLICE):
            acc += float(flat[a:a + _SUMSQ_SLICE].to(torch.float64).pow_(2).sum())
    return acc


def _summarize(e: Exception) -> str:
    """The exception type, its first line and the compiler's error lines, for a one-line message."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    head = lines[0].split(": [", 1)[0][:200]  # torch puts the ninja log after "...extension 'x': "
    errors = [ln[:200] for ln in lines[1:] if ("error" in ln.lower() or "not found" in ln.lower())
              and "-isystem" not in ln]
    return f"{type(e).__name__}: " + " | ".join([head] + errors[:3])


def kernel_available() -> bool:
    return load_kernel() is not None


def kernel_simd_width() -> int | None:
    """fp32 lanes of the built kernel's SIMD path: 16 AVX-512, 8 AVX2, 1 portable loop; None if unbuilt."""
    return int(torch.ops.memopt_cpu_adam.simd_width()) if load_kernel() is not None else None


def kernel_error() -> str | None:
    """Why the C++ kernel could not be built (``None`` if it was, or was not tried yet)."""
    return _kernel_error


class CPUAdamW:
    """AdamW (decoupled weight decay, torch.optim.AdamW math, bias-corrected) over fp32 CPU tensors.

    ``params`` are contiguous fp32 CPU tensors (e.g. flat master shards), updated in place.
    The states ``exp_avg`` / ``exp_avg_sq`` (lists, fp32, same shapes) are allocated eagerly
    here, zero-filled, so a caller can account their bytes (``state_nbytes``) before the first
    step. One step counter (``step_count``) is shared by all tensors.

    ``impl``: ``"auto"`` (C++ kernel, falling back to torch with a warning if it cannot be
    built; the environment variable ``MEMOPT_CPU_ADAM=cpp|torch`` overrides ``auto``), ``"cpp"``
    (error if it cannot be built) or ``"torch"`` (``torch._fused_adamw_``). ``self.impl`` says
    which one runs.
    """

    def __init__(self, params: list[torch.Tensor], lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, impl: str = "auto"):
        params = list(params)
        for i, p in enumerate(params):
            if p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous():
                raise ValueError(f"CPUAdamW: params[{i}] must be a contiguous fp32 CPU tensor, "
                                 f"got {p.dtype} on {p.device} (contiguous={p.is_contiguous()})")
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"CPUAdamW: betas must be in [0, 1), got {betas}")
        self.params = params
        self.lr = float(lr)
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.step_count = 0
        with torch.no_grad():
            self.exp_avg = [torch.zeros_like(p, memory_format=torch.contiguous_format) for p in params]
            self.exp_avg_sq = [torch.zeros_like(p, memory_format=torch.contiguous_format) for p in params]
        self.impl = self._resolve_impl(impl)
        self._kernel = load_kernel() if self.impl == "cpp" else None

    @staticmethod
    def _resolve_impl(impl: str) -> str:
        if impl == "auto":
            impl = os.environ.get("MEMOPT_CPU_ADAM", "auto") or "auto"
        if impl not in ("auto", "cpp", "torch"):
            raise ValueError(f"CPUAdamW: impl must be auto, cpp or torch, got {impl!r}")
        if impl == "torch":
            return "torch"
        if load_kernel() is not None:
            return "cpp"
        if impl == "cpp":
            raise RuntimeError(f"CPUAdamW: the C++ kernel could not be built ({kernel_error()}); it needs a C++ "
                               "compiler with OpenMP and ninja (`pip install ninja`). "
                               "Use impl='torch' to run without it.")
        warnings.warn(f"memopt CPUAdamW: C++ kernel unavailable ({kernel_error()}); using the slower "
                      "torch._fused_adamw_ path. Install a C++ compiler and ninja to get the fast one.",
                      RuntimeWarning, stacklevel=3)
        return "torch"

    @property
    def state_nbytes(self) -> int:
        """Bytes held by exp_avg and exp_avg_sq."""
        return sum(t.numel() * t.element_size() for t in self.exp_avg + self.exp_avg_sq)

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor | None], lr: float | None = None,
             weight_decays: list[float] | None = None, out: list[torch.Tensor] | None = None,
             grad_scale: float = 1.0) -> None:
        """One AdamW step, in place on ``self.params``.

        ``grads[i]``: fp32 (or fp16/bf16, read as they are) CPU tensor with ``params[i]``'s numel, or ``None`` to leave that
        tensor (and its states) untouched this step. ``lr`` / ``weight_decays`` override the
        constructor's values for this step (``weight_decays``: one per param). ``out``: one
        fp16/bf16/fp32 CPU tensor per param (same numel, not the param itself) that receives the
        updated params (fp16/bf16 rounded to nearest even). ``grad_scale``: grads are divided by it before use (loss scale times
        clip factor); the C++ kernel leaves ``grads`` unchanged, the torch fallback unscales them
        in place, so treat them as consumed.
        """
        n = len(self.params)
        if len(grads) != n:
            raise ValueError(f"CPUAdamW.step: got {len(grads)} grads for {n} params")
        if weight_decays is None:
            weight_decays = [self.weight_decay] * n
        elif len(weight_decays) != n:
            raise ValueError(f"CPUAdamW.step: got {len(weight_decays)} weight_decays for {n} params")
        if out is not None and len(out) != n:
            raise ValueError(f"CPUAdamW.step: got {len(out)} out tensors for {n} params")
        lr = self.lr if lr is None else float(lr)
        step = self.step_count + 1
        idx = [i for i, g in enumerate(grads) if g is not None]
        if not idx:
            self.step_count = step
            return
        ps = [self.params[i] for i in idx]
        gs = [grads[i].contiguous() for i in idx]
        ms = [self.exp_avg[i] for i in idx]
        vs = [self.exp_avg_sq[i] for i in idx]
        wds = [float(weight_decays[i]) for i in idx]
        outs = [out[i] for i in idx] if out is not None else []
        b1, b2 = self.betas
        if self.impl == "cpp":
            self._kernel(ps, gs, ms, vs, outs, wds, lr, b1, b2, self.eps, step, float(grad_scale))
        else:
            _torch_adamw(ps, gs, ms, vs, outs, wds, lr, b1, b2, self.eps, step, float(grad_scale))
        self.step_count = step

    @torch.no_grad()
    def step_views(self, ps: list[torch.Tensor], gs: list[torch.Tensor], ms: list[torch.Tensor],
                   vs: list[torch.Tensor], weight_decays: list[float], out: list[torch.Tensor] | None = None,
                   lr: float | None = None, grad_scale: float = 1.0) -> None:
        """One step over caller-chosen contiguous views of ``params`` and of the states (the same split
        for all four lists, e.g. a flat shard cut where the weight decay changes), so decay, unscale,
        clip and the copy into ``out`` run in the one pass of ``step``. Advances ``step_count``."""
        lr = self.lr if lr is None else float(lr)
        step = self.step_count + 1
        b1, b2 = self.betas
        outs = list(out) if out else []
        if self.impl == "cpp":
            self._kernel(ps, gs, ms, vs, outs, [float(w) for w in weight_decays], lr, b1, b2, self.eps, step,
                         float(grad_scale))
        else:
            _torch_adamw(ps, gs, ms, vs, outs, [float(w) for w in weight_decays], lr, b1, b2, self.eps, step,
                         float(grad_scale))
        self.step_count = step

    def state_dict(self) -> dict:
        """Hyper-parameters, the step counter and references (not copies) to the state tensors."""
        return {
            "step": self.step_count,
            "lr": self.lr,
            "betas": self.betas,
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            "exp_avg": list(self.exp_avg),
            "exp_avg_sq": list(self.exp_avg_sq),
        }

    def load_state_dict(self, sd: dict) -> None:
        """Copy ``sd``'s states into this optimizer's own buffers (which keep their identity)."""
        for key in ("exp_avg", "exp_avg_sq"):
            src, dst = sd[key], getattr(self, key)
            if len(src) != len(dst):
                raise ValueError(f"CPUAdamW.load_state_dict: {key} has {len(src)} tensors, expected {len(dst)}")
            for i, (s, d) in enumerate(zip(src, dst)):
                if s.shape != d.shape:
                    raise ValueError(f"CPUAdamW.load_state_dict: {key}[{i}] has shape {tuple(s.shape)}, "
                                     f"expected {tuple(d.shape)}")
        with torch.no_grad():
            for key in ("exp_avg", "exp_avg_sq"):
                for s, d in zip(sd[key], getattr(self, key)):
                    d.copy_(s)
        self.step_count = int(sd["step"])
        self.lr = float(sd.get("lr", self.lr))
        self.betas = tuple(float(b) for b in sd.get("betas", self.betas))
        self.eps = float(sd.get("eps", self.eps))
        self.weight_decay = float(sd.get("weight_decay", self.weight_decay))


_GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _torch_adamw(ps, gs, ms, vs, outs, wds, lr, b1, b2, eps, step, grad_scale) -> None:
    """The pure-torch path: PyTorch's fused CPU AdamW kernel, one call per distinct weight decay."""
    for i, (p, g) in enumerate(zip(ps, gs)):
        if g.device.type != "cpu" or g.dtype not in _GRAD_DTYPES or g.numel() != p.numel():
            raise ValueError(f"CPUAdamW: grads[{i}] must be a float32/float16/bfloat16 CPU tensor with {p.numel()} "
                             f"elements, got {g.dtype} on {g.device} with {g.numel()}")
    gs = [g if g.dtype == torch.float32 else g.float() for g in gs]  # an fp32 copy (the kernel reads them as they are)
    for i, (o, p) in enumerate(zip(outs, ps)):
        if (o.dtype not in (torch.float16, torch.bfloat16, torch.float32) or o.device.type != "cpu"
                or o.numel() != p.numel() or o.data_ptr() == p.data_ptr()):
            raise ValueError(f"CPUAdamW: out[{i}] must be a float16/bfloat16/float32 CPU tensor with {p.numel()} "
                             "elements, other than the param itself")
    gs = [g.view_as(p) for g, p in zip(gs, ps)]
    steps = [torch.tensor(float(step))] * len(ps)  # only read by the kernel
    scale = torch.tensor(grad_scale) if grad_scale != 1.0 else None
    for wd in dict.fromkeys(wds):
        sel = [i for i, w in enumerate(wds) if w == wd]
        torch._fused_adamw_(
            [ps[i] for i in sel], [gs[i] for i in sel], [ms[i] for i in sel], [vs[i] for i in sel], [],
            [steps[i] for i in sel], lr=lr, beta1=b1, beta2=b2, weight_decay=wd, eps=eps, amsgrad=False,
            maximize=False, grad_scale=scale, found_inf=None,
        )
    for o, p in zip(outs, ps):
        o.copy_(p.view_as(o))
