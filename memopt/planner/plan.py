"""A plan: every simulated rank's peak bytes by category, the node's host total, the fit against a
hardware profile and an estimated step time (``trainer.mode=plan``, and the preflight of a run).

Fit rules (one node; every node of a data-parallel run holds the same):
  device   each rank's device total <= ``hardware.device_memory_gb``
  host     the node's ranks together (their host bytes + this process's runtime, i.e. the Python and
           PyTorch resident set each rank starts with) <= ``hardware.host_memory_gb``
  CPU-only (``device_is_host``): device and host are one RAM, so the node's ranks' device + host
           bytes + runtime <= host memory, and that is the only limit.

Step time = compute + memory-bound ops + per-op overhead + offload + communication + optimizer, not
overlapped (an upper estimate; the plan says which term dominates): FLOPs counted on the simulated step /
(peak FLOP/s of the compute dtype x ``compute_efficiency``, the fraction of the datasheet peak dense
training reaches); the bytes read and written by ops without a FLOP formula / ``memory_gbps``; the step's
dispatched ops x ``op_overhead_us`` (+ those on DTensors x ``dtensor_op_overhead_us``) (a pipeline stage's
three divided by 1 - its schedule's bubble: it idles through all of them); host<->device bytes / ``host_device_gbps``; collective
bus bytes / ``device_device_gbps`` + calls x ``collective_latency_us`` (per kind where the profile has a kind's
own rates); and the parameters whose AdamW
step runs on the host (``CPUAdamW``: ZeRO's cpu_offload partition, the chunk engine's host optimizer
groups; per rank x the node's ranks, which share its cores) / ``host_adam_gparams_s``. A term whose rate
the profile lacks is not estimated (the GPU profiles leave the memory and overhead terms to
``compute_efficiency``, measured on one H100 on 2026-11-26, ``experiments/planner/README.md``); on a
CPU (``hardware=auto``) plan mode and auto measure them (``planner/cpu_rates/``), and the node's ranks
share the CPU's peak and bandwidth (``ranks_share_device``) (``experiments/step_time/README.md``: the accuracy matrix).
"""
from __future__ import annotations

import resource
import time
from collections.abc import Callable
from dataclasses import asdict

from memopt.memory.hardware import device_runtime_bytes, tensor_budget_bytes
from memopt.memory.tracker import CATEGORIES

GiB = 2**30


def simulated_ranks(world: int, cfg=None) -> list[int]:
    """Rank 0 and the last rank: flat groups and chunk groups pad the last shard / group, so these two
    bound every rank (the others hold rank 0's bytes; the slow test checks it on a world of 4). A
    pipeline's stages hold different blocks (a middle stage of an uneven split may hold the most), so
    the first rank of every stage is simulated as well."""
    ranks = [0] if world == 1 else [0, world - 1]
    if cfg is not None and getattr(cfg.strategy, "pipeline", None) is not None:
        per = world // _pp(cfg, world)
        ranks = sorted(set(ranks) | set(range(0, world, per)))
    return ranks


def _pp(cfg, world: int) -> int:
    from memopt.parallel.dims import resolve_sizes

    return resolve_sizes(cfg.parallel, world)["pp"]


_RUNTIME: list[int] = []


def runtime_bytes() -> int:
    """This process's resident set when it first plans: what each rank holds before its first tensor
    (taken once, so the planner's own growth over many plans does not count)."""
    if not _RUNTIME:
        _RUNTIME.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return _RUNTIME[0]


def limits_of(hw, local_ranks: int, cfg=None) -> dict[str, int]:
    """Per-rank limits for ``simulate_rank`` (the preflight stops at the first op over them): the node's
    host shared evenly, except for a chunk-engine ``cfg``, whose ranks own unequal chunk counts and whose
    node host is the sum of its ranks (``node_rank_peaks``): one rank may take more than an even share
    while another takes less, so its limit is the node's host less every rank's runtime, and the plan's
    node sum judges the fit."""
    if cfg is not None and local_ranks > 1 and getattr(cfg.strategy, "chunk", None) is not None:
        host = int(hw.host_memory_gb * GiB) - local_ranks * runtime_bytes()
    else:
        host = int(hw.host_memory_gb * GiB / local_ranks) - runtime_bytes()
    if hw.device_is_host:
        return {"all": host}
    return {"device": tensor_budget_bytes(hw), "host": host}


