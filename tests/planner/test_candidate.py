"""Typed candidates (planner/candidate.py) against Hydra: every candidate's config is the one its printed
overrides compose, so the search ranks exactly what the user would run by copying a row."""
from __future__ import annotations

import pytest

from tests.conftest import typed


def gpu(ranks: int):
    from memopt.memory.hardware import HardwareConfig

    return HardwareConfig(name="g", device_memory_gb=80.0, host_memory_gb=512.0, peak_tflops={"fp32": 19.5, "bf16": 312.0,
                          "fp16": 312.0}, host_device_gbps=25.0, device_device_gbps=300.0, devices_per_node=ranks,
                          device_is_host=False)


def composed(overrides: list[str]):
    from memopt.config import compose_config, to_dataclass

    return to_dataclass(compose_config(overrides))


def one_per_shape(cands):
    """One candidate per (strategies, option fields): every shape of the space, without composing all of them."""
    seen, out = set(), []
    for c in cands:
        key = (c.strategies, tuple(k for k, _ in c.options))
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def test_every_strategy_file_composes_as_hydra_does():
    """``strategy_node`` reads conf/strategy (a preset's defaults merged in Hydra's order) for each registered
    strategy alone and for the selections the search makes (presets with their pulled-in strategies)."""
    from memopt.planner.candidate import strategy_node
    from memopt.strategies.base import registry

    for name in registry():
        assert strategy_node((name,)) == composed([f"+strategy={name}"]).strategy, name
    for names in (("bf16", "ckpt", "zero2", "cpu_offload"), ("hybrid_adam", "ckpt"), ("hybrid_adam_bf16", "ckpt"),
                  ("hybrid_adam_fp32",), ("moe", "fp16", "zero3"), ("bf16", "ckpt", "tp", "zero2")):
        assert strategy_node(names) == composed([f"+strategy=[{','.join(names)}]"]).strategy, names


# (the command's overrides other than its strategy selection, the selection and auto's axes)
COMMANDS = [
    pytest.param(["model=gpt_tiny", "trainer.nproc_per_node=2", "logger=none"], ["+strategy=auto"], 2, id="gpt"),
    pytest.param(["model=gpt_tiny", "trainer.nproc_per_node=4", "strategy.moe.num_experts=6", "logger=none"],
                 ["+strategy=[auto,moe]", "parallel.ep=2"], 4, id="moe-named"),
    pytest.param(["model=moe_tiny", "trainer.nproc_per_node=2", "logger=none"],
                 ["+strategy=auto", "strategy.auto.chunk_budget_gb=[0,0.5]", "strategy.auto.ckpt=[none,every_k,selective]",
                  "strategy.auto.precision=[fp32,bf16,fp16]"], 2, id="moe-preset", marks=pytest.mark.slow),
    pytest.param(["model=gpt_tiny", "trainer.nproc_per_node=4", "engine=fsdp2", "logger=none"], ["+strategy=auto"], 4,
                 id="fsdp2", marks=pytest.mark.slow),
    pytest.param(["model=gpt_tiny", "trainer.nproc_per_node=4", "engine=deepspeed", "logger=none"], ["+strategy=auto"], 4,
                 id="deepspeed", marks=pytest.mark.slow),
    pytest.param(["model=gpt_tiny", "trainer.nproc_per_node=4", "trainer.grad_accum=2", "logger=none"],
                 ["+strategy=auto", "strategy.auto.micro_batch_size=[8]"], 4, id="pp-tp", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("rest,auto,ranks", COMMANDS)
def test_each_candidate_is_the_config_its_overrides_compose(rest, auto, ranks):
    """The command without its selection (the part Hydra keeps) plus a candidate's printed overrides composes
    to the candidate's typed config, for one candidate of every shape: tp, pp, ep, the chunk presets with a
    budget, ZeRO-3's optimizer-only offload, MoE named (its options printed) or from a model preset."""
    from memopt.planner.search import base_of, candidates

    cfg = typed([*rest, *auto])
    base = base_of(cfg)
    cands = candidates(cfg, gpu(ranks))
    assert cands
    for c in one_per_shape(cands):
        assert c.config(base) == composed([*rest, *c.overrides()]), c.label()


def test_the_chosen_candidate_is_the_run_the_cli_would_launch():
    """auto's winner goes to the ranks as a DictConfig built from the typed config: the same container as
    Hydra's composition of the command with the winner's overrides (what the ranks rebuild their config from)."""
    from omegaconf import OmegaConf

    from memopt.config import compose_config
    from memopt.planner.search import base_of, candidates

    rest = ["model=gpt_tiny", "trainer.nproc_per_node=2", "logger=none"]
    cfg = typed([*rest, "+strategy=auto"])
    for c in one_per_shape(candidates(cfg, gpu(2)))[:8]:
        ours = OmegaConf.to_container(OmegaConf.structured(c.config(base_of(cfg))), resolve=True)
        assert ours == OmegaConf.to_container(compose_config([*rest, *c.overrides()]), resolve=True), c.label()


def test_preflight_compositions_keep_the_commands_options():
    """The suggestion's compositions: the command's own (its options, from the typed config: here a selective
    checkpoint and a chunk budget) and the list after it compose as their printed overrides say."""
    from memopt.planner.candidate import clear
    from memopt.planner.preflight import _compositions

    for rest, sel in ((["model=gpt_tiny", "trainer.nproc_per_node=2", "logger=none"],
                       ["+strategy=[zero2,ckpt]", "strategy.ckpt.policy=selective", "strategy.zero2.bucket_mb=5"]),
                      (["model=gpt_tiny", "logger=none"], ["+strategy=[hybrid_adam]", "strategy.chunk.device_budget_gb=0.5"]),
                      (["model=moe_tiny", "trainer.nproc_per_node=2", "logger=none"], ["+strategy=zero2"])):
        cfg = typed([*rest, *sel])
        comps = _compositions(cfg, cfg.trainer.nproc_per_node)
        assert comps[0].config(clear(cfg, ("pp",))).strategy == cfg.strategy  # the command's own, options and all
        for c in comps:
            assert c.config(clear(cfg, ("pp",))) == composed([*rest, *c.overrides()]), c.label()


@pytest.mark.parametrize("hardware, want", [("v100_patrickstar", "fp16"), ("a100_80g", "bf16"), ("h100_sxm", "bf16")])
def test_the_default_half_precision_is_the_profiles_faster_one(hardware, want):
    """auto's default precisions are fp32 and ``half``: on a V100 (fp16 125, bf16 15.7 TFLOP/s, its fp32 rate)
    the candidates are fp16, where the tensor cores are, and on an A100 or H100 (equal peaks) bf16; a command
    that names its precisions gets those."""
    import torch

    from memopt.memory.hardware import resolve_hardware
    from memopt.planner.search import candidates

    def dtypes(*extra):
        cfg = typed(["model=gpt_tiny", f"hardware={hardware}", "trainer.nproc_per_node=2", "+strategy=auto", *extra])
        hw = resolve_hardware(cfg.hardware, torch.device("cpu"))
        return {d for c in candidates(cfg, hw) for d in ("fp16", "bf16") if d in c.strategies}

    assert dtypes() == {want}
    assert dtypes("strategy.auto.precision=[fp32,bf16,fp16]") == {"fp16", "bf16"}
