"""``hardware=auto`` on a CPU: a peak per dtype, never zero, and a plan that prints without one."""
from __future__ import annotations

import pytest
import torch

from memopt.memory import hardware


def test_a_loaded_machine_still_times_one_product(monkeypatch):
    """The warm-up used to eat the whole time budget on a loaded machine, leaving a peak of 0, which the
    step-time estimate and MFU then read as "unknown" (and the plan table crashed on)."""
    monkeypatch.setattr(hardware, "_MEASURED", {})
    assert hardware.measure_cpu_tflops(torch.float32, n=64, seconds=0.0) > 0


def test_each_dtype_is_measured_in_its_own_dtype(monkeypatch):
    """bf16 / fp16 matmuls are emulated on AVX2-only CPUs and fast on AVX-512-BF16 / AMX ones: the fp32
    peak says nothing about them. A profile's own value is kept."""
    seen = []

    def fake(dtype, n=512, seconds=0.2):
        seen.append(dtype)
        return {torch.float32: 1.0, torch.bfloat16: 0.01, torch.float16: 0.02}[dtype]

    monkeypatch.setattr(hardware, "measure_cpu_tflops", fake)
    monkeypatch.setattr(hardware, "measure_copy_gbps", lambda: 5.0)
    hw = hardware.resolve_hardware(hardware.HardwareConfig(peak_tflops={"fp16": 3.0}), torch.device("cpu"))
    assert hw.peak_tflops == {"fp16": 3.0, "fp32": 1.0, "bf16": 0.01}
    assert sorted(map(str, seen)) == ["torch.bfloat16", "torch.float32"]


def test_plan_table_without_a_compute_peak():
    from memopt.memory.hardware import HardwareConfig
    from memopt.planner.plan import make_plan, plan_table
    from tests.conftest import typed

    cfg = typed(["model=gpt_tiny", "model.n_layer=2", "model.seq_len=32", "trainer.micro_batch_size=1", "logger=none"])
    hw = HardwareConfig(name="nopeak", device_memory_gb=1, host_memory_gb=1, peak_tflops={}, host_device_gbps=1.0,
                        device_device_gbps=1.0, devices_per_node=1, device_is_host=True)
    plan = make_plan(cfg, hw)
    assert plan["step_time"]["compute_s"] is None
    assert "step time: not estimated (hardware nopeak has no fp32 peak FLOP/s)" in plan_table(plan)


def test_the_peak_is_one_threads_product_times_the_threads(monkeypatch):
    """A multi-threaded probe on a shared machine timed the scheduler (a slice per product: 4000x under
    the idle peak, MFU 97,000%); one thread's rate x the threads does not depend on another process.
    Reference: the same product timed here on one thread."""
    import time

    monkeypatch.setattr(hardware, "_MEASURED", {})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    best = min(_timed(a, b, time) for _ in range(20))
    torch.set_num_threads(threads)
    got = hardware.measure_cpu_tflops(torch.float32, n=256, seconds=0.1)
    assert torch.get_num_threads() == threads  # restored
    one_thread = 2 * 256**3 / best / 1e12
    assert 0.5 * threads * one_thread < got < 2 * threads * one_thread


def test_mfu_divides_by_the_peak_read_again_after_the_steps(monkeypatch, tmp_path):
    """A rank's probe at the start shares the cores with the other ranks' set-up (DeepSpeed compiling its ops:
    one gpt_small rank read half the peak and MFU 104.6%); the run's MFU divides by the higher of that reading
    and one after its steps. The start's reading is set here as a busy core gives it; reference: the 512-cube
    product timed here on one thread, x the threads."""
    import time

    from tests.conftest import train

    monkeypatch.setattr(hardware, "_MEASURED", {"torch.float32": 1e-6})
    s = train(["model=gpt_tiny", "model.n_layer=1", "model.seq_len=32", "trainer.micro_batch_size=2", "data=synthetic",
               "trainer.max_steps=2", "trainer.eval_every=0"], str(tmp_path))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    a @ b
    best = min(_timed(a, b, time) for _ in range(20))
    torch.set_num_threads(threads)
    one_thread = 2 * 512**3 / best / 1e12
    assert s["status"] == "ok" and 0.5 * threads * one_thread < s["peak_tflops_per_device"] < 2 * threads * one_thread
    assert 0 < s["mfu"] < 1, s["mfu"]