def _placement(sims: list) -> dict:
    """Hybrid Adam's optimizer groups on the device after each simulated rank's warm-up (planner/placement.py)."""
    got = {str(s["rank"]): s.get("engine_metrics", {}).get("optim_chunks_on_device") for s in sims}
    most = {str(s["rank"]): s.get("engine_metrics", {}).get("optim_groups_device_max") for s in sims}
    if not any(v is not None for v in got.values()):
        return {}
    return {"optim_groups_on_device": got, **({"optim_groups_device_max": most} if any(v is not None for v in most.values()) else {})}


class SlowerThan(Exception):
    """A rank's own step is slower than ``make_plan``'s ``slower_than``: the plan's step (its slowest rank's) is
    too, so its other ranks are not simulated (the search cannot choose it)."""

    def __init__(self, step_s: float, rank: int, than: float):
        super().__init__(step_s, rank, than)  # its args, so that it pickles (a worker's answer)
        self.step_s, self.rank, self.than = step_s, rank, than

    def __str__(self) -> str:
        return f"rank {self.rank}'s step takes {self.step_s:.3g} s"


def make_plan(cfg, hw, limits: dict | None = None, slower_than: float | Callable[[], float | None] | None = None) -> dict:
    """Simulate the ranks that bound the world and judge the fit on ``hw`` (a resolved profile).
    ``slower_than`` (seconds, or a function read after each rank: the search's step to beat, which another process
    may lower meanwhile): raise ``SlowerThan`` once a simulated rank's step is slower, before the next."""
    from memopt import compose
    from memopt.parallel.dims import expected_world
    from memopt.planner.engines import wing
    from memopt.planner.extrapolate import simulate
    from memopt.planner.simulate import PlanOverflow

    t0 = time.perf_counter()
    world = expected_world(cfg)
    local = min(world, cfg.trainer.nproc_per_node)
    runtime = runtime_bytes()
    try:
        backend = "gloo" if hw.device_is_host else "nccl"
        rules = wing(cfg).rules  # an engine that does not run on fake tensors (DeepSpeed): its own rules
        sims, order = [], simulated_ranks(world, cfg)
        for r in order:
            # the depths the first rank checked serve the others (the blocks are the same on every rank)
            hint = {"windows": [sims[0]["window"]], "verify": False} if sims and sims[0].get("window") else \
                {"replay": sims[0]["replay"], "verify": False} if sims and sims[0].get("replay") else {}
            sims.append(rules(cfg, r, world, limits, backend, local, **hint) if rules
                        else simulate(cfg, r, world, limits, backend=backend, **hint))
            than = slower_than() if callable(slower_than) else slower_than
            if than is not None and r != order[-1]:
                own = step_time(cfg, hw, sims[-1], local)["total_s"]
                if own is not None and own > than:
                    raise SlowerThan(own, r, than)
    except PlanOverflow as e:
        if limits is not None or e.reason is None:
            raise
        return {"model": cfg.model.name, "params": compose.num_params(cfg), "engine": cfg.engine.name,
                "strategy": cfg.strategy.selected(), "world_size": world, "fits": False, "error": e.reason,
                "hardware": _hw_dict(hw), "plan_seconds": time.perf_counter() - t0}
    ranks = {str(s["rank"]): s["peaks"] for s in sims}
    worst = max(sims, key=lambda s: _total(s["peaks"]))
    dev_total = max(_dev(s["peaks"]) for s in sims)
    node_peaks = node_rank_peaks(cfg, sims, world, local)
    host_node = sum(_host(p) for p in node_peaks) + runtime * local
    if hw.device_is_host:
        node = sum(_dev(p) for p in node_peaks) + host_node
        fits = {"host": _fit(node, hw.host_memory_gb * GiB)}
    else:
        fits = {"device": _fit(dev_total + device_runtime_bytes(hw), hw.device_memory_gb * GiB),
                "host": _fit(host_node, hw.host_memory_gb * GiB)}
    # the step ends with its slowest rank (a pipeline's slowest stage); on a tie the rank of the highest peak
    times = [(step_time(cfg, hw, s, local), s) for s in [worst, *(s for s in sims if s is not worst)]]
    time_est, timed = max(times, key=lambda ts: ts[0]["total_s"] or 0.0)
    plan = {
        "model": cfg.model.name, "params": compose.num_params(cfg), "engine": cfg.engine.name,
        "strategy": cfg.strategy.selected(), "world_size": world, "nodes": max(1, world // local),
        "ranks_per_node": local, "micro_batch_size": cfg.trainer.micro_batch_size, "grad_accum": cfg.trainer.grad_accum,
        "hardware": _hw_dict(hw), "simulated_ranks": [s["rank"] for s in sims],
        "peak_bytes": ranks, "node_host_bytes": host_node, "runtime_bytes_per_rank": runtime,
        "device_runtime_bytes": device_runtime_bytes(hw),
        "fits": all(f["fits"] for f in fits.values()), "fit": fits,
        "overflow": _overflow(fits, worst["peaks"], hw),
        "rules": worst.get("rules", "the run's code on fake tensors"),
        "method": {str(s["rank"]): s.get("method", "exact") for s in sims},
        **_placement(sims),
        "traffic": timed["traffic"], "comm_per_step": timed.get("comm_per_step"), "flops_per_step": timed["flops"],
        "step_time": {**time_est, "rank": timed.get("rank")},
        "plan_seconds": time.perf_counter() - t0,
        "planner_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    return plan


def comm_seconds(hw, traffic: dict, per_kind: dict | None) -> float | None:
    """The step's collectives: per kind, calls x latency + bus bytes / bandwidth, with the kind's own rates
    where the profile has them (``collective_*_by_kind``), else ``collective_latency_us`` (0 when unset) and
    ``device_device_gbps``; None when the profile has no bandwidth. ``per_kind``: the simulation's
    ``comm_per_step`` ({"ops": {kind: {"count", "bus_bytes"}}}); without it, the traffic's totals."""
    lat, gbps = hw.collective_latency_us_by_kind or {}, hw.collective_gbps_by_kind or {}
    ops = (per_kind or {}).get("ops") or {"any": {"count": traffic.get("collectives", 0),
                                                  "bus_bytes": traffic.get("comm_bytes", 0)}}
    total = 0.0
    for kind, rec in ops.items():
        rate = gbps.get(kind, hw.device_device_gbps)
        if not rate:
            return None
        latency = lat.get(kind, hw.collective_latency_us) or 0.0
        total += rec.get("bus_bytes", 0) / (rate * 1e9) + rec.get("count", 0) * latency * 1e-6
    return total


def memory_seconds(traffic: dict, gbps: float, activation_gbps: float | None) -> float:
    """One rank's memory-bound ops: their bytes at ``gbps``, their GELU's share
    (``activation_bytes``) at ``activation_gbps`` where the profile has that rate."""
    total, act = traffic.get("op_bytes", 0), traffic.get("activation_bytes", 0) if activation_gbps else 0
    return (total - act) / (gbps * 1e9) + (act / (activation_gbps * 1e9) if act else 0.0)


def step_time(cfg, hw, sim: dict, ranks_per_node: int = 1) -> dict:
    """Seconds per optimizer step on ``hw``: compute, offload, communication and host-optimizer terms,
    which dominates. ``ranks_per_node``: the ranks whose host optimizer steps share the node's host."""
    from memopt.memory.hardware import check_hardware, peak_tflops_for
    from memopt.strategies.precision import Precision

    check_hardware(hw)
    precision = Precision.of(cfg)
    dtype = precision.name
    peak = peak_tflops_for(hw, dtype)
    eff = (hw.dtype_efficiency or {}).get(dtype, hw.compute_efficiency)
    att_eff = (hw.attention_efficiency or {}).get(dtype)
    # a run that keeps low-precision weights (the chunk engine's, bf16.params=bf16) its own rate where measured:
    # its norms and residual stream move half the bytes in about the same time as under autocast
    rates = hw.dtype_memory_gbps or {}
    weights_gbps = rates.get(f"{dtype}_weights") if precision.master_weights else None
    mem_gbps = weights_gbps or rates.get(dtype, hw.memory_gbps)
    tr = sim["traffic"]
    attention = tr.get("attention_flops", 0) if att_eff else 0  # else at the products' efficiency
    # FLOPs at the products' rate: fused attention at its own where measured
    flops_at_eff = sim["flops"] - attention + (attention * eff / att_eff if attention else 0)
    host_params = tr.get("host_optim_params", 0)
    rate = hw.host_adam_gparams_s
    # a CPU's ranks share its cores (each runs cores / ranks threads) and its memory bandwidth: each gets its
    # share of the measured peak and bandwidth; a GPU's rank has its device to itself
    share = ranks_per_node if hw.device_is_host or hw.ranks_share_device else 1
    overhead = (tr.get("ops", 0) * hw.op_overhead_us + tr.get("dtensor_ops", 0) * (hw.dtensor_op_overhead_us or 0.0)) \
        if hw.op_overhead_us is not None else None
    comm = comm_seconds(hw, tr, sim.get("comm_per_step"))
    offload_bytes = tr.get("offload_bytes", 0)
    if host_params and rate and hw.host_adam_step_copy_bytes:  # the optimizer term's measured rate holds that many
        offload_bytes -= min(tr.get("step_offload_bytes", 0), hw.host_adam_step_copy_bytes * host_params)
    terms = {
        "compute_s": flops_at_eff * share / (peak * eff * 1e12) if peak else None,
        "memory_s": memory_seconds(tr, mem_gbps, (hw.activation_gbps or {}).get(dtype)) * share if mem_gbps else None,
        "overhead_s": overhead * 1e-6 if overhead is not None else None,
        "offload_s": offload_bytes / (hw.host_device_gbps * 1e9) if hw.host_device_gbps else None,
        "comm_s": comm,
        "optimizer_s": 0.0 if not host_params else host_params * ranks_per_node / (rate * 1e9) if rate else None,
    }
    from memopt.engines.pipeline.schedules import planned_bubble

    bubble = planned_bubble(cfg)  # pipeline stages idle (pp - 1) of (m + pp - 1) micro-batch slots
    if bubble:  # a stage idles through all of its own work, not only its products
        for key in ("compute_s", "memory_s", "overhead_s"):
            if terms[key] is not None:
                terms[key] /= 1 - bubble
    known = {k: v for k, v in terms.items() if v is not None}
    total = sum(known.values()) if terms["compute_s"] is not None else None  # comm alone would rank wrongly
    tokens = cfg.trainer.micro_batch_size * cfg.trainer.grad_accum * cfg.model.seq_len
    return {**terms, "total_s": total, "dominant": max(known, key=known.get)[:-2] if known else None,
            "compute_dtype": dtype, "peak_tflops": peak, "compute_efficiency": eff,
            **({"attention_efficiency": att_eff, "attention_flops": attention} if attention else {}),
            "host_optim_params": host_params, "host_adam_gparams_s": rate, **({"bubble_fraction": bubble} if bubble else {}),
            "tokens_per_s_per_device": tokens / total if total else None}


def node_rank_peaks(cfg, sims: list[dict], world: int, local: int) -> list[dict]:
    """The peaks of each of the first node's ``local`` ranks. A rank not simulated holds what the worst
    simulated rank holds, except under the chunk engine, where a rank's bytes follow from its chunk
    layout: a rank whose layout (chunks, padding chunks, optimizer groups) equals a simulated rank's
    holds that rank's bytes. Why: a partial last communication group leaves the last ranks a padding
    chunk and one optimizer group fewer (gpt_10b at 139 blocks on 8 ranks: ranks 4-7 hold 2.3 GiB less
    host each), and counting every rank as the busiest overstated the node's host by that much."""
    worst = max(sims, key=lambda s: _total(s["peaks"]))
    by_rank = {s["rank"]: s["peaks"] for s in sims}
    if getattr(cfg.strategy, "pipeline", None) is not None:  # a rank holds what its stage's simulated rank holds
        per = world // _pp(cfg, world)
        return [by_rank.get(r, by_rank.get(r // per * per, worst["peaks"])) for r in range(local)]
    from memopt.planner.engines import wing

    rank_layouts = wing(cfg).rank_layouts
    if rank_layouts is None or world == 1:
        return [by_rank.get(r, worst["peaks"]) for r in range(local)]
    lays = rank_layouts(cfg, sorted(set(range(local)) | set(by_rank)), world)
    out = []
    for r in range(local):
        same = [by_rank[k] for k in by_rank if lays[k] == lays[r]]
        out.append(by_rank[r] if r in by_rank else max(same, key=_total) if same else worst["peaks"])
    return out


def _total(peaks: dict) -> int:
    return sum(v.get("total", 0) for v in peaks.values())


def _dev(peaks: dict) -> int:
    return peaks.get("device", {}).get("total", 0)


def _host(peaks: dict) -> int:
    return peaks.get("host", {}).get("total", 0)


def _fit(need: float, limit: float) -> dict:
    return {"bytes": int(need), "limit": int(limit), "margin": int(limit - need), "fits": need <= limit}


def _overflow(fits: dict, peaks: dict, hw) -> dict | None:
    """The first memory that overflows and its largest category (what the refusal names)."""
    for where, f in fits.items():
        if not f["fits"]:
            keys = ("device", "host") if hw.device_is_host else (where,)
            cats = {c: sum(peaks.get(k, {}).get(c, 0) for k in keys) for c in CATEGORIES}
            cat = max(cats, key=cats.get)
            return {"memory": where, "category": cat, "bytes": cats[cat], "over_by": -f["margin"]}
    return None


def _hw_dict(hw) -> dict:
    return {k: v for k, v in asdict(hw).items()}


def fmt_params(n: int) -> str:
    """A parameter count as a reader says it: 10.28B, or 0.84M for a test model (not 0.00B)."""
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def fmt(n: float | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def fit_bytes(plan: dict) -> dict[str, int]:
    """A plan's bytes against each of its limits: {"device": per rank, "host": per node} (the node's one total
    under "host" where the devices are the host)."""
    return {where: f["bytes"] for where, f in plan.get("fit", {}).items()}


def fit_peaks(fits: dict[str, int]) -> str:
    """``fit_bytes`` as the limits read them: with a device memory of its own the device's per rank and the
    host's per node apart, else the node's one total (one "peak" of the larger had printed the node's host
    bytes, 1.78 GiB, beside a device budget of 0.6 GiB)."""
    if "device" in fits:
        return f"peak {fmt(fits['device'])} device per rank" + (f", {fmt(fits['host'])} host per node" if "host" in fits else "")
    if "host" in fits:
        return f"peak {fmt(fits['host'])} per node (the devices are the host)"
    return "peak unknown"


def plan_table(plan: dict) -> str:
    """The printed plan: one line per simulated rank and memory, the fit, the step time."""
    cats = [c for c in CATEGORIES if any(p.get(d, {}).get(c) for p in plan["peak_bytes"].values() for d in p)]
    head = ["rank", "memory", *cats, "total"]
    rows = []
    for rank, devs in plan["peak_bytes"].items():
        for dev, v in devs.items():
            rows.append([rank, dev, *(fmt(v.get(c, 0)) for c in cats), fmt(v.get("total"))])
    w = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
    lines = ["  " + "  ".join(str(c).rjust(w[i]) for i, c in enumerate(r)) for r in [head] + rows]
    hw = plan["hardware"]
    lines.insert(0, f"memopt plan: {plan['model']} ({fmt_params(plan['params'])} params), "
                    f"{'+'.join(plan['strategy']) or 'plain'} ({plan['engine']}), {plan['world_size']} rank(s) "
                    f"({plan['ranks_per_node']} per node), micro-batch {plan['micro_batch_size']} x {plan['grad_accum']}, "
                    f"hardware {hw['name']}")
    lines.append(f"  host of one node ({plan['ranks_per_node']} rank(s), runtime {fmt(plan['runtime_bytes_per_rank'])} each "
                 f"included): {fmt(plan['node_host_bytes'])}")
    for where, f in plan["fit"].items():
        what = "device+host RAM of the node" if where == "host" and hw["device_is_host"] else where
        lib = plan.get("device_runtime_bytes", 0) if where == "device" else 0
        lines.append(f"  {what}: needs {fmt(f['bytes'])}"
                     + (f" ({fmt(lib)} of it cuBLAS's workspaces)" if lib else "") + f" of {fmt(f['limit'])}: "
                     + (f"fits, margin {fmt(f['margin'])}" if f["fits"] else f"DOES NOT FIT, over by {fmt(-f['margin'])}"))
    if plan["overflow"]:
        o = plan["overflow"]
        lines.append(f"  overflowing: {o['memory']}, largest category {o['category']} ({fmt(o['bytes'])})")
    st = plan["step_time"]
    if not st["peak_tflops"]:
        lines.append(f"  step time: not estimated (hardware {hw['name']} has no {st['compute_dtype']} peak FLOP/s)")
    elif st["total_s"]:
        eff = st.get("compute_efficiency", 1.0)
        peak = f"{st['compute_dtype']} peak {st['peak_tflops']:.3g} TFLOP/s" + (f" x efficiency {eff:.3g}" if eff != 1.0 else "")
        opt = st.get("optimizer_s", 0.0)
        untimed = "; host Adam not timed: no hardware.host_adam_gparams_s" if opt is None else ""
        host = "".join(f" + {name} {_s(st[key])}" for key, name in (("memory_s", "memory-bound ops"),
                       ("overhead_s", "per-op overhead")) if st.get(key) is not None)
        lines.append(f"  step time (estimate, terms not overlapped): {st['total_s']:.3g} s = compute "
                     f"{_s(st['compute_s'])}{host} + offload {_s(st['offload_s'])} + communication {_s(st['comm_s'])} + "
                     f"optimizer {_s(opt)}; {st['dominant']} dominates ({peak}{untimed})")
    methods = list(plan.get("method", {}).items())  # rank 0's says what was checked; the others reuse its depths
    how = methods[0][1] if methods else "exact"
    how += "".join(f"; rank {r}: {m}" for r, m in methods[1:] if m.split()[0] != how.split()[0])
    lines.append(f"  planned in {plan['plan_seconds']:.1f} s ({how}), planner peak RSS {fmt(plan['planner_peak_rss_bytes'])}")
    return "\n".join(lines)


def _s(v) -> str:
    return "-" if v is None else f"{v:.3g} s"
