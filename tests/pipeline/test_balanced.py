"""``strategy.pipeline.split=balanced``: the planner's split against every split planned (the exhaustive
reference), the single-process fp32 trajectory, and the run's measured per-stage peaks.

Shape: gpt_tiny (4 blocks) at sequence 256, micro-batch 2, 4 micro-batches, pp=2, 1F1B. Activations
dominate there, and under 1F1B the first stage keeps 2 micro-batches of them, the last 1: the even
split [2, 2] loads the first stage most, and moving a block to the last stage lowers the largest peak.
"""
from __future__ import annotations

import pytest
import torch

from memopt.errors import ConfigError
from memopt.models.gpt import GPT
from tests.conftest import losses, typed

STEPS, B, T, M = 3, 2, 256, 4
BASE = ["model=gpt_tiny", f"model.seq_len={T}", f"trainer.max_steps={STEPS}", "trainer.log_every=1",
        "trainer.eval_every=3", "trainer.eval_batches=2", "optim.lr=3e-3", "optim.warmup_steps=1",
        "optim.grad_clip=0.05", "logger=none", "trainer.progress_bar=false", "trainer.save_checkpoint=true",
        f"trainer.micro_batch_size={B}", f"trainer.grad_accum={M}"]
PP = ["+strategy=pipeline", "parallel.pp=2", "strategy.pipeline.schedule=1f1b"]
TWO = ["trainer.nproc_per_node=2"]


def rel_err(a, b) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_even_split_spreads_the_extra_blocks_over_the_last_stages():
    from memopt.planner.balance import even_split

    assert even_split(4, 2) == [2, 2] and even_split(5, 2) == [2, 3] and even_split(7, 3) == [2, 2, 3]


REFUSED = {
    "unknown_word": (["strategy.pipeline.split=uneven"], "split='uneven' is not one of: even, balanced"),
    "interleaved": (["strategy.pipeline.split=balanced", "strategy.pipeline.schedule=interleaved_1f1b"],
                    "split=balanced with strategy.pipeline.schedule=interleaved_1f1b is not built.*schedule=1f1b"),
    "fewer_blocks": (["strategy.pipeline.split=balanced", "model.n_layer=1"], "n_layer=1 .*parallel.pp<=1"),
    "not_counts": (["strategy.pipeline.split=[1.5,2.5]"], "must list whole block counts"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_bad_split_is_refused_naming_what_works(name):
    overrides, message = REFUSED[name]
    with pytest.raises(ConfigError, match=message):
        typed(["model=gpt_tiny", "trainer.grad_accum=4", "+strategy=pipeline", "parallel.pp=2", *TWO, *overrides])


def test_balanced_accepts_blocks_an_even_split_refuses_and_is_never_built_unresolved():
    from memopt.strategies.pipeline import stage_blocks

    cfg = typed(["model=gpt_tiny", "model.n_layer=5", "trainer.grad_accum=4", *PP, *TWO, "strategy.pipeline.split=balanced"])
    with pytest.raises(ConfigError, match="unresolved"):
        stage_blocks(cfg.strategy.pipeline, 5, 2)
    with pytest.raises(ConfigError, match="or balanced"):  # the even split's refusal names it
        typed(["model=gpt_tiny", "model.n_layer=5", "trainer.grad_accum=4", *PP, *TWO])


def planned_max(split: list[int]) -> int:
    """The largest stage peak of plan mode's plan (``make_plan``: every stage's rank simulated) of ``split``."""
    from memopt.memory.hardware import resolve_hardware
    from memopt.planner.plan import make_plan

    cfg = typed([*BASE, *PP, *TWO, f"strategy.pipeline.split=[{split[0]},{split[1]}]"])
    plan = make_plan(cfg, resolve_hardware(cfg.hardware, torch.device("cpu")))
    return max(sum(v["total"] for v in p.values()) for p in plan["peak_bytes"].values())


@pytest.mark.slow
def test_balanced_split_has_the_least_largest_planned_peak():
    """Every split of the 4 blocks over 2 stages planned by plan mode: the balanced split's largest stage
    peak is the least of them, and below the even split's."""
    from memopt.planner.balance import balanced_split

    got = balanced_split(typed([*BASE, *PP, *TWO, "strategy.pipeline.split=balanced"]))
    every = {(a, 4 - a): planned_max([a, 4 - a]) for a in (1, 2, 3)}
    assert every[tuple(got["split"])] == min(every.values()), (got, every)
    assert every[tuple(got["split"])] < every[(2, 2)] and got["even"] == [2, 2], (got, every)


@pytest.mark.slow  # 2 ranks x 2 runs and the reference, at sequence 256
def test_balanced_run_follows_single_process_and_its_plan(tmp_path):
    """The balanced run trains the single-process fp32 trajectory (losses and gradient norms 1e-5
    relative, weights 2e-5 absolute: tests/pipeline/test_pipeline.py's bounds), builds the split the
    planner chose, and each stage's measured peaks are the plan's (parameters, gradients, optimizer
    states exact, activations and totals within 5%); its largest measured stage peak is below the even
    run's."""
    import json

    from memopt.api import run_job, run_jobs_on_ranks
    from memopt.memory.hardware import resolve_hardware
    from memopt.planner.plan import make_plan

    bal, even = run_jobs_on_ranks(2, [([*BASE, *PP, "strategy.pipeline.split=balanced"], str(tmp_path / "bal")),
                                      ([*BASE, *PP], str(tmp_path / "even"))])
    run_job(BASE, str(tmp_path / "ref"))
    assert bal["status"] == even["status"] == "ok"
    assert rel_err(losses(str(tmp_path / "bal")), losses(str(tmp_path / "ref"))) <= 1e-5
    norms = {k: [json.loads(line)["grad_norm"] for line in open(tmp_path / k / "metrics.jsonl")] for k in ("bal", "ref")}
    assert rel_err(norms["bal"], norms["ref"]) <= 1e-5
    a, b = torch.load(f"{tmp_path}/bal/model.pt")["state_dict"], torch.load(f"{tmp_path}/ref/model.pt")["state_dict"]
    assert a.keys() == b.keys()
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=2e-5, msg=k)

    with torch.device("meta"):  # the split built, from the model's shapes: rank 0 embeddings + block 0
        m = GPT(typed(BASE).model)
    blocks = lambda idx: sum(p.numel() for i in idx for p in m.blocks[i].parameters())  # noqa: E731
    assert bal["peak_bytes"]["0"]["cpu"]["params"] == 4 * (m.wte.weight.numel() + m.wpe.weight.numel() + blocks([0]))
    assert bal["peak_bytes"]["1"]["cpu"]["params"] == 4 * (blocks([1, 2, 3]) + sum(p.numel() for p in m.ln_f.parameters())
                                                          + m.lm_head.weight.numel())
    cfg = typed([*BASE, *PP, *TWO, "strategy.pipeline.split=[1,3]"])
    plan = make_plan(cfg, resolve_hardware(cfg.hardware, torch.device("cpu")))
    for rank in ("0", "1"):
        got, want = bal["peak_bytes"][rank]["cpu"], plan["peak_bytes"][rank]["device"]
        for cat in ("params", "grads", "optim"):
            assert got[cat] == want[cat], (rank, cat, got[cat], want[cat])
        for cat in ("activations", "total"):
            assert abs(got[cat] - want[cat]) <= 0.05 * want[cat], (rank, cat, got[cat], want[cat])
    top = {k: max(s["peak_bytes"][r]["cpu"]["total"] for r in ("0", "1")) for k, s in (("bal", bal), ("even", even))}
    assert top["bal"] < top["even"], top
