"""Pipeline parallelism (+strategy=pipeline, parallel.pp=2) against the plain single-process fp32 run.

Reference: the plain run on one process (no pipeline code) with the same micro-batch size and
``trainer.grad_accum`` (the pipeline's micro-batches), so both see the same micro-batches and average
the same losses. Only the order of floating-point sums differs (the stages' squared gradient norms,
the micro-batch losses), so losses and gradient norms agree to 1e-5 relative, and the final weights
to 2e-5 absolute (tests/tp/test_tp.py's bound: Adam's update is ~lr whatever the gradient, so rounding
can move a tiny-gradient element by up to lr per step; a wrong gradient moves weights by lr x steps).
``optim.grad_clip`` is low so clipping is active at every step: a stage's norm left out (or the tied
layer counted twice) changes the clip coefficient and with it every weight.

Memory: each stage's activation peak is the schedule's count of micro-batches in flight (GPipe: all
m; 1F1B: pp - s on stage s) times one micro-batch's activations of that stage's pieces, measured by
the tracker on the plain model in this process (no pipeline code). Parameters: each rank holds its
blocks, the first the embeddings, the last the final norm and its copy of the tied output layer.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from memopt.api import run_job, run_jobs_on_ranks
from memopt.engines.pipeline.schedules import in_flight
from memopt.errors import ConfigError
from memopt.models.gpt import GPT, GPTConfig
from tests.conftest import losses, typed
from tests.e2e.test_resume import DENSE, assert_exact, pair

STEPS, B, T, M = 3, 2, 64, 4  # steps, micro-batch, sequence, micro-batches (trainer.grad_accum)
BASE = ["model=gpt_tiny", f"model.seq_len={T}", f"trainer.max_steps={STEPS}", "trainer.log_every=1",
        "trainer.eval_every=3", "trainer.eval_batches=2", "optim.lr=3e-3", "optim.warmup_steps=1",
        "optim.grad_clip=0.05", "logger=none", "trainer.progress_bar=false", "trainer.save_checkpoint=true",
        f"trainer.micro_batch_size={B}", f"trainer.grad_accum={M}"]
PP = ["+strategy=pipeline", "parallel.pp=2"]
W_ATOL = 2e-5
SCHEDULES = {
    "gpipe": ["strategy.pipeline.schedule=gpipe"],
    "1f1b": ["strategy.pipeline.schedule=1f1b", "trainer.count_comm=true"],
    "interleaved_1f1b": ["strategy.pipeline.schedule=interleaved_1f1b"],  # 2 virtual stages per rank: 4 of 1 block
    "zero_bubble": ["strategy.pipeline.schedule=zero_bubble"],
}
BF16 = ["strategy.bf16.params=bf16"]
FP16 = ["strategy.fp16.init_scale=1024"]


def metric(run_dir: str, key: str) -> list:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line).get(key) for line in f]


def rel_err(a, b) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every schedule, ckpt + bf16, and a straight / resumed pair, in one launch of 2 ranks; the references."""
    root = tmp_path_factory.mktemp("pipeline")
    jobs = [(BASE + PP + o, str(root / n)) for n, o in SCHEDULES.items()]
    jobs.append((BASE + ["+strategy=[pipeline,ckpt,bf16]", "parallel.pp=2", *BF16], str(root / "ckpt_bf16")))
    jobs.append((BASE + ["+strategy=[pipeline,fp16]", "parallel.pp=2", *FP16], str(root / "fp16")))
    resume = pair(str(root), "resume", [*DENSE, *PP, "trainer.grad_accum=2"])
    summaries = run_jobs_on_ranks(2, jobs + resume)
    refs = {"fp32": run_job(BASE, str(root / "ref")),
            "bf16": run_job(BASE + ["+strategy=bf16", *BF16], str(root / "ref_bf16")),
            "fp16": run_job(BASE + ["+strategy=fp16", *FP16], str(root / "ref_fp16"))}
    return {"root": root, "summaries": dict(zip([os.path.basename(d) for _, d in jobs], summaries)), "refs": refs,
            "resume": resume}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_schedule_follows_single_process(runs, schedule):
    root = runs["root"]
    run, ref = str(root / schedule), str(root / "ref")
    s = runs["summaries"][schedule]
    assert s["status"] == "ok" and s["parallel"]["pp"] == 2 and s["parallel"]["dp"] == 1
    got, want = losses(run), losses(ref)
    assert len(got) == STEPS and rel_err(got, want) <= 1e-5, (got, want)
    gn, rn = metric(run, "grad_norm"), metric(ref, "grad_norm")
    assert rel_err(gn, rn) <= 1e-5 and min(rn) > 0.05, (gn, rn)  # clipping active at every step
    assert rel_err([metric(run, "val_loss")[-1]], [metric(ref, "val_loss")[-1]]) <= 1e-5  # the pipelined evaluation
    a, b = torch.load(f"{run}/model.pt")["state_dict"], torch.load(f"{ref}/model.pt")["state_dict"]
    assert a.keys() == b.keys()  # model.pt whole: every stage's weights, the tied pair included
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=W_ATOL, msg=k)
    assert s["tokens_per_step"] == runs["refs"]["fp32"]["tokens_per_step"]  # one pipeline sees the batch once


