"""The plan's step-time terms against hand-computed formulas: compute over peak x efficiency, the host
Adam term over the node's rate, the refusals of rates the estimate would divide by, the GPU-measured
profile values against the measurement they come from (the GPU check of 2026-11-26)."""
from __future__ import annotations

import pytest

from memopt.errors import ConfigError
from memopt.memory.hardware import HardwareConfig, check_hardware, peak_tflops_for
from memopt.planner.plan import step_time
from tests.conftest import typed

TINY = ["model=gpt_tiny", "model.n_layer=2", "model.seq_len=32", "trainer.micro_batch_size=1", "logger=none"]


def _hw(**kw) -> HardwareConfig:
    base = dict(name="t", device_memory_gb=1.0, host_memory_gb=64.0, peak_tflops={"fp32": 2.0}, host_device_gbps=4.0,
                device_device_gbps=8.0, devices_per_node=2, device_is_host=True)
    return HardwareConfig(**{**base, **kw})


def test_terms_are_the_formulas():
    """3e12 FLOPs at 2 TFLOP/s x 0.5 = 3 s; 2e9 B at 4 GB/s = 0.5 s; 1.6e9 bus bytes at 8 GB/s = 0.2 s;
    5e8 host updates per rank x 2 ranks sharing the node's 0.25e9 updates/s = 4 s."""
    cfg = typed(TINY)
    sim = {"flops": 3e12, "traffic": {"offload_bytes": 2e9, "comm_bytes": 1.6e9, "host_optim_params": 5e8}}
    st = step_time(cfg, _hw(compute_efficiency=0.5, host_adam_gparams_s=0.25, device_is_host=False), sim, ranks_per_node=2)
    assert st["compute_s"] == pytest.approx(3.0)
    assert st["offload_s"] == pytest.approx(0.5)
    assert st["comm_s"] == pytest.approx(0.2)
    assert st["optimizer_s"] == pytest.approx(4.0)
    assert st["total_s"] == pytest.approx(7.7)
    assert st["dominant"] == "optimizer"
    assert st["peak_tflops"] == 2.0  # the datasheet peak, reported as such
    assert st["tokens_per_s_per_device"] == pytest.approx(32 / 7.7)


def test_defaults_keep_the_old_estimate():
    """Efficiency 1.0 and no host rate: compute = FLOPs / peak; no host updates: optimizer 0, not unknown;
    host updates without a rate: not estimated (None), left out of the total as before."""
    cfg = typed(TINY)
    sim = {"flops": 4e12, "traffic": {"offload_bytes": 4e9}}
    st = step_time(cfg, _hw(), sim)
    assert (st["compute_s"], st["optimizer_s"], st["total_s"]) == (pytest.approx(2.0), 0.0, pytest.approx(3.0))
    st = step_time(cfg, _hw(), {**sim, "traffic": {"offload_bytes": 4e9, "host_optim_params": 10}})
    assert st["optimizer_s"] is None and st["total_s"] == pytest.approx(3.0)


@pytest.mark.parametrize("field,value", [("compute_efficiency", 0.0), ("compute_efficiency", -0.3),
                                         ("compute_efficiency", 1.5), ("host_adam_gparams_s", 0.0),
                                         ("host_adam_gparams_s", -2.0), ("host_adam_step_copy_bytes", -1.0)])
def test_refuses_a_rate_it_would_divide_by(field, value):
    with pytest.raises(ConfigError, match=f"hardware.{field}={value}"):
        check_hardware(_hw(**{field: value}))
    with pytest.raises(ConfigError, match=f"hardware.{field}"):
        step_time(typed(TINY), _hw(**{field: value}), {"flops": 1, "traffic": {}})
    with pytest.raises(ConfigError, match=f"hardware.{field}"):  # the run's config: refused before anything runs
        typed([*TINY, f"hardware.{field}={value}"])


def test_mfu_peak_ignores_the_efficiency():
    hw = _hw(peak_tflops={"bf16": 989.0}, compute_efficiency=0.35)
    assert peak_tflops_for(hw, "bf16") == 989.0


