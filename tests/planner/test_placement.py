"""Hybrid Adam's placement decided before step 0 by the plan (``planner/placement.py``): plan mode plans
the run again with the optimizer groups its warm-up placed made on the device at build
(``strategy.hybrid_adam.device_groups``), so no host memory ever holds them.

Reference: the plan of the same command with ``device_groups=0`` (the warm-up decides, after step 0's
host peak) minus n groups of 12 B per chunk element (fp32 master, momentum, variance) on the host; the
chunk size re-derived here from the model's shapes (the least-padding multiple of 1024 in [m, 4m])."""
from __future__ import annotations

import json

from tests.planner.test_plan_mode import TINY, cli_main

CMD = [*TINY, "+strategy=hybrid_adam", "strategy.fp16.init_scale=1024", "strategy.chunk.device_budget_gb=0.005"]


def least_padding_chunk(sizes: list[int]) -> int:
    lo = -(-max(sizes) // 1024) * 1024

    def padding(c: int) -> int:
        n, used = 0, c
        for k in sizes:
            if used + k > c:
                n, used = n + 1, 0
            used += k
        return n * c - sum(sizes)

    return min(range(lo, 4 * lo + 1, 1024), key=lambda c: (padding(c), c))


def test_plan_mode_makes_the_warm_ups_groups_on_the_device_before_step_0(tmp_path, capsys):
    import torch

    from memopt.models import model_class
    from tests.conftest import typed

    auto, fixed = tmp_path / "auto", tmp_path / "after_warmup"
    assert cli_main([*CMD, f"hydra.run.dir={auto}"]) == 0
    out = capsys.readouterr().out
    assert cli_main([*CMD, "strategy.hybrid_adam.device_groups=0", f"hydra.run.dir={fixed}"]) == 0
    a, f = (json.loads((d / "plan.json").read_text()) for d in (auto, fixed))
    n = a["placement"]["device_groups"]
    assert n >= 1 and n == f["optim_groups_on_device"]["0"]  # the warm-up's own decision
    assert f"strategy.hybrid_adam.device_groups={n}" in out and "placement" not in f
    cfg = typed(CMD).model
    with torch.device("meta"):
        sizes = [p.numel() for p in model_class(cfg)(cfg).parameters()]
    chunk = least_padding_chunk(sizes)
    host_a, host_f = a["peak_bytes"]["0"]["host"]["chunks"], f["peak_bytes"]["0"]["host"]["chunks"]
    assert host_f - host_a == n * 12 * chunk, (host_f, host_a, n, chunk)
    assert a["placement"]["node_host_bytes_warmup_placed"] == f["node_host_bytes"]
    # the planned fp16 step is applied (not taken for an overflow): the host groups' Adam converts their
    # gradients, one fp32 chunk at a time
    assert a["peak_bytes"]["0"]["host"]["temp"] >= 4 * chunk


def test_a_run_whose_preflight_planned_takes_the_plans_placement(tmp_path, monkeypatch, capsys):
    """The CLI's preflight (``gate.run_preflight``) plans a run near its memory and sets the placement in
    the config the ranks get; here the preflight is made to plan (gpt_tiny is trivially small)."""
    from omegaconf import OmegaConf

    from memopt import gate
    from memopt.api import compose_config
    from memopt.planner import preflight
    from tests.conftest import typed

    monkeypatch.setattr(preflight, "trivially_fits", lambda cfg, hw: False)
    ov = [o for o in CMD if o != "trainer.mode=plan"]
    t, cfg = typed(ov), OmegaConf.create(OmegaConf.to_container(compose_config(ov)))
    assert t.strategy.hybrid_adam.device_groups is None
    assert gate.run_preflight(t, cfg, str(tmp_path / "r")) is None  # fits: no refusal
    n = t.strategy.hybrid_adam.device_groups
    assert n is not None and n >= 1 and cfg.strategy.hybrid_adam.device_groups == n
    assert f"strategy.hybrid_adam.device_groups={n}" in capsys.readouterr().err


def test_a_run_that_fits_with_the_warm_ups_count_is_left_to_its_warm_up(tmp_path):
    """gpt_1b's width at 4 layers under a 2.5 GB chunk budget on an H100 profile (the GPU check's chunk
    row): the warm-up places no group and the run fits so; the most the moments allow (more than none)
    would make parameter chunks move between host and device every step (5x the step on the H100). The
    reference: the same command with the placement typed as none."""
    cmd = ["logger=none", "data=synthetic", "model=gpt_1b", "model.n_layer=4", "hardware=h100_sxm",
           "hardware.host_memory_gb=120", "+strategy=[hybrid_adam,ckpt]", "strategy.chunk.device_budget_gb=2.5",
           "strategy.chunk.warmup_gpu_chunk_mem_ratio=0.6", "trainer.micro_batch_size=1", "trainer.mode=plan"]
    auto, none = tmp_path / "auto", tmp_path / "none"
    assert cli_main([*cmd, f"hydra.run.dir={auto}"]) == 0
    assert cli_main([*cmd, "strategy.hybrid_adam.device_groups=0", f"hydra.run.dir={none}"]) == 0
    a, z = (json.loads((d / "plan.json").read_text()) for d in (auto, none))
    assert a["fits"] and a["optim_groups_device_max"]["0"] > 0  # the hard margin would allow groups ...
    assert "placement" not in a  # ... but none is forced: the warm-up's own count (none) fits
    assert a["peak_bytes"]["0"]["device"]["chunks"] == z["peak_bytes"]["0"]["device"]["chunks"]
