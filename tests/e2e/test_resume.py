"""Resume is exact: N steps straight and the same run resumed from its half-way checkpoint give
bit-identical losses (the second half) and bit-identical final weights. The reference is the
straight run (its in-memory state continues); the resumed run rebuilds everything from the files.

Default suite: one single-process case (2 + 2 steps, with the merge command). ``slow``: a 2-rank
zero3 + cpu_offload case (2 + 2 steps), a 2-rank zero3 case whose resume must cost no more memory
than the run, 6 = 3 + 3 steps for every memopt / chunk engine strategy, DeepSpeed (its own checkpoint files) and FSDP2 (DTensors through DCP) on 1 and 2 ranks, and a SIGKILL inside
a save followed by ``trainer.resume=auto``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from memopt.errors import EXIT_CODES
from tests.conftest import REPO

TINY = ["logger=none", "trainer.progress_bar=false", "model.seq_len=32", "model.n_layer=2", "trainer.micro_batch_size=2",
        "trainer.eval_every=0", "trainer.log_every=1", "optim.warmup_steps=2", "data=synthetic", "data.synthetic_tokens=20000"]
DENSE = ["model=gpt_tiny"]


def records(run_dir) -> dict[int, float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def weights(run_dir, steps: int) -> dict[str, torch.Tensor]:
    """model.pt's weights, or (runs without it: expert parallelism) the merged last checkpoint's."""
    from memopt.checkpoint import merge

    path = os.path.join(run_dir, "model.pt")
    if not os.path.exists(path):
        path = merge(os.path.join(run_dir, "checkpoints", f"step_{steps}"), os.path.join(run_dir, "merged.pt"))
    return torch.load(path, weights_only=True)["state_dict"]


def pair(root, name: str, overrides: list[str], steps: int = 6):
    """(overrides, run_dir) of the straight run and of the run resumed from its half-way checkpoint."""
    straight, resumed = os.path.join(root, name, "straight"), os.path.join(root, name, "resumed")
    base = [*TINY, f"trainer.max_steps={steps}", *overrides]
    every = f"trainer.checkpoint_every={steps // 2}"
    return [(base + [every], straight), (base + [every, f"trainer.resume={straight}/checkpoints/step_{steps // 2}"], resumed)]


def assert_exact(jobs, steps: int = 6) -> None:
    (_, straight), (_, resumed) = jobs
    a, b = records(straight), records(resumed)
    tail = list(range(steps // 2, steps))
    assert sorted(b) == tail, (resumed, b)
    assert [a[s] for s in tail] == [b[s] for s in tail], (resumed, a, b)
    wa, wb = weights(straight, steps), weights(resumed, steps)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), (resumed, k)
    last = os.path.join(straight, "checkpoints", f"step_{steps}")
    if os.path.exists(os.path.join(straight, "model.pt")) and os.path.isdir(last):  # every rank's part of the weights is in
        from memopt.checkpoint import merge

        merged = torch.load(merge(last, os.path.join(straight, "merged.pt")), weights_only=True)["state_dict"]
        assert merged.keys() == wa.keys() and all(torch.equal(merged[k], wa[k]) for k in wa), straight


def assert_resume_costs_no_more(jobs) -> None:
    """A resume's peaks are the uninterrupted run's (the reference): the load reads the weights a unit at a time
    (``Engine.checkpoint_model_units``), where a load that filled every weight's fp32 copy at once was
    measured above it (gpt_tiny zero3, 2 ranks: params 4.98 vs 3.40 MB, total +0.65 MB per rank)."""
    (_, straight), (_, resumed) = jobs
    a, b = (json.loads(open(os.path.join(d, "summary.json")).read())["peak_bytes"] for d in (straight, resumed))
    for rank, devs in a.items():
        for dev, cats in devs.items():
            for cat, want in cats.items():
                assert b[rank][dev][cat] <= want + 65536, (resumed, rank, dev, cat, b[rank][dev][cat], want)


def run_in_process(jobs) -> None:
    from memopt.api import run_job

    for overrides, run_dir in jobs:
        run_job(overrides, run_dir)


def test_resume_is_exact_one_process_and_merges(tmp_path):
    """Plain fp32 + activation checkpointing, 2 steps + resume 2; the merged last checkpoint holds
    exactly the weights of model.pt (what ``memopt.load_model`` reads)."""
    import memopt
    from memopt.checkpoint import main

    jobs = pair(tmp_path, "ckpt", [*DENSE, "+strategy=ckpt"], steps=4)
    run_in_process(jobs)
    assert_exact(jobs, steps=4)
    s = json.loads((tmp_path / "ckpt" / "resumed" / "summary.json").read_text())
    assert s["start_step"] == 2 and s["resumed_from"].endswith("step_2") and s["steps"] == 2
    straight = tmp_path / "ckpt" / "straight"
    assert main(["merge", str(straight / "checkpoints" / "step_4"), str(tmp_path / "merged.pt")]) == 0
    merged, final = memopt.load_model(str(tmp_path / "merged.pt")).state_dict(), memopt.load_model(str(straight)).state_dict()
    assert merged.keys() == final.keys() and all(torch.equal(merged[k], final[k]) for k in final)
    # a checkpoint resumes only the configuration that wrote it: model shape and strategy options included
    from memopt.api import run_job
    from memopt.errors import ConfigError

    base, step2 = jobs[1][0], str(straight / "checkpoints" / "step_2")
    for change, field in (("model.n_layer=1", "model_config"), ("strategy.ckpt.policy=selective", "strategy_options")):
        with pytest.raises(ConfigError, match=f"cannot resume this run .*{field}"):
            run_job([*base, f"trainer.resume={step2}", change], str(tmp_path / change))


@pytest.mark.slow
def test_resume_is_exact_two_ranks_zero3_offload(tmp_path):
    """Sharded weights and host-offloaded Adam over 2 ranks, each rank writing its own file."""
    from memopt.api import run_jobs_on_ranks

    jobs = pair(tmp_path, "zero3_offload", [*DENSE, "+strategy=[zero3,cpu_offload]"], steps=4)
    run_jobs_on_ranks(2, jobs)
    assert_exact(jobs, steps=4)
    ckpt = tmp_path / "zero3_offload" / "straight" / "checkpoints" / "step_4"
    assert len([f for f in os.listdir(ckpt) if f.endswith(".distcp")]) == 2


@pytest.mark.slow
def test_resume_of_zero3_shards_costs_no_more_than_the_run(tmp_path):
    """zero3 on 2 ranks, 4 blocks: the load fills one block's fp32 copies at a time, so the resumed run's
    peaks (every category) are the uninterrupted run's."""
    from memopt.api import run_jobs_on_ranks

    jobs = pair(tmp_path, "zero3", [*DENSE, "+strategy=zero3", "model.n_layer=4"], steps=4)
    run_jobs_on_ranks(2, jobs)
    assert_exact(jobs, steps=4)
    assert_resume_costs_no_more(jobs)