def test_zero_offload_plan_counts_each_ranks_partition():
    """zero2 + cpu_offload on 2 ranks: each rank's CPUAdamW steps its half of the P parameters; the node's
    two ranks share the host rate: optimizer = (P / 2) x 2 / rate. A plain plan has no host step."""
    from memopt import compose
    from memopt.planner.plan import make_plan, plan_table

    hw = _hw(compute_efficiency=0.5, host_adam_gparams_s=0.001)
    cfg = typed([*TINY, "+strategy=[zero2,cpu_offload]", "trainer.nproc_per_node=2"])
    p = compose.num_params(cfg)
    assert p % 2 == 0
    plan = make_plan(cfg, hw)
    st = plan["step_time"]
    assert st["host_optim_params"] == p // 2
    assert st["optimizer_s"] == pytest.approx(p / 2 * 2 / 1e6)
    assert st["compute_s"] == pytest.approx(plan["flops_per_step"] * 2 / (2.0 * 0.5 * 1e12))  # 2 ranks share the CPU
    assert st["total_s"] == pytest.approx(st["compute_s"] + st["offload_s"] + st["comm_s"] + st["optimizer_s"])
    assert f"+ optimizer {st['optimizer_s']:.3g} s; optimizer dominates (fp32 peak 2 TFLOP/s x efficiency 0.5)" \
        in plan_table(plan)
    plain = make_plan(typed(TINY), hw)["step_time"]
    assert plain["optimizer_s"] == 0.0 and plain["host_optim_params"] == 0


def test_chunk_engine_without_hybrid_adam_steps_every_parameter_on_the_host():
    """Every optimizer group stays on the host (no ``hybrid_adam``): the P parameters and the chunks'
    padding (stepped too), under twice P for this model."""
    from memopt import compose
    from memopt.planner.plan import make_plan

    cfg = typed([*TINY, "+strategy=[chunk]"])
    p = compose.num_params(cfg)
    plan = make_plan(cfg, _hw(host_adam_gparams_s=1.0))
    n = plan["step_time"]["host_optim_params"]
    assert p <= n < 2 * p
    assert plan["step_time"]["optimizer_s"] == pytest.approx(n / 1e9)


def test_gpu_profiles_carry_the_measured_values():
    """h100_sxm and h200, each from the GPU check on that GPU: efficiency = the plain bf16 step's planned FLOPs
    per step at the datasheet peak (0.017071 s) over its measured time without the tracker (H100 0.048568 s,
    H200 0.042612 s); host rate = 308,654,080 parameters / the zero2 + cpu_offload optimizer step on that
    machine's host (0.094077 s, 0.107944 s). Unmeasured GPUs and the CPU profile keep the datasheet (or
    measured) peak and no host rate."""
    for name, step, optim in (("h100_sxm", 0.048568, 0.094077), ("h200", 0.042612, 0.107944)):
        hw = typed([*TINY, f"hardware={name}"]).hardware
        assert hw.compute_efficiency == pytest.approx(0.017071 / step, abs=0.005)
        assert hw.host_adam_gparams_s == pytest.approx(308_654_080 / optim / 1e9, rel=0.005)
        assert hw.host_adam_step_copy_bytes == 4  # its fp32 parameters' upload (bf16 autocast keeps them fp32)
    for name in ("a100_80g", "v100_patrickstar", "auto"):
        hw = typed([*TINY, f"hardware={name}"]).hardware
        assert (hw.compute_efficiency, hw.host_adam_gparams_s, hw.host_adam_step_copy_bytes) == (1.0, None, 0)


def test_a_rate_measured_over_the_whole_step_holds_the_step_s_copies():
    """6e9 B between memories, 4e9 of them inside the optimizer step, 1e9 host-updated parameters, at 4 GB/s: 1.5 s;
    a rate that holds 2 B a parameter of copies leaves out 2e9 B (1.0 s), one that holds 8 B all 4e9 of the step's
    (0.5 s); 1.5 s again in a step with no host update."""
    cfg = typed(TINY)
    sim = {"flops": 0, "traffic": {"offload_bytes": 6e9, "step_offload_bytes": 4e9, "host_optim_params": 1e9}}
    hw = dict(host_adam_gparams_s=1.0, device_is_host=False)
    for per_param, seconds in ((0, 1.5), (2, 1.0), (8, 0.5)):
        assert step_time(cfg, _hw(**hw, host_adam_step_copy_bytes=per_param), sim)["offload_s"] == pytest.approx(seconds)
    no_host = {"flops": 0, "traffic": {"offload_bytes": 6e9, "step_offload_bytes": 4e9}}
    assert step_time(cfg, _hw(**hw, host_adam_step_copy_bytes=8), no_host)["offload_s"] == pytest.approx(1.5)


