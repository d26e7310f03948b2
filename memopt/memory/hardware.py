"""Hardware profiles: memory and peak throughput used for MFU and for planning.

A profile with unset fields describes the machine it runs on: ``resolve_hardware`` fills device
memory from CUDA (or the host's RAM on a CPU-only machine) and, on a CPU, the peak FLOP/s from a
short matmul measurement (an empirical peak, so CPU MFU reads "fraction of what this CPU's BLAS
reaches", which is the honest number to compare strategies with).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace

import torch


@dataclass
class HardwareConfig:
    """The ``hardware`` config group: one accelerator type and its host."""

    name: str = "auto"
    device_memory_gb: float | None = None  # memory per compute device (GiB); None: read it here
    host_memory_gb: float | None = None  # host RAM per node (GiB); None: read it here
    peak_tflops: dict[str, float] = field(default_factory=dict)  # per dtype: fp32/tf32/fp16/bf16
    host_device_gbps: float | None = None  # host<->device bandwidth (GB/s), for offload estimates
    device_device_gbps: float | None = None  # intra-node collective bandwidth (GB/s)
    devices_per_node: int | None = None  # accelerators per node; None: read it here (CUDA count, or 1 CPU)
    device_is_host: bool = False  # set for a CPU-only machine: the "device" is the host's RAM (one memory)
    # The fraction of the datasheet peak that dense training reaches end to end (the planner's counted
    # FLOPs per step / (peak x measured step time) of a plain run): the planner's compute term divides by
    # peak x compute_efficiency. MFU keeps dividing by the datasheet peak. 1.0 where nothing was measured;
    # on this CPU (hardware=auto) plan mode and auto measure it (planner/cpu_rates/). In (0, 1].
    compute_efficiency: float = 1.0
    # Per compute dtype, an efficiency that replaces ``compute_efficiency`` for it (a CPU's bf16 products reach a
    # different fraction of their 512-cube peak than its fp32 ones: planner/cpu_rates/ measures both).
    dtype_efficiency: dict[str, float] = field(default_factory=dict)
    # Per compute dtype, the fraction of the matmul peak fused attention reaches (its FLOPs counted as PyTorch's
    # flash formula counts them, the causal half included): the planner's compute term divides attention's FLOPs
    # by peak x this. Empty: attention at the products' efficiency (the GPU profiles: their compute_efficiency
    # stands for the whole step). A CPU's bf16 attention reached a fifth of the bf16 peak, its products three
    # fifths: planner/cpu_rates/ measures it at the run's sequence length.
    attention_efficiency: dict[str, float] = field(default_factory=dict)
    # The node's ranks share one compute device (a CPU's cores and memory bandwidth), so each plans with its
    # share of the peak and bandwidth. Set by the planner for this CPU's profile (planner/cpu_rates/), a
    # device budget or not; ``device_is_host`` implies it.
    ranks_share_device: bool = False
    # Billions of parameter updates per second of the node's host AdamW (``CPUAdamW``: ZeRO's cpu_offload,
    # the chunk engine's host optimizer groups), shared by the node's ranks: the planner's optimizer term is
    # (host-stepped parameters per rank x ranks per node) / this. None: not measured, the term is not estimated.
    host_adam_gparams_s: float | None = None
    # Bytes a host-updated parameter of host<->device copies that rate holds: it was measured over a whole
    # optimizer step, whose copies it then includes (the GPU profiles': ZeRO-Offload's bf16-autocast step,
    # its fp32 parameters' upload, 4 B each). The offload term leaves out up to this many bytes a parameter of
    # the copies the simulated optimizer step makes (the chunk engine moves its gradient and parameter chunks
    # there), which it would count twice. 0 on a CPU, whose rate is a probe of the AdamW pass alone.
    host_adam_step_copy_bytes: float = 0.0
    # The device memory's bandwidth for memory-bound ops (GB/s, bytes read + written): the planner's memory
    # term is the simulated step's bytes of ops without a FLOP formula (elementwise, norms, softmax, the
    # optimizer's math) / this. None: not estimated (the GPU profiles' compute_efficiency absorbs it).
    memory_gbps: float | None = None
    # Per compute dtype, a rate that replaces ``memory_gbps`` for its runs (in bf16 a CPU's casts and LayerNorm
    # move half the bytes in about the same time per element: planner/cpu_rates/ measures both), and
    # ``<dtype>_weights`` for runs that keep their weights in it (the chunk engine's, ``bf16.params=bf16``: the
    # residual stream and norms in bf16 too, 0.71-0.76 of the autocast block's rate on the AMX CPU).
    dtype_memory_gbps: dict[str, float] = field(default_factory=dict)
    # Per compute dtype, the rate of the activation function's bytes (GELU and its backward: ``op_bytes``'
    # ``activation_bytes``), which the memory term then divides by this instead: on a CPU thread GELU (tanh) moves
    # 1.5-5 GB/s where an add or a cast moves 20-45, so one rate mispriced steps whose bytes mix them differently
    # (bf16 DDP's autocast casts against the chunk engine's bf16 GELU). Empty: those bytes at the memory rate.
    activation_gbps: dict[str, float] = field(default_factory=dict)
    # Host time per dispatched op (microseconds): Python, autograd, the dispatcher and the memory tracker,
    # paid by every op of the step whatever its size (what makes gpt_tiny's step 7x its FLOPs on a CPU), and
    # per op on DTensors (tensor parallelism's sharding propagation). None: not estimated.
    op_overhead_us: float | None = None
    dtensor_op_overhead_us: float | None = None
    # Fixed cost of one collective call (microseconds), beside its bytes / device_device_gbps. None: not estimated.
    collective_latency_us: float | None = None
    # Per collective kind (all_reduce, all_gather, reduce_scatter, all_to_all, ...), a latency (microseconds) and
    # a bus bandwidth (GB/s) that replace the two above for its calls: gloo's reduce-scatter costs about twice
    # its all-reduce per bus byte on a CPU, its all-gather more at large buffers (planner/cpu_rates/ measures
    # them between two processes). Kinds not named take the two fields above.
    collective_latency_us_by_kind: dict[str, float] = field(default_factory=dict)
    collective_gbps_by_kind: dict[str, float] = field(default_factory=dict)
    # Device memory (MiB per rank) that CUDA's libraries take from the caching allocator beside the tensors the
    # tracker and the planner count: cuBLAS's workspaces, one per (thread, stream) that issues products: the
    # forward's thread and autograd's backward thread (cuBLASLt shares them, torch's default). The plan's
    # device need and the run's device budget include it. None: derived where the run is (``blas_workspace_bytes``
    # x 2 on a GPU, 0 on a CPU); the GPU profiles state torch's default for their architecture.
    device_runtime_mb: float | None = None
    # A JSON file that keeps this CPU's measured step-time rates (``planner/cpu_rates/saved.py``): the first plan
    # or search that names it measures and writes them, later ones in other processes read them, so that several
    # engines' searches rank by one reading of the machine. None: each process measures its own.
    rates_file: str | None = None


def check_hardware(hw: HardwareConfig) -> None:
    """Refuse sizes and rates the plan would use (naming the field) before anything is planned or run."""
    from memopt.errors import ConfigError

    for name in ("device_memory_gb", "host_memory_gb", "host_device_gbps", "device_device_gbps", "memory_gbps"):
        value = getattr(hw, name)
        if value is not None and not value > 0:
            raise ConfigError(f"hardware.{name}={value} must be > 0, or null to read it from this machine")
    if hw.devices_per_node is not None and hw.devices_per_node < 1:
        raise ConfigError(f"hardware.devices_per_node={hw.devices_per_node} must be >= 1, or null to read it here")
    bad = {k: v for k, v in (hw.peak_tflops or {}).items() if not v > 0}
    if bad:
        k, v = next(iter(bad.items()))
        raise ConfigError(f"hardware.peak_tflops.{k}={v} must be > 0 (TFLOP/s); leave the dtype out to measure it here")

    for name, value in (hw.attention_efficiency or {}).items():
        if not 0 < value <= 1:
            raise ConfigError(f"hardware.attention_efficiency.{name}={value} must be in (0, 1]")
    for group in ("dtype_memory_gbps", "activation_gbps"):
        for name, value in (getattr(hw, group) or {}).items():
            if not value > 0:
                raise ConfigError(f"hardware.{group}.{name}={value} must be > 0 (GB/s)")
    for name, value in (hw.dtype_efficiency or {}).items():
        if not 0 < value <= 1:
            raise ConfigError(f"hardware.dtype_efficiency.{name}={value} must be in (0, 1]")
    eff = hw.compute_efficiency
    if eff is None or not 0 < eff <= 1:
        raise ConfigError(f"hardware.compute_efficiency={eff} must be in (0, 1]: the fraction of the datasheet peak "
                          "FLOP/s that dense training reaches (1.0 where it was not measured)")
    if hw.device_runtime_mb is not None and not hw.device_runtime_mb >= 0:
        raise ConfigError(f"hardware.device_runtime_mb={hw.device_runtime_mb} must be >= 0 (MiB the CUDA libraries "
                          "take beside the tensors, e.g. 64 on an H100), or null to derive it here")
    for name in ("op_overhead_us", "dtensor_op_overhead_us", "collective_latency_us"):
        value = getattr(hw, name)
        if value is not None and not value >= 0:
            raise ConfigError(f"hardware.{name}={value} must be >= 0 (microseconds), or null when it was not measured")
    for name, value in (hw.collective_latency_us_by_kind or {}).items():
        if not value >= 0:
            raise ConfigError(f"hardware.collective_latency_us_by_kind.{name}={value} must be >= 0 (microseconds)")
    for name, value in (hw.collective_gbps_by_kind or {}).items():
        if not value > 0:
            raise ConfigError(f"hardware.collective_gbps_by_kind.{name}={value} must be > 0 (GB/s of bus bytes)")
    if not hw.host_adam_step_copy_bytes >= 0:
        raise ConfigError(f"hardware.host_adam_step_copy_bytes={hw.host_adam_step_copy_bytes} must be >= 0 (bytes a "
                          "parameter of copies inside the measured host step; 0: none)")
    rate = hw.host_adam_gparams_s
    if rate is not None and not rate > 0:
        raise ConfigError(f"hardware.host_adam_gparams_s={rate} must be > 0 (billions of parameter updates per second "
                          "of the node's host Adam), or null when it was not measured")


def cpu_info() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (Linux; empty where there is none)."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor is enough
                k, _, v = line.partition(":")
                info.setdefault(k.strip(), v.strip())
    except OSError:
        pass
    return info


def cpuinfo_field(*names: str) -> str | None:
    """The first processor's value of the first of ``names`` /proc/cpuinfo lists; None where there is none.
    What tells one CPU from another where a build or a reading must not be reused on another."""
    info = cpu_info()
    return next((info[n] for n in names if n in info), None)


def host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # pragma: no cover - non-POSIX
        return 0


_MEASURED: dict[str, float] = {}


def measure_cpu_tflops(dtype: torch.dtype = torch.float32, n: int = 512, seconds: float = 0.2,
                       again: bool = False) -> float:
    """Peak square-matmul throughput of this CPU in TFLOP/s for ``dtype``: the best product timed on one
    thread, times torch's intra-op threads (cached per dtype for the process). One thread because a
    multi-threaded product on a shared machine waits for its slowest thread: with one of 2 cores busy
    elsewhere, every product took a scheduler slice (~25 ms), a 64-cube fp32 probe read 1.9e-5 TFLOP/s
    (4000x under the idle 0.078) and MFU read 97,000%; a peak is per-core throughput x cores, as a
    datasheet's. The size starts small and doubles up to ``n`` while one product stays under a tenth
    of ``seconds``: a CPU without bf16/fp16 matrix units emulates them hundreds of times slower than
    fp32 (a 512-cube bf16 product can take seconds there), so that probe stays short. The probe times a
    second product at each size: the first builds the kernel, and timing it once stopped the bf16 probe at
    a 64-cube (0.085 against fp32's 0.215 TFLOP/s on an AVX-512-BF16 CPU, where bf16 is the faster), which
    ranked every bf16 candidate of +strategy=auto last. At least one
    product is timed after the warm-up, however loaded the machine (a zero peak would read as
    "unknown"). The cache holds one thread's rate, multiplied by the threads of the call (jobs of one process
    may set other thread counts). ``again``: measure anew and keep the higher of the one-thread readings
    (something else on the core lowers a reading; nothing raises it above what this core reached before)."""
    key = str(dtype)
    threads = torch.get_num_threads()
    if key in _MEASURED and not again:
        return _MEASURED[key] * threads
    torch.set_num_threads(1)
    try:
        size = 64
        while True:
            a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
            a @ b  # warm-up: the first product of a dtype and size builds its kernel (oneDNN), tens of ms
            t0 = time.perf_counter()
            a @ b  # the size probe
            took = time.perf_counter() - t0
            if size >= n or took > seconds / 10:
                break
            size *= 2
        best, t_end = 0.0, time.perf_counter() + seconds
        while True:
            t0 = time.perf_counter()
            a @ b
            best = max(best, 2 * size**3 / max(time.perf_counter() - t0, 1e-9))
            if time.perf_counter() >= t_end:
                break
    finally:
        torch.set_num_threads(threads)
    _MEASURED[key] = max(_MEASURED.get(key, 0.0), best / 1e12)
    return _MEASURED[key] * threads


# the matmul probe per compute dtype: (dtype, seconds); 16-bit short, as AVX2-only CPUs emulate it slowly
CPU_PROBES = {"fp32": (torch.float32, 0.2), "bf16": (torch.bfloat16, 0.05), "fp16": (torch.float16, 0.05)}


def run_peak_tflops(hw: HardwareConfig, given: HardwareConfig, dtype_name: str, device: torch.device) -> float | None:
    """The peak a run's MFU divides by, read at the run's end: on a CPU whose profile ``given`` names no peak
    for the dtype, the matmul probe again after the steps, the higher of it and the start's reading. At the
    start the probe shares the cores with the other ranks' set-up (DeepSpeed compiling its ops): gpt_small
    fp32 on 2 ranks read 0.046 TFLOP/s in one DeepSpeed rank where every other run read 0.087-0.095, and MFU
    read 104.6%.

    A 16-bit run's peak is at least the CPU's fp32 one: where its 16-bit products are emulated, the run's fp32
    work (its ops outside autocast's list) and kernels the probe's shape does not reach outran the 16-bit probe
    (fp16 gpt_tiny on 2 ranks of an AVX-512 CPU without AVX-512-FP16: MFU 167.9%)."""
    peak = peak_tflops_for(hw, dtype_name)
    if device.type != "cpu" or dtype_name in (given.peak_tflops or {}) or dtype_name not in CPU_PROBES:
        return peak
    dtype, seconds = CPU_PROBES[dtype_name]
    peak = max(peak or 0.0, measure_cpu_tflops(dtype, seconds=seconds, again=True))
    return max(peak, peak_tflops_for(hw, "fp32") or 0.0) if dtype_name != "fp32" else peak


def resolve_hardware(hw: HardwareConfig, device: torch.device) -> HardwareConfig:
    """Fill the unset fields from the machine at hand (the planner's step-time rates of a CPU are
    measured by ``planner/cpu_rates/``, for plan mode and auto only)."""
    dev_mem, peaks = hw.device_memory_gb, dict(hw.peak_tflops)
    if dev_mem is None:
        if device.type == "cuda":
            dev_mem = torch.cuda.get_device_properties(device).total_memory / 2**30
        else:
            dev_mem = host_memory_bytes() / 2**30
    if device.type == "cpu":
        # measured per dtype: bf16 / fp16 matmuls are faster than fp32 on CPUs with AVX-512-BF16 / AMX
        # and emulated (hundreds of times slower) on AVX2-only ones; a profile's own values win
        for name, (dt, secs) in CPU_PROBES.items():
            if name not in peaks:
                peaks[name] = measure_cpu_tflops(dt, seconds=secs)
    host = hw.host_memory_gb if hw.host_memory_gb is not None else host_memory_bytes() / 2**30
    per_node = hw.devices_per_node or (torch.cuda.device_count() if device.type == "cuda" else 1)
    unified = hw.device_is_host or (device.type == "cpu" and hw.device_memory_gb is None)
    h2d, d2d = hw.host_device_gbps, hw.device_device_gbps
    if device.type == "cpu" and (h2d is None or d2d is None):
        copy = measure_copy_gbps()  # offload is a memory copy here (the planner measures gloo: planner/cpu_rates/)
        h2d, d2d = h2d or copy, d2d or copy
    runtime = hw.device_runtime_mb
    if runtime is None:
        runtime = 0.0 if device.type != "cuda" else \
            BLAS_WORKSPACES * blas_workspace_bytes(torch.cuda.get_device_capability(device)) / 2**20
    return replace(hw, device_memory_gb=dev_mem, host_memory_gb=host, peak_tflops=peaks, devices_per_node=per_node,
                   device_is_host=unified, host_device_gbps=h2d, device_device_gbps=d2d, device_runtime_mb=runtime)


def device_runtime_bytes(hw: HardwareConfig) -> int:
    """What the device's libraries hold beside the tracked tensors (cuBLAS's workspaces): part of the plan's
    device need and of the run's device budget. 0 where the device is the host (a CPU run)."""
    if hw.device_is_host:
        return 0
    return int((hw.device_runtime_mb or 0) * 2**20)