ONE_RANK = {"plain": [], "fp16": ["+strategy=fp16"], "bf16": ["+strategy=bf16", "strategy.bf16.params=bf16"],
            "ckpt": ["+strategy=ckpt"], "cpu_offload": ["+strategy=cpu_offload"],
            "chunk": ["+strategy=chunk", "strategy.chunk.chunk_size=65536"],
            "hybrid_adam": ["+strategy=hybrid_adam", "strategy.chunk.chunk_size=65536"], "moe": ["model=moe_tiny"],
            "moe_chunk": ["model=moe_tiny", "+strategy=chunk", "strategy.chunk.chunk_size=262144"]}
TWO_RANKS = {"ddp": ["+strategy=ddp"], "zero1": ["+strategy=zero1"], "zero2": ["+strategy=zero2"],
             "zero3": ["+strategy=zero3"], "zero2_offload": ["+strategy=[zero2,cpu_offload]"],
             "zero3_fp16": ["+strategy=[zero3,fp16]"],
             "chunk": ["+strategy=chunk", "strategy.chunk.chunk_size=65536"],
             "hybrid_adam": ["+strategy=hybrid_adam", "strategy.chunk.chunk_size=65536"],
             "moe_zero2": ["model=moe_tiny", "+strategy=zero2"],
             "moe_ep2_zero2": ["model=moe_tiny", "+strategy=zero2", "parallel.ep=2"],
             "moe_ep2_zero3": ["model=moe_tiny", "+strategy=zero3", "parallel.ep=2"],
             "moe_ep2_chunk": ["model=moe_tiny", "+strategy=chunk", "parallel.ep=2"],  # each rank's experts, its own chunks
             "deepspeed_zero2": ["engine=deepspeed", "+strategy=zero2"],
             "deepspeed_zero3_fp16": ["engine=deepspeed", "+strategy=[zero3,fp16]"],
             "deepspeed_zero2_offload": ["engine=deepspeed", "+strategy=[zero2,cpu_offload]"],
             "fsdp2_zero3": ["engine=fsdp2", "+strategy=zero3"], "fsdp2_zero2_bf16": ["engine=fsdp2", "+strategy=[zero2,bf16]"]}