def test_the_simulated_step_counts_which_copies_the_optimizer_step_makes():
    """fp32, one rank. ZeRO-Offload: each parameter's fp32 gradient goes to the host in the backward (4 B), and the
    host kernel writes the parameters, so its step copies nothing. The chunk engine (every group on the host):
    each chunk element's fp32 gradient goes down and its parameter up inside the step (8 B)."""
    from memopt import compose
    from memopt.planner.simulate import simulate_rank

    zo = typed([*TINY, "+strategy=[zero2,cpu_offload]", "hardware=h200"])
    tr = simulate_rank(zo, 0, 1, backend="nccl")["traffic"]
    assert tr["offload_bytes"] == 4 * compose.num_params(zo) and tr.get("step_offload_bytes", 0) == 0
    chunk = typed([*TINY, "+strategy=[chunk]", "hardware=h200"])
    tr = simulate_rank(chunk, 0, 1, backend="nccl")["traffic"]
    assert tr["step_offload_bytes"] == tr["offload_bytes"] == 8 * tr["host_optim_params"] > 0


def test_cpu_terms_are_the_formulas():
    """A CPU's 2 ranks share its peak and its memory bandwidth: 1e12 FLOPs at 2 TFLOP/s / 2 ranks = 1 s;
    4e9 B of memory-bound ops at 16 GB/s / 2 = 0.5 s; 10,000 ops x 20 us + 1,000 on DTensors x 50 us more
    = 0.25 s; 1.6e9 bus bytes at 8 GB/s + 100 calls x 300 us = 0.23 s. A GPU profile's rank has its device
    to itself, and a profile without the new rates leaves their terms out (None), as before."""
    cfg = typed(TINY)
    sim = {"flops": 1e12, "traffic": {"op_bytes": 4e9, "ops": 10_000, "dtensor_ops": 1_000, "comm_bytes": 1.6e9,
                                      "collectives": 100}}
    hw = _hw(memory_gbps=16.0, op_overhead_us=20.0, dtensor_op_overhead_us=50.0, collective_latency_us=300.0)
    st = step_time(cfg, hw, sim, ranks_per_node=2)
    assert st["compute_s"] == pytest.approx(1.0)
    assert st["memory_s"] == pytest.approx(0.5)
    assert st["overhead_s"] == pytest.approx(0.25)
    assert st["comm_s"] == pytest.approx(0.23)
    assert st["total_s"] == pytest.approx(1.98)
    gpu = step_time(cfg, _hw(memory_gbps=16.0, device_is_host=False), sim, ranks_per_node=2)
    assert (gpu["compute_s"], gpu["memory_s"]) == (pytest.approx(0.5), pytest.approx(0.25))
    plain = step_time(cfg, _hw(), sim, ranks_per_node=2)
    assert plain["memory_s"] is None and plain["overhead_s"] is None and plain["comm_s"] == pytest.approx(0.2)


def test_collectives_at_their_kinds_rates():
    """Each kind of the simulated step's collectives at its own rates where the profile has them: 40
    reduce-scatters of 0.8e9 bus bytes in all at 0.5 GB/s + 2,000 us each = 1.68 s; 10 all-to-alls of 0.4e9 at
    the profile's 8 GB/s + 300 us = 0.053 s (no rates of their own); with a bad rate refused, naming it."""
    sim = {"flops": 1e12, "traffic": {"comm_bytes": 1.2e9, "collectives": 50},
           "comm_per_step": {"ops": {"reduce_scatter": {"count": 40, "bus_bytes": 0.8e9},
                                     "all_to_all": {"count": 10, "bus_bytes": 0.4e9}}}}
    hw = _hw(collective_latency_us=300.0, collective_latency_us_by_kind={"reduce_scatter": 2000.0},
             collective_gbps_by_kind={"reduce_scatter": 0.5})
    assert step_time(typed(TINY), hw, sim, ranks_per_node=2)["comm_s"] == pytest.approx(1.6 + 0.08 + 0.05 + 0.003)
    one_rate = _hw(collective_latency_us=300.0)  # the totals at one rate, as before the kinds
    assert step_time(typed(TINY), one_rate, sim, ranks_per_node=2)["comm_s"] == pytest.approx(1.2e9 / 8e9 + 50 * 300e-6)
    with pytest.raises(ConfigError, match="collective_gbps_by_kind.all_gather=0"):
        check_hardware(_hw(collective_gbps_by_kind={"all_gather": 0.0}))


