"""``hardware=auto`` on a CPU: a peak per dtype, never zero, and a plan that prints without one."""
from __future__ import annotations

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
