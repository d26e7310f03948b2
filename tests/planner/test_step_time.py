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
    st = step_time(cfg, _hw(compute_efficiency=0.5, host_adam_gparams_s=0.25), sim, ranks_per_node=2)
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
                                         ("host_adam_gparams_s", -2.0)])
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
    assert st["compute_s"] == pytest.approx(plan["flops_per_step"] / (2.0 * 0.5 * 1e12))
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
    """h100_sxm (and h200, the same GH100 die): efficiency = the plain bf16 step's planned FLOPs per step at
    the datasheet peak (0.017071 s) over its measured time without the tracker (0.048568 s); host rate =
    308,654,080 parameters / the zero2 + cpu_offload optimizer step (0.094077 s). Unmeasured GPUs and the
    CPU profile keep the datasheet (or measured) peak and no host rate."""
    for name in ("h100_sxm", "h200"):
        hw = typed([*TINY, f"hardware={name}"]).hardware
        assert hw.compute_efficiency == pytest.approx(0.017071 / 0.048568, abs=0.005)
        assert hw.host_adam_gparams_s == pytest.approx(308_654_080 / 0.094077 / 1e9, rel=0.005)
    for name in ("a100_80g", "v100_patrickstar", "auto"):
        hw = typed([*TINY, f"hardware={name}"]).hardware
        assert (hw.compute_efficiency, hw.host_adam_gparams_s) == (1.0, None)