def test_attention_and_bf16_memory_at_their_own_rates():
    """Fused attention's FLOPs at ``attention_efficiency``, the rest at ``compute_efficiency``, and a bf16
    run's memory-bound bytes at ``dtype_memory_gbps["bf16"]`` (``bf16_weights`` with bf16 weights): 0.8e12 FLOPs at 2 TFLOP/s x 0.5 / 2 ranks
    = 1.6 s plus 0.2e12 at 2 x 0.1 / 2 = 2 s; 4e9 B at 8 GB/s / 2 = 1 s (fp32's 16 GB/s would say 0.5).
    Without attention's rate (a GPU profile's), all 1e12 FLOPs at 0.5: 2 s."""
    sim = {"flops": 1e12, "traffic": {"attention_flops": 2e11, "op_bytes": 4e9}}
    rates = dict(compute_efficiency=0.5, attention_efficiency={"fp32": 0.1, "bf16": 0.1}, memory_gbps=16.0,
                 dtype_memory_gbps={"bf16": 8.0}, peak_tflops={"fp32": 2.0, "bf16": 2.0})
    st = step_time(typed(TINY), _hw(**rates), sim, ranks_per_node=2)
    assert (st["compute_s"], st["memory_s"]) == (pytest.approx(3.6), pytest.approx(0.5))
    bf16 = step_time(typed([*TINY, "+strategy=bf16"]), _hw(**rates), sim, ranks_per_node=2)
    assert (bf16["compute_s"], bf16["memory_s"]) == (pytest.approx(3.6), pytest.approx(1.0))
    # bf16 weights (the chunk engine's, bf16.params=bf16): their own rate where the profile has it, else bf16's
    weights = [*TINY, "+strategy=bf16", "strategy.bf16.params=bf16"]
    assert step_time(typed(weights), _hw(**rates), sim, ranks_per_node=2)["memory_s"] == pytest.approx(1.0)
    rates["dtype_memory_gbps"]["bf16_weights"] = 4.0
    assert step_time(typed(weights), _hw(**rates), sim, ranks_per_node=2)["memory_s"] == pytest.approx(2.0)
    assert step_time(typed([*TINY, "+strategy=bf16"]), _hw(**rates), sim, ranks_per_node=2)["memory_s"] == \
        pytest.approx(1.0)
    rates.pop("attention_efficiency")
    assert step_time(typed(TINY), _hw(**rates), sim, ranks_per_node=2)["compute_s"] == pytest.approx(2.0)


def test_activation_bytes_at_their_own_rate():
    """The activation functions' share of the memory-bound bytes at ``activation_gbps[dtype]``, the rest at the
    memory rate: of 4e9 B, 1e9 B of GELU at 2 GB/s and 3e9 B at 16 GB/s, on 2 ranks sharing the CPU: 1 + 0.375 s;
    without the activation rate (or for a dtype it lacks) all 4e9 B at 16 GB/s: 0.5 s; a rate of 0 refused."""
    sim = {"flops": 1e12, "traffic": {"op_bytes": 4e9, "activation_bytes": 1e9}}
    hw = _hw(memory_gbps=16.0, activation_gbps={"fp32": 2.0})
    assert step_time(typed(TINY), hw, sim, ranks_per_node=2)["memory_s"] == pytest.approx(1.375)
    assert step_time(typed(TINY), _hw(memory_gbps=16.0), sim, ranks_per_node=2)["memory_s"] == pytest.approx(0.5)
    bf16 = typed([*TINY, "+strategy=bf16"])
    assert step_time(bf16, hw, sim, ranks_per_node=2)["memory_s"] == pytest.approx(0.5)
    with pytest.raises(ConfigError, match="hardware.activation_gbps.bf16=0"):
        check_hardware(_hw(activation_gbps={"bf16": 0.0}))