# DeepSpeed and FSDP2 need a launched rank even alone (a process group)
ONE_LAUNCHED_RANK = {"deepspeed_ddp": ["engine=deepspeed", "+strategy=ddp"], "deepspeed_zero1_bf16": ["engine=deepspeed", "+strategy=[zero1,bf16]"],
                     "fsdp2_zero3": ["engine=fsdp2", "+strategy=zero3"]}


def _model(o):
    return o if any(x.startswith("model=") for x in o) else [*DENSE, *o]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ONE_RANK))
def test_resume_is_exact_one_rank_matrix(tmp_path, name):
    jobs = pair(tmp_path, name, _model(ONE_RANK[name]))
    run_in_process(jobs)
    assert_exact(jobs)


def assert_matrix_exact_on_ranks(tmp_path, matrix: dict, nproc: int) -> None:
    """Every case's straight and resumed runs in one launch of ``nproc`` ranks, each pair exact."""
    from memopt.api import run_jobs_on_ranks

    jobs = [j for name, o in matrix.items() for j in pair(tmp_path, name, _model(o))]
    run_jobs_on_ranks(nproc, jobs)
    for i in range(0, len(jobs), 2):
        assert_exact(jobs[i : i + 2])


@pytest.mark.slow
def test_resume_is_exact_one_launched_rank_deepspeed_fsdp2(tmp_path):
    assert_matrix_exact_on_ranks(tmp_path, ONE_LAUNCHED_RANK, 1)


@pytest.mark.slow
def test_resume_is_exact_two_ranks_matrix(tmp_path):
    assert_matrix_exact_on_ranks(tmp_path, TWO_RANKS, 2)


def _cli(run_dir, args, env_extra=None, timeout=600):
    env = dict(os.environ, PYTHONPATH=REPO, WANDB_MODE="offline")
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "memopt.train", f"hydra.run.dir={run_dir}", *TINY, *DENSE,
                           "trainer.max_steps=6", *args],
                          env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_sigkill_inside_a_save_leaves_the_previous_checkpoint(tmp_path):
    """SIGKILL after the step-4 checkpoint's data is written but before it is renamed: step_2 stays
    the newest complete checkpoint, and ``trainer.resume=auto`` continues from it, recomputing steps
    2 and 3 exactly as the killed run had computed them."""
    run = tmp_path / "run"
    p = _cli(run, ["trainer.checkpoint_every=2"], {"MEMOPT_FAULT_SAVE": "4"})
    assert p.returncode == -9, p.stderr[-2000:]
    ck = run / "checkpoints"
    assert sorted(os.listdir(ck)) == [".tmp-step_4", "step_2"]
    killed = records(run)
    p = _cli(run, ["trainer.checkpoint_every=2", "trainer.resume=auto"])
    assert p.returncode == 0, p.stderr[-2000:]
    with open(run / "metrics.jsonl") as f:
        recs = [json.loads(line) for line in f]
    first, second = recs[0]["run_id"], recs[-1]["run_id"]
    assert first != second and [r["step"] for r in recs if r["run_id"] == second] == [2, 3, 4, 5]
    again = {r["step"]: r["loss"] for r in recs if r["run_id"] == second}
    assert again[2] == killed[2] and again[3] == killed[3]
    assert sorted(os.listdir(ck)) == ["step_4", "step_6"]  # the leftover removed, the newest 2 kept
    s = json.loads((run / "summary.json").read_text())
    assert s["status"] == "ok" and s["run_id"] == second and s["start_step"] == 2
    assert EXIT_CODES["ok"] == 0


def test_a_torn_last_record_is_cut_before_a_resume_appends(tmp_path):
    """A run killed while writing a metrics record leaves a line without its newline; the resumed run's first
    record had been glued to it (neither line read as JSON). The torn line is cut; every line reads, and the
    resumed steps follow the checkpointed ones."""
    from memopt.api import run_job

    run = str(tmp_path / "run")
    base = [*TINY, *DENSE, "trainer.checkpoint_every=2", f"hydra.run.dir={run}"]
    run_job([*base, "trainer.max_steps=2"], run)
    with open(os.path.join(run, "metrics.jsonl"), "a") as f:
        f.write('{"run_id": "x", "step": 2, "loss": 4.9')  # a record cut by a kill
    run_job([*base, "trainer.max_steps=4", "trainer.resume=auto"], run)
    with open(os.path.join(run, "metrics.jsonl")) as f:
        steps = [json.loads(line)["step"] for line in f]
    assert steps == [0, 1, 2, 3]