def test_checkpointing_and_bf16_compose(runs):
    """ckpt recomputes bit-identically and bf16 weights run the same ops on both sides: the suite's bf16
    tolerance (10 unit roundoffs, tests/unit/test_strategy_parity.py) against the one-process bf16 run."""
    root = runs["root"]
    assert runs["summaries"]["ckpt_bf16"]["status"] == "ok"
    assert rel_err(losses(str(root / "ckpt_bf16")), losses(str(root / "ref_bf16"))) <= 4e-2


def test_fp16_composes(runs):
    """fp16 weights with the loss scale in the schedule's loss function and the stages' overflow vote:
    the one-process fp16 run's losses (the suite's 5e-3) and loss scales."""
    root = runs["root"]
    assert runs["summaries"]["fp16"]["status"] == "ok"
    assert rel_err(losses(str(root / "fp16")), losses(str(root / "ref_fp16"))) <= 5e-3
    assert metric(str(root / "fp16"), "loss_scale") == metric(str(root / "ref_fp16"), "loss_scale")


def test_resume_is_exact(runs):
    assert_exact(runs["resume"])


def _blocks_numel(model, idx) -> int:
    return sum(p.numel() for i in idx for p in model.blocks[i].parameters())


def test_each_rank_holds_its_stage(runs):
    """Parameter bytes per rank from the model's shapes: rank 0 embeddings + blocks 0-1, rank 1 blocks
    2-3 + final norm + its copy of the tied output layer (V x C); fp32, one flat buffer per bucket."""
    cfg = typed(BASE).model
    with torch.device("meta"):
        m = GPT(cfg)
    first = m.wte.weight.numel() + m.wpe.weight.numel() + _blocks_numel(m, range(2))
    last = _blocks_numel(m, range(2, 4)) + sum(p.numel() for p in m.ln_f.parameters()) + m.lm_head.weight.numel()
    peaks = runs["summaries"]["1f1b"]["peak_bytes"]
    assert peaks["0"]["cpu"]["params"] == 4 * first
    assert peaks["1"]["cpu"]["params"] == 4 * last


def test_stage_boundary_carries_one_activation_per_micro_batch(runs):
    """Rank 0 (first stage) sends each micro-batch's (B, T, C) fp32 activation and receives its
    gradient: 4 B T C bytes each way per micro-batch (the comm counter's first step, which also carries
    torch's one-int32 set-up vote between the stages). The tied embedding's gradient (V x C fp32) is
    all-reduced with the last stage's output layer."""
    ops = runs["summaries"]["1f1b"]["comm_per_step"]["ops"]
    m = typed(BASE).model
    one = 4 * B * T * m.d_model
    for kind in ("send", "recv"):
        assert M * one <= ops[kind]["bytes"] <= M * one + 8, ops
    assert ops["all_reduce"]["bytes"] >= 4 * m.vocab_size * m.d_model, ops