def test_the_simulated_step_counts_attention_flops_by_the_formula():
    """The plan's attention FLOPs (what ``attention_efficiency`` divides) are the fused kernel's products,
    causal blocks counted: forward Q K^T and P V, 4 B T^2 C; backward the scores recomputed and four products
    (dV, dP, dQ, dK), 10 B T^2 C; per layer and micro-batch, with full checkpointing's recomputed forward once
    more; nothing else is counted as attention."""
    from memopt.planner.plan import make_plan

    for extra, per_layer in (([], 14), (["+strategy=[ckpt]"], 18)):
        cfg = typed([*TINY, "trainer.grad_accum=2", *extra])
        m = cfg.model
        got = make_plan(cfg, _hw(device_memory_gb=64.0))["traffic"]["attention_flops"]
        b, t, c = cfg.trainer.micro_batch_size, m.seq_len, m.d_model
        assert got == per_layer * m.n_layer * b * t * t * c * 2, extra


@pytest.mark.parametrize("field", ["op_overhead_us", "collective_latency_us", "memory_gbps"])
def test_refuses_a_negative_rate(field):
    with pytest.raises(ConfigError, match=f"hardware.{field}=-1"):
        check_hardware(_hw(**{field: -1.0}))


@pytest.mark.parametrize("strategy", ["[ckpt]", "[zero2]"])
def test_the_simulated_step_dispatches_the_ops_of_a_real_step(strategy):
    """The plan's op count and memory-bound bytes (what the overhead and memory terms multiply) against a
    real step of the same engine, counted by a dispatch mode over real tensors (checkpointing and two
    micro-batches on one rank: recomputation, accumulation and the optimizer's ops): within 5% (fake tensors
    dispatch a few ops of their own: 853 planned against 829 real, bytes 2% under), and the GELU's bytes, which
    ``activation_gbps`` prices, likewise. zero2 copies each gradient into its flat buffer: until 2026-11-29 the
    plan counted no copy_ within one memory (only those between memories, as offload), and a 2-rank zero2
    step's bytes were 1.49x the plan's (zero3 1.38x, the chunk engine 2.27x)."""
    import contextlib

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from memopt import engines
    from memopt.memory.tracker import MemoryTracker
    from memopt.parallel.dims import build_dims
    from memopt.planner.plan import make_plan
    from memopt.planner.simulate import _FLOPS, _moved_bytes

    cfg = typed([*TINY, f"+strategy={strategy}", "trainer.grad_accum=2", "trainer.save_checkpoint=false",
                 "trainer.eval_every=0"])
    planned = make_plan(cfg, _hw(device_memory_gb=64.0, device_is_host=True))["traffic"]

    class Count(TorchDispatchMode):
        ops, moved, gelu = 0, 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            Count.ops += 1
            if func._overloadpacket not in _FLOPS and not func.is_view and func.namespace not in ("c10d", "_c10d_functional"):
                Count.moved += _moved_bytes(args, kwargs, out)
                if func._overloadpacket in (torch.ops.aten.gelu, torch.ops.aten.gelu_backward):
                    Count.gelu += _moved_bytes(args, kwargs, out)
            return out

    tracker = MemoryTracker(torch.device("cpu"))
    with tracker:
        engine = engines.build_engine(cfg, torch.device("cpu"), build_dims(cfg.parallel, "cpu"), tracker)
        x = torch.randint(0, cfg.model.vocab_size, (cfg.trainer.micro_batch_size, cfg.model.seq_len))
        for step in range(2):  # the plan counts the second (steady) step
            with Count() if step == 1 else contextlib.nullcontext():
                for micro in range(2):
                    engine.forward_backward(x, x, micro, 2)
                engine.step(1e-3)
    assert planned["ops"] == pytest.approx(Count.ops, rel=0.05)
    assert planned["op_bytes"] == pytest.approx(Count.moved, rel=0.05)
    assert planned["activation_bytes"] == pytest.approx(Count.gelu, rel=0.05) and Count.gelu > 0