def tensor_budget_bytes(hw: HardwareConfig) -> int:
    """The device memory a rank's tensors may take: the device's less its libraries' workspaces (the plan's
    preflight limit and a run's device budget alike)."""
    return int(hw.device_memory_gb * 2**30) - device_runtime_bytes(hw)


# A training step issues products from two threads: the forward's (and the optimizer's) and autograd's device
# thread for the backward (the recomputed forward of checkpointing included), each with its own cuBLAS handle,
# and torch keeps one workspace per (handle, stream). Measured on an H100 (experiments/planner/README.md, sixth
# GPU run): the caching allocator's peak was 65.5-69.0 MiB above the tracker's in all five compositions.
BLAS_WORKSPACES = 2


def blas_workspace_bytes(capability: tuple[int, int], env: dict | None = None) -> int:
    """torch's cuBLAS workspace per (handle, stream): ``CUBLAS_WORKSPACE_CONFIG`` (":SIZE_KiB:COUNT" terms,
    summed as SIZE x COUNT) if set, else 32 MiB on Hopper and Blackwell (compute capability 9, 10, 12) and
    ":4096:2:16:8" (8 MiB + 128 KiB) before them. cuBLASLt uses the same workspace (torch's default)."""
    import re

    env = os.environ if env is None else env
    config = env.get("CUBLAS_WORKSPACE_CONFIG")
    if config:
        terms = re.findall(r":([0-9]+):([0-9]+)", config)
        if terms:
            return sum(int(size) * 1024 * int(count) for size, count in terms)
    if capability[0] in (9, 10, 12):
        return 4096 * 8 * 1024
    return 4096 * 1024 * 2 + 16 * 1024 * 8


def measure_copy_gbps(nbytes: int = 64 * 2**20, seconds: float = 0.1) -> float:
    """Best observed memory-copy bandwidth of this machine in GB/s (cached for the process)."""
    if "copy" in _MEASURED:
        return _MEASURED["copy"]
    a = torch.empty(nbytes, dtype=torch.uint8)
    b = torch.empty_like(a)
    b.copy_(a)
    best, t_end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        b.copy_(a)
        best = max(best, nbytes / (time.perf_counter() - t0))
    _MEASURED["copy"] = best / 1e9
    return _MEASURED["copy"]


def peak_tflops_for(hw: HardwareConfig, dtype_name: str) -> float | None:
    """Peak TFLOP/s for a compute dtype; fp32 falls back to tf32 on GPUs that list only it."""
    return hw.peak_tflops.get(dtype_name) or (hw.peak_tflops.get("tf32") if dtype_name == "fp32" else None)