def stage_activations() -> list[int]:
    """One micro-batch's activation bytes of each stage's pieces, measured by the tracker on the plain
    model in this process: embeddings + blocks 0-1, then blocks 2-3 + final norm + loss head from a
    leaf input (the second stage's input is a receive buffer, not its activation)."""
    from memopt.memory.tracker import MemoryTracker

    cfg = GPTConfig(**{**typed(BASE).model.__dict__})
    model = GPT(cfg)
    model.init_weights(0)
    x = torch.randint(0, cfg.vocab_size, (B, T))
    tracker = MemoryTracker("cpu")
    tracker.register_module(model)  # the weights are known storages (their views are not activations)
    with tracker:
        with tracker.retained():
            h = model.drop(model.wte(x) + model.wpe(torch.arange(T)))
            for b in model.blocks[:2]:
                h = b(h)
        a0 = tracker.live_bytes("cpu", "activations")
        h1 = h.detach().requires_grad_()
        with tracker.retained():
            g = h1
            for b in model.blocks[2:]:
                g = b(g)
            loss = model.loss_head(model.ln_f(g), model.lm_head, x)[1]
        a1 = tracker.live_bytes("cpu", "activations") - a0
    del loss
    return [a0, a1]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_stage_activation_peak_is_the_schedules_count(runs, schedule):
    per_micro = stage_activations()
    peaks = runs["summaries"][schedule]["peak_bytes"]
    for s in (0, 1):
        want = in_flight(schedule, s, 2, M) * per_micro[s]
        got = peaks[str(s)]["cpu"]["activations"]
        assert abs(got - want) <= 0.05 * want, (schedule, s, got, want)
    assert in_flight(schedule, 0, 2, M) == (M if schedule == "gpipe" else 2)  # the formula itself: 1F1B holds pp - s


def test_plan_gives_each_stage_its_measured_peaks(runs):
    """The planner runs the pipeline engine on fake tensors as rank 0 (first stage) and rank 1 (last):
    parameters, gradients and optimizer states as the run measured them per rank, activations within
    5%, the boundary's send bytes (the steady step: B T C fp32 per micro-batch), and a step time whose
    compute is stretched by the 1F1B bubble (pp - 1) / (m + pp - 1) = 1 / 5."""
    from memopt.memory.hardware import resolve_hardware
    from memopt.planner.plan import step_time
    from memopt.planner.simulate import simulate_rank

    cfg = typed(BASE + PP + SCHEDULES["1f1b"] + ["trainer.nproc_per_node=2"])
    measured = runs["summaries"]["1f1b"]["peak_bytes"]
    for rank in (0, 1):
        sim = simulate_rank(cfg, rank, 2)
        got, want = sim["peaks"]["device"], measured[str(rank)]["cpu"]
        for cat in ("params", "grads", "optim"):
            assert got[cat] == want[cat], (rank, cat, got[cat], want[cat])
        assert abs(got["activations"] - want["activations"]) <= 0.05 * want["activations"], (rank, got, want)
        assert sim["comm_per_step"]["ops"]["send"]["bytes"] == M * 4 * B * T * cfg.model.d_model
    hw = resolve_hardware(cfg.hardware, torch.device("cpu"))
    t = step_time(cfg, hw, sim)
    assert t["bubble_fraction"] == pytest.approx(1 / 5)
    assert t["compute_s"] == pytest.approx(sim["flops"] / (t["peak_tflops"] * t["compute_efficiency"] * 1e12) * 5 / 4)