def test_cpu_probes_fill_only_what_the_profile_leaves_unset():
    """Plan mode's CPU profile (``cpu_rates.complete``): every step-time rate measured, positive; a profile's
    own value kept; a run's resolution measures none of them (it needs the peak for MFU only); a GPU's
    profile is left as it is."""
    import torch

    from memopt.memory.hardware import HardwareConfig, resolve_hardware
    from memopt.planner.cpu_rates import complete

    profile = HardwareConfig(op_overhead_us=7.0)
    tiny = typed(TINY).model  # the block probes at its shapes (gpt_small's by default: ~1 s a round here)
    hw = complete(profile, resolve_hardware(profile, torch.device("cpu")), torch.device("cpu"), tiny)
    assert hw.op_overhead_us == 7.0
    assert 0.05 <= hw.compute_efficiency <= 1.0
    if hw.peak_tflops["bf16"] >= hw.peak_tflops["fp32"]:  # bf16 products fast here: their own fraction
        assert 0.05 <= hw.dtype_efficiency["bf16"] <= 1.0 and hw.dtype_memory_gbps["bf16"] > 0
        assert hw.dtype_memory_gbps["bf16_weights"] > 0  # a block with bf16 weights, its own rate
        assert hw.activation_gbps["bf16"] > 0
    assert hw.activation_gbps["fp32"] > 0
    assert all(0 < e <= 1 for e in hw.attention_efficiency.values()) and "fp32" in hw.attention_efficiency
    for name in ("memory_gbps", "dtensor_op_overhead_us", "collective_latency_us", "host_adam_gparams_s",
                 "device_device_gbps"):
        assert getattr(hw, name) is not None and getattr(hw, name) >= 0, name
    assert hw.memory_gbps > 0 and hw.device_device_gbps > 0
    # every kind the steps call, between two processes; the all-reduce's rates stand for the kinds not probed
    assert set(hw.collective_gbps_by_kind) == set(hw.collective_latency_us_by_kind) == \
        {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"}
    assert all(v > 0 for v in hw.collective_gbps_by_kind.values())
    assert all(v >= 0 for v in hw.collective_latency_us_by_kind.values())
    assert hw.device_device_gbps == hw.collective_gbps_by_kind["all_reduce"]
    assert hw.ranks_share_device  # this CPU's ranks share its cores, with a device budget too
    run = resolve_hardware(HardwareConfig(), torch.device("cpu"))
    assert (run.memory_gbps, run.op_overhead_us, run.collective_latency_us) == (None, None, None)
    assert complete(HardwareConfig(), run, torch.device("cuda")) is run
    for name in ("h100_sxm", "a100_80g"):  # another machine's profile planned here: none of this CPU's rates
        profile = typed([*TINY, f"hardware={name}"]).hardware
        resolved = resolve_hardware(profile, torch.device("cpu"))
        assert complete(profile, resolved, torch.device("cpu")) is resolved


def _scripted_clock(monkeypatch, durations):
    """``time.perf_counter`` in the block probe advancing by the scripted call durations (start, stop pairs)."""
    import itertools

    from memopt.planner.cpu_rates import block

    now, steps = [0.0], iter(durations)
    ticks = itertools.count()

    def clock():
        if next(ticks) % 2:  # a stop: the call took its scripted time
            now[0] += next(steps)
        return now[0]

    monkeypatch.setattr(block.time, "perf_counter", clock)


def test_probe_rounds_go_on_until_each_best_is_met_again(monkeypatch):
    """Rounds still getting faster (a machine coming out of a busy phase) are not what the probe reads: the
    rounds go on past ``least`` until a later round meets each best within 5% (a slower round does not count);
    a time that keeps falling stops at ``most`` rounds, at its best."""
    from memopt.planner.cpu_rates.block import settled_best

    fast = [1.0, 2.0]
    rounds = [[1.3, 2.6], [1.15, 2.3], fast, [1.5, 3.0], [1.01, 2.02], [5.0, 5.0]]  # the 4th round slow
    _scripted_clock(monkeypatch, [t for r in rounds for t in r])
    calls = []
    fns = (lambda: calls.append(0), lambda: calls.append(1))
    assert settled_best(fns, least=3, most=8) == pytest.approx(fast)
    assert len(calls) == 2 * 5  # a slow round confirms nothing: the 5th meets the best again
    falling = [1.0 * 0.9 ** k for k in range(5)]  # each round 10% faster: never met again
    _scripted_clock(monkeypatch, falling + [0.0] * 4)
    assert settled_best((lambda: None,), least=3, most=5) == [pytest.approx(0.9 ** 4)]


def test_memory_rates_are_timed_directly(monkeypatch):
    """The activation's rate is its GELU's bytes over the GELU's own timing; the other memory-bound ops' rate is their
    bytes over the whole block timed with its products, attention and GELU skipped (their outputs zeros): that timing
    dispatches no op with a FLOP formula and no GELU, and moves the block's other bytes; both rates follow from those
    times alone, however fast the products are (efficiencies far above 1 reported as 1)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from memopt.planner.cpu_rates import block
    from memopt.planner.simulate import ACTIVATION_FNS, ATTENTION, op_work

    class Count(TorchDispatchMode):  # the reference count: FLOPs (attention apart), GELU's and other bytes
        def __init__(self):
            super().__init__()
            self.flops = self.att = self.moved = self.act = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            f, m = op_work(func, args, kwargs, out)
            if func._overloadpacket in ATTENTION:
                self.att += f
            else:
                self.flops += f
            if func._overloadpacket in ACTIVATION_FNS:
                self.act += m
            elif func not in (torch.ops.aten.empty_strided.default, torch.ops.aten.zero_.default):
                self.moved += m  # the zeros standing for the skipped ops apart
            return out

    # products, attention, GELU, the block without them, the same with bf16 weights (seconds)
    times, seen = [0.5, 0.1, 0.04, 0.3, 0.2], []

    def timed(fns, **kw):
        for fn in fns:
            with Count() as c:
                fn()
            seen.append(c)
        return list(times[:len(fns)])

    monkeypatch.setattr(block, "settled_best", timed)
    rates = block.block_rates(0.0, 1e6, (1, 16, 32, 2), bf16_weights_too=True)  # a 1e6 FLOP/s peak: far above 1
    mm, att, gbps, act_gbps, weights_gbps = rates
    products, attention, gelu, rest, rest_bf16 = seen
    assert mm == att == 1.0  # reported clamped to the peak
    assert rest.flops == rest.att == rest.act == 0 and products.flops > 0 and attention.att > 0
    assert gelu.act == 5 * 16 * 128 * 4  # 16 x 128 fp32 hidden: forward in + out, backward grad + in + out
    threads = torch.get_num_threads()
    assert act_gbps == pytest.approx(gelu.act / times[2] / 1e9 * threads)
    # bf16 weights: the same ops over half the bytes (5%: the first call creates the parameters' gradients)
    assert rest_bf16.flops == rest_bf16.act == 0 and rest_bf16.moved == pytest.approx(rest.moved / 2, rel=0.05)
    assert weights_gbps == pytest.approx(rest_bf16.moved / times[4] / 1e9 * threads, rel=0.05)
    assert block.block_rates(0.0, 1e6, (1, 16, 32, 2)).weights_memory_gbps is None  # not asked: not timed
    assert rest.moved > 0 and gbps == pytest.approx(rest.moved / times[3] / 1e9 * threads, rel=0.05)


def test_the_first_probe_of_a_process_says_so_and_each_probe_runs_once(monkeypatch, capsys):
    """The probes take 15-30 s before a plan or a search prints anything: the first one says so (once a process),
    and a probe asked again with the same arguments is not run again."""
    from memopt.planner import cpu_rates

    monkeypatch.setattr(cpu_rates, "_CACHE", {})
    assert [cpu_rates._cached(("a",), lambda: 1), cpu_rates._cached(("b",), lambda: 2),
            cpu_rates._cached(("a",), lambda: 3)] == [1, 2, 1]
    assert capsys.readouterr().err.count("measuring this CPU's step-time rates") == 1