def test_a_profiles_peak_is_not_read_again(monkeypatch):
    """A profile that names the dtype's peak (another machine's, or the user's) is what MFU divides by, however
    far under this CPU's it is; the dtype it leaves out is measured."""
    def probe(*a, **k):
        raise AssertionError("probed")

    monkeypatch.setattr(hardware, "measure_cpu_tflops", probe)
    given = hardware.HardwareConfig(peak_tflops={"fp32": 1e-9})
    assert hardware.run_peak_tflops(given, given, "fp32", torch.device("cpu")) == 1e-9
    with pytest.raises(AssertionError, match="probed"):
        hardware.run_peak_tflops(given, given, "bf16", torch.device("cpu"))


def test_a_16_bit_runs_peak_on_a_cpu_is_at_least_its_fp32_peak(monkeypatch):
    """Where the 16-bit products are emulated (their probe far under fp32's), a 16-bit run's MFU divides by the
    CPU's fp32 peak at least: that run had read MFU 167.9% against the fp16 probe alone; where 16-bit products
    are the faster (AVX-512-BF16, AMX), their probe stands."""
    monkeypatch.setattr(hardware, "measure_cpu_tflops", lambda dtype, **k: {torch.float16: 0.003, torch.bfloat16: 2.0}[dtype])
    hw = hardware.HardwareConfig(peak_tflops={"fp32": 0.5, "fp16": 0.003, "bf16": 2.0})
    given = hardware.HardwareConfig()
    assert hardware.run_peak_tflops(hw, given, "fp16", torch.device("cpu")) == 0.5
    assert hardware.run_peak_tflops(hw, given, "bf16", torch.device("cpu")) == 2.0


def test_the_cached_peak_follows_the_threads_of_the_call(monkeypatch):
    """One process may run jobs at other thread counts: the cache keeps one thread's rate."""
    monkeypatch.setattr(hardware, "_MEASURED", {"torch.float32": 0.05})
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert hardware.measure_cpu_tflops(torch.float32) == pytest.approx(0.1)
        torch.set_num_threads(1)
        assert hardware.measure_cpu_tflops(torch.float32) == pytest.approx(0.05)
    finally:
        torch.set_num_threads(threads)


def _timed(a, b, time) -> float:
    t0 = time.perf_counter()
    a @ b
    return time.perf_counter() - t0


@pytest.mark.parametrize("override, field", [
    ("hardware.device_memory_gb=-1", "hardware.device_memory_gb=-1"),
    ("hardware.host_memory_gb=0", "hardware.host_memory_gb=0"),
    ("hardware.devices_per_node=0", "hardware.devices_per_node=0"),
    ("+hardware.peak_tflops.bf16=-5", "hardware.peak_tflops.bf16=-5"),
    ("hardware.device_runtime_mb=-1", "hardware.device_runtime_mb=-1"),
])
def test_a_nonsense_hardware_size_is_refused_as_a_field(override, field):
    """It was refused by the preflight as a 'share of device (-1.00 GiB)', after planning."""
    from memopt.errors import ConfigError
    from tests.conftest import typed

    with pytest.raises(ConfigError) as e:
        typed([override])
    assert field in str(e.value)


@pytest.mark.parametrize("capability, env, want", [
    ((9, 0), {}, 32 * 2**20),  # Hopper: 4096 KiB x 8
    ((10, 0), {}, 32 * 2**20),  # Blackwell
    ((8, 0), {}, 2 * 4096 * 1024 + 8 * 16 * 1024),  # Ampere: ":4096:2:16:8"
    ((7, 0), {}, 2 * 4096 * 1024 + 8 * 16 * 1024),
    ((9, 0), {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}, 8 * 16 * 1024),  # the deterministic setting torch documents
    ((8, 0), {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, 8 * 4096 * 1024),
])
def test_blas_workspace_follows_torchs_rule(capability, env, want):
    """torch's documented CUBLAS_WORKSPACE_CONFIG format (":SIZE_KiB:COUNT" terms) and its defaults per
    architecture, computed by hand."""
    assert hardware.blas_workspace_bytes(capability, env) == want


def test_gpu_profiles_state_two_workspaces_and_a_cpu_none():
    """Each GPU profile's device_runtime_mb is two workspaces of its architecture (forward thread, backward
    thread); a CPU resolves to none."""
    from tests.conftest import typed

    for name, capability in (("h100_sxm", (9, 0)), ("h200", (9, 0)), ("a100_80g", (8, 0)), ("rtx4090", (8, 9)),
                             ("v100_patrickstar", (7, 0))):
        hw = typed([f"hardware={name}"]).hardware
        assert hw.device_runtime_mb * 2**20 == 2 * hardware.blas_workspace_bytes(capability, {}), name
    cpu = hardware.resolve_hardware(typed(["hardware.device_memory_gb=1"]).hardware, torch.device("cpu"))
    assert cpu.device_runtime_mb == 0 and hardware.device_runtime_bytes(cpu) == 0