# ---- refusals, before anything is allocated ------------------------------------------------------------
TWO = ["trainer.nproc_per_node=2"]
REFUSED = {
    "pp_not_dividing_blocks": (["model.n_layer=3", *PP], "model.n_layer=3 .* parallel.pp in \\[3\\]"),
    "1f1b_fewer_micro_batches": ([*PP, "trainer.grad_accum=1"], "trainer.grad_accum=1 .* trainer.grad_accum>=2"),
    "interleaved_rounds": ([*PP, "strategy.pipeline.schedule=interleaved_1f1b", "trainer.grad_accum=5"],
                           "multiple of the 2 rounds"),
    "virtual_with_1f1b": ([*PP, "strategy.pipeline.virtual_stages=2"], "virtual_stages=2 .*schedule=interleaved_1f1b"),
    "bad_split": ([*PP, "strategy.pipeline.split=[1,2]"], "split=\\[1, 2\\] must list 2 stages .*n_layer=4"),
    "bad_schedule": ([*PP, "strategy.pipeline.schedule=pipedream"], "schedule='pipedream' is not one of"),
    "pp_1": (["+strategy=pipeline"], "parallel.pp=1 splits nothing"),
    "pp_without_pipeline": (["parallel.pp=2"], "parallel.pp=2 .*\\+strategy=pipeline"),
    "chunk": (["+strategy=[pipeline,chunk]", "parallel.pp=2"], "pipeline and chunk are mutually exclusive"),
    "zero3": (["+strategy=[pipeline,zero3]", "parallel.pp=2"], "pipeline and zero3 are mutually exclusive"),
    "tp": (["+strategy=[pipeline,tp]", "parallel.pp=2"], "mutually exclusive"),
    "deepspeed_gpipe": (["engine=deepspeed", *PP, "strategy.pipeline.schedule=gpipe"],
                        "engine=deepspeed: DeepSpeed's pipeline engine trains with its own 1F1B"),  # test_deepspeed_pipe.py
    "fsdp2": (["engine=fsdp2", *PP], "engine=fsdp2 is not built"),
    "chunked_loss_unsupported": (["+strategy=[pipeline,chunked_loss]", "parallel.pp=2"],
                               "chunked_loss is not built for the pipeline engine.*drop \\+strategy=chunked_loss"),
    "llama": ([*PP, "model=llama_tiny"], "model.arch='llama' .* model.arch=gpt"),
    "freeze": ([*PP, "model.freeze=[wte.*]"],
               "model.freeze=\\['wte.\\*'\\] with \\+strategy=pipeline is not built.*model.freeze=\\[\\]"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_bad_input_is_refused_naming_what_works(name):
    overrides, message = REFUSED[name]
    with pytest.raises(ConfigError, match=message):
        typed(["model=gpt_tiny", "trainer.grad_accum=4", *overrides, *TWO])


# ---- pp x dp on 4 ranks ------------------------------------------------------------------------------------
@pytest.mark.slow  # 4 ranks on 2 cores
def test_pp2_x_dp2_follows_single_process(tmp_path):
    """pp=2 x dp=2: each dp rank's pipeline runs 2 micro-batches of 2; one process sees the same 4
    micro-batches of 2 (the data's global batch is cut the same way), gradients averaged over dp."""
    base = [o for o in BASE if not o.startswith("trainer.grad_accum")]
    pp_dp = base + ["+strategy=[pipeline,ddp]", "parallel.pp=2", "trainer.grad_accum=2"]
    (s,) = run_jobs_on_ranks(4, [(pp_dp, str(tmp_path / "pp"))])
    run_job(base + ["trainer.grad_accum=4"], str(tmp_path / "ref"))
    assert s["status"] == "ok" and s["parallel"]["pp"] == 2 and s["parallel"]["dp"] == 2
    assert rel_err(losses(str(tmp_path / "pp")), losses(str(tmp_path / "ref"))) <= 1e-5
    assert rel_err(metric(str(tmp_path / "pp"), "grad_norm"), metric(str(tmp_path / "ref"), "grad_norm")) <= 1e-5
    a, b = torch.load(f"{tmp_path}/pp/model.pt")["state_dict"], torch.load(f"{tmp_path}/ref/model.pt")["state_dict"]
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=W_ATOL, msg=k)


@pytest.mark.slow  # 4 ranks on 2 cores
def test_pp4_follows_single_process(tmp_path):
    """Four stages of one block: a middle stage neither embeds nor has the loss, and the tied layer's
    gradient is summed over a group of the first and last rank only (not the whole pipeline). The plan of each
    of the 4 stages holds the model states the run measured on that rank (the planner could not build more than
    two stages: the tied layer's groups were read from the mesh's tensor under fake mode, every pair [0, 0])."""
    from memopt.planner.simulate import simulate_rank

    (s,) = run_jobs_on_ranks(4, [(BASE + ["+strategy=pipeline", "parallel.pp=4"], str(tmp_path / "pp4"))])
    cfg = typed(BASE + ["+strategy=pipeline", "parallel.pp=4", "trainer.nproc_per_node=4"])
    for rank in range(4):
        got, want = simulate_rank(cfg, rank, 4)["peaks"]["device"], s["peak_bytes"][str(rank)]["cpu"]
        for cat in ("params", "grads", "optim"):
            assert got[cat] == want[cat], (rank, cat, got[cat], want[cat])
    run_job(BASE, str(tmp_path / "ref"))
    assert s["status"] == "ok" and s["parallel"]["pp"] == 4
    assert rel_err(losses(str(tmp_path / "pp4")), losses(str(tmp_path / "ref"))) <= 1e-5
    assert rel_err(metric(str(tmp_path / "pp4"), "grad_norm"), metric(str(tmp_path / "ref"), "grad_norm")) <= 1e-5
    a, b = torch.load(f"{tmp_path}/pp4/model.pt")["state_dict"], torch.load(f"{tmp_path}/ref/model.pt")["state_dict"]
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=W_ATOL, msg=k)
