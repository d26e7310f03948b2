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

This module runs the probes a profile needs and caches them for the process; each probe lives with its kind:
``block.py`` (the GPT block's products, attention, GELU and memory-bound ops; the element-wise rate),
``overhead.py`` (the host's cost of an op, plain and on DTensors), ``comm.py`` (gloo's collectives); ``saved.py``
keeps a reading in ``hardware.rates_file`` for plans in other processes.
"""
from __future__ import annotations

import sys

import torch

from memopt.planner.cpu_rates.block import block_rates, elementwise_gbps, probe_shape
from memopt.planner.cpu_rates.comm import gloo_allreduce, gloo_step_collectives
from memopt.planner.cpu_rates.overhead import dtensor_op_overhead_us, op_overhead_us

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
