"""Preflight refusals: named memory and category, a suggestion, nothing model-sized allocated."""
from __future__ import annotations

import pytest

from tests.conftest import typed


def hw(host_gb: float, device_gb: float | None = None):
    from memopt.memory.hardware import HardwareConfig

    return HardwareConfig(name="small", device_memory_gb=device_gb or host_gb, host_memory_gb=host_gb, peak_tflops={"fp32": 1.0},
                          host_device_gbps=1.0, device_device_gbps=1.0, devices_per_node=1, device_is_host=device_gb is None)


def test_refuses_when_params_overflow_and_names_the_category():
    from memopt.planner.plan import runtime_bytes
    from memopt.planner.preflight import PreflightRefusal, preflight

    cfg = typed(["model=gpt_tiny", "model.seq_len=64", "trainer.micro_batch_size=2", "logger=none"])
    # RAM that holds the runtime plus 1 MiB: gpt_tiny's 3.2 MiB of fp32 parameters go over while being created
    small = hw((runtime_bytes() + 2**20) / 2**30)
    with pytest.raises(PreflightRefusal) as e:
        preflight(cfg, small)
    msg = str(e.value)
    assert "does not fit" in msg and "params holds" in msg and "trainer.preflight=false" in msg, msg
    assert "no composition fits" in msg  # 14 B/param of 0.8M params is over 1 MiB


def test_a_device_budget_under_every_candidate_names_one_that_works_and_it_holds_in_a_run(tmp_path):
    """A device budget no candidate meets names the least the most frugal composition needs; a run of that
    composition under that budget stays under it (the tracker ends a run oom where it crosses). And the category
    named where a run goes over is the one the run's tracker names: a forward's activations, not the model states
    that happened to be larger while the forward's own bytes were uncounted (it said optim for an activation
    overflow)."""
    import re

    from memopt.api import run_job
    from memopt.planner.preflight import PreflightRefusal, preflight
    from memopt.planner.plan import GiB

    base = ["model=gpt_tiny", "model.seq_len=64", "trainer.micro_batch_size=16", "logger=none", "data=synthetic",
            "trainer.eval_every=0", "trainer.save_checkpoint=false", "trainer.device=cpu"]
    with pytest.raises(PreflightRefusal, match="while activations holds"):
        preflight(typed(base), hw(64.0, 20 / 1024))  # 20 MiB: 12.8 of model states, then the forward goes over
    with pytest.raises(PreflightRefusal) as e:
        preflight(typed(base), hw(64.0, 1 / 1024))
    m = re.search(r"on the device for \+strategy=\[(.*?)\] trainer.micro_batch_size=(\d+), so hardware.device_memory_gb=([\d.]+)",
                  str(e.value))
    assert m, str(e.value)
    budget = float(m.group(3))
    s = run_job([*base, f"+strategy=[{m.group(1)}]", f"trainer.micro_batch_size={m.group(2)}", "trainer.max_steps=2",
                 f"hardware.device_memory_gb={budget}"], str(tmp_path / "run"))
    assert s["status"] == "ok" and s["peak_bytes"]["0"]["cpu"]["total"] <= budget * GiB


def test_trivially_fitting_run_is_not_simulated():
    from memopt.planner.preflight import preflight

    cfg = typed(["model=gpt_tiny", "logger=none"])
    assert preflight(cfg, hw(64.0)) is None


@pytest.mark.slow  # 8 s on an AVX2 CPU; gpt_10b's preflight refusal through the CLI stays in the default suite (test_search.py)
def test_engine_refusal_at_build_is_a_preflight_refusal():
    """The chunk engine refuses a model whose chunks exceed its host budget while building (a ConfigError,
    before any chunk is allocated): the preflight turns it into a refusal with the engine's reason."""
    from memopt.planner.preflight import PreflightRefusal, preflight

    cfg = typed(["model=gpt_10b", "+strategy=hybrid_adam", "logger=none", "hardware.host_memory_gb=24",
                 "hardware.device_memory_gb=null"])
    with pytest.raises(PreflightRefusal) as e:
        preflight(cfg, hw(24.0))
    msg = str(e.value)
    assert "refused by the engine" in msg and "host budget" in msg and "no composition fits" in msg, msg


def test_chunk_engine_host_refusal_names_the_planned_models_bytes():
    """A deep model is planned from a shallow recording; the chunk engine's host-budget refusal must quote
    the planned model's need (14 B per parameter: fp16 weights, whose gradients are written over them, and
    fp32 master, momentum and variance), not the recording's (it quoted 0.02 GiB of 0.07 here)."""
    import re

    from memopt import compose
    from memopt.errors import ConfigError
    from memopt.memory.hardware import HardwareConfig
    from memopt.planner.plan import make_plan

    cfg = typed(["+strategy=hybrid_adam", "model=gpt_tiny", "model.n_layer=24", "hardware.host_memory_gb=0.001", "logger=none"])
    hw = HardwareConfig(name="t", device_memory_gb=1.0, host_memory_gb=0.001, peak_tflops={"fp32": 1.0}, host_device_gbps=1.0,
                        device_device_gbps=1.0, devices_per_node=1, device_is_host=True)
    with pytest.raises(ConfigError, match="chunks need up to") as e:
        make_plan(cfg, hw)
    need = float(re.search(r"need up to ([0-9.]+) GiB", str(e.value)).group(1))
    want = 14 * compose.num_params(cfg) / 2**30
    assert want - 0.005 <= need <= 1.25 * want, (need, want)


def test_chunk_budget_below_a_traced_moment_is_refused_before_the_run():
    """The chunk engine's own device budget is a limit the hardware bound does not see: a run that trivially
    fits the hardware is planned anyway, and a budget below what a traced moment needs (gpt_tiny's non-model
    peak at this shape is ~9.7 MiB, above 5 MiB) is refused with the engine's reason, where the run used to
    end `oom` after allocating. A budget that holds every moment passes with its plan."""
    from memopt.planner.preflight import PreflightRefusal, preflight, trivially_fits

    base = ["model=gpt_tiny", "model.seq_len=64", "trainer.micro_batch_size=4", "+strategy=chunk", "logger=none"]
    small = typed([*base, "strategy.chunk.device_budget_gb=0.005"])
    assert trivially_fits(small, hw(64.0))
    with pytest.raises(PreflightRefusal) as e:
        preflight(small, hw(64.0))
    msg = str(e.value)
    assert "moment" in msg and "device_budget_gb" in msg and "this fits" in msg, msg
    roomy = typed([*base, "strategy.chunk.device_budget_gb=0.05"])
    plan = preflight(roomy, hw(64.0))
    assert plan is not None and plan["fits"]
