"""Frozen parameters (``model.freeze``) and LoRA (``+strategy=lora``), against references written here:
the bytes a frozen parameter costs (its weights only) from the shapes, the trained parameters of a few
steps against a float64 AdamW where the frozen ones have learning rate 0, the adapted layer against
W x + s B A x in float64, the merged save against W + s B A, and the refusals."""
from __future__ import annotations

import fnmatch
import math

import pytest
import torch

from memopt.errors import ConfigError
from tests.conftest import losses, train, typed

B = 2
BASE = ["model=gpt_tiny", "data=synthetic", "trainer.eval_every=0", "trainer.log_every=1", f"trainer.micro_batch_size={B}",
        "model.seq_len=32", "trainer.max_steps=1"]
FREEZE = "model.freeze=[wte.*,blocks.0.*,blocks.2.mlp.*]"
FREEZE_GLOBS = ["wte.*", "blocks.0.*", "blocks.2.mlp.*"]


def meta(overrides: list[str] = ()):
    """The composed model on meta (strategies applied, freeze applied) of ``overrides``."""
    from memopt.compose import model_on_meta
    from memopt.memory.tracker import NullTracker

    cfg = typed(BASE + list(overrides))
    return model_on_meta(cfg, torch.device("cpu"), None, NullTracker())


def counts(model) -> tuple[int, int]:
    """(all distinct parameter elements, trainable ones)."""
    ps = list(model.parameters())
    return sum(p.numel() for p in ps), sum(p.numel() for p in ps if p.requires_grad)


def peak(summary, cat, device="cpu", rank="0") -> int:
    return summary["peak_bytes"][rank].get(device, {}).get(cat, 0)


# -- which parameters, and the refusals ------------------------------------------------------------

def test_freeze_marks_matching_names_and_ties():
    m = meta([FREEZE])
    frozen = {n for n, p in m.named_parameters(remove_duplicate=False) if not p.requires_grad}
    want = {n for n, _ in m.named_parameters(remove_duplicate=False) if any(fnmatch.fnmatchcase(n, g) for g in FREEZE_GLOBS)}
    assert frozen == want | {"lm_head.weight"}  # tied to wte.weight: one tensor
    m = meta(["model.freeze=[lm_head.weight]"])  # the other name of the tied pair
    assert not m.wte.weight.requires_grad


@pytest.mark.parametrize("overrides, field", [
    (["model.freeze=[nothing.*]"], "'nothing.*' matches no parameter"),
    (["model.freeze=[*]"], "freezes every parameter"),
    (["+strategy=lora", "strategy.lora.rank=0"], "strategy.lora.rank=0"),
    (["+strategy=lora", "strategy.lora.alpha=0"], "strategy.lora.alpha=0"),
    (["+strategy=lora", "strategy.lora.save=both"], "strategy.lora.save='both'"),
    (["+strategy=lora", "strategy.lora.targets=[*.ln1]"], "'*.ln1' matches no Linear layer"),
    (["+strategy=lora", "strategy.lora.targets=[lm_head]"], "tied embeddings"),
    (["model=llama_tiny", "+strategy=[lora,chunked_loss]", "strategy.lora.targets=[lm_head]"], "lm_head with +strategy=chunked_loss"),
    (["+strategy=[lora,tp]", "parallel.tp=2", "trainer.nproc_per_node=2"], "mutually exclusive"),
    (["+strategy=[lora,hybrid_adam]"], None),  # the chunk engine's family composes with lora: no refusal
])
def test_refusals(overrides, field):
    if field is None:
        meta(overrides)
        return
    with pytest.raises(ConfigError, match=None) as e:
        meta(overrides)
    assert field in str(e.value), str(e.value)


# -- the adapted layer ---------------------------------------------------------------------------

def test_lora_linear_forward_backward_against_float64():
    from memopt.strategies.lora import LoRALinear

    torch.manual_seed(0)
    base = torch.nn.Linear(12, 20).double()  # the layer in float64 too: the formula is checked, not fp32 rounding
    layer = LoRALinear(base, rank=4, alpha=6.0, dropout=0.0)
    with torch.no_grad():
        layer.lora_A.normal_()
        layer.lora_B.normal_()  # non-zero, so B's contribution shows
    x = torch.randn(3, 5, 12, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    gy = torch.randn_like(y)
    y.backward(gy)
    W, b, A, Bm = (t.detach().double().requires_grad_() for t in (base.weight, base.bias, layer.lora_A, layer.lora_B))
    xd = x.detach().double().requires_grad_()
    s = 6.0 / 4
    ref = xd @ W.T + b + s * (xd @ A.T) @ Bm.T
    ref.backward(gy.double())
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    for got, want in ((x.grad, xd.grad), (layer.lora_A.grad, A.grad), (layer.lora_B.grad, Bm.grad),
                      (base.weight.grad, W.grad)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# -- bytes: a frozen parameter costs its weights only ------------------------------------------------

def test_frozen_bytes_memopt_one_rank(tmp_path):
    n, t = counts(meta([FREEZE]))
    s = train(BASE + [FREEZE], str(tmp_path / "f"))
    assert s["status"] == "ok", s
    assert peak(s, "params") == 4 * n  # every weight, fp32
    assert peak(s, "grads") == 4 * t  # gradients of the trainable ones only
    assert peak(s, "optim") == 8 * t  # two fp32 moments of the trainable ones only (fp32 params: no master)


def test_lora_bytes_memopt_and_chunk(tmp_path):
    m = meta(["+strategy=lora"])
    n, t = counts(m)
    C, L = 128, 4
    assert t == L * 8 * ((C + 3 * C) + (C + C))  # rank 8 on qkv (C -> 3C) and proj (C -> C) of every block
    s = train(BASE + ["+strategy=lora"], str(tmp_path / "m"))
    assert peak(s, "params") == 4 * n and peak(s, "grads") == 4 * t and peak(s, "optim") == 8 * t
    c = train(BASE + ["+strategy=[chunk,lora]"], str(tmp_path / "c"))
    import json

    rec = json.loads(open(tmp_path / "c" / "metrics.jsonl").readlines()[-1])["chunk"]
    size = rec["chunk_size"]
    # fp32 payload on the device (gradients reuse it), 12 B per element of the trainable chunks only on the host
    assert rec["chunk_bytes_device"] == 4 * size * rec["chunks_total"]
    assert rec["chunk_bytes_host"] == 12 * size * math.ceil(t / size)
    # the run's host peak: the payload chunks before they first move to the device, and the optimizer's
    assert peak(c, "chunks", "host") == 4 * size * rec["chunks_total"] + 12 * size * math.ceil(t / size)
    assert losses(str(tmp_path / "c")) == losses(str(tmp_path / "m"))


@pytest.mark.slow  # 18 s on an AVX2 CPU; freezing's bytes on one rank stay in the default suite
def test_frozen_bytes_zero2_zero3_two_ranks(tmp_path):
    """One launch of 2 gloo ranks (~15 s): ddp, zero2, zero3, their cpu_offload, the chunk engine, FSDP2 and DeepSpeed zero2 with block 0,
    the embedding and one MLP frozen, and zero3 + lora on memopt, FSDP2 and DeepSpeed."""
    from memopt.api import run_jobs_on_ranks

    m = meta([FREEZE])
    n, t = counts(m)
    block = sum(p.numel() for p in m.blocks[0].parameters())
    root = n - len(m.blocks) * block
    run2 = ["logger=none", "trainer.progress_bar=false", "trainer.save_checkpoint=false", "trainer.max_steps=2"]
    jobs = {"ddp": ["+strategy=ddp", FREEZE], "zero2": ["+strategy=zero2", FREEZE], "zero3": ["+strategy=zero3", FREEZE],
            "zero3_lora": ["+strategy=[zero3,lora]"], "zero2_offload": ["+strategy=[zero2,cpu_offload]", FREEZE],
            "zero3_offload": ["+strategy=[zero3,cpu_offload]", FREEZE], "chunk": ["+strategy=chunk", FREEZE],
            "fsdp2": ["engine=fsdp2", "+strategy=zero2", FREEZE], "ds2": ["engine=deepspeed", "+strategy=zero2", FREEZE],
            "ds3_lora": ["engine=deepspeed", "+strategy=[zero3,lora]"], "fsdp2_lora": ["engine=fsdp2", "+strategy=[zero3,lora]"]}
    out = dict(zip(jobs, run_jobs_on_ranks(2, [(BASE + run2 + x, str(tmp_path / k)) for k, x in jobs.items()])))
    assert all(s["status"] == "ok" for s in out.values()), out
    pad = 64 * 16  # a group's padding to a multiple of 2 ranks, a few groups
    for r in ("0", "1"):
        assert peak(out["zero2"], "params", rank=r) == 4 * n  # replicated weights
        assert abs(peak(out["zero2"], "optim", rank=r) - 8 * t / 2) <= pad  # half of the trainable moments
        assert abs(peak(out["zero3"], "optim", rank=r) - 8 * t / 2) <= pad
        # the owned gradient shards of the trainable parameters, and at most one block's unsharded gradients
        # on their way to the reduce-scatter (the frozen block 0 adds no shard to hide that transient)
        assert 4 * t / 2 - pad <= peak(out["zero3"], "grads", rank=r) <= 4 * t / 2 + 4 * block + pad
        # weights: every parameter's shard, the root unit, a gathered block and its prefetch (frozen groups
        # are gathered and released with their block's, in the forward and in the backward)
        assert peak(out["zero3"], "params", rank=r) <= 4 * n / 2 + 4 * root + 2 * 4 * block + pad
        assert peak(out["zero2_offload"], "optim", rank=r) == peak(out["zero3_offload"], "optim", rank=r) == 0
        assert abs(peak(out["zero3_offload"], "optim", "host", rank=r) - 12 * t / 2) <= pad
        assert abs(peak(out["zero3_offload"], "params", "host", rank=r) - 4 * n / 2) <= pad  # every shard, frozen too
        assert abs(peak(out["zero2_offload"], "optim", "host", rank=r) - 12 * t / 2) <= pad
        # FSDP2: each parameter's dim 0 padded to the 2 ranks; frozen ones sharded with no gradient, no state
        assert abs(peak(out["fsdp2"], "optim", rank=r) - 8 * t / 2) <= pad
        # its zero2 keeps the gathered weights from the forward to the backward: shards + every weight (frozen too)
        assert abs(peak(out["fsdp2"], "params", rank=r) - (4 * n / 2 + 4 * n)) <= pad
    nl, tl = counts(meta(["+strategy=lora"]))
    assert abs(peak(out["zero3_lora"], "optim") - 8 * tl / 2) <= pad
    assert abs(peak(out["fsdp2_lora"], "optim") - 8 * tl / 2) <= pad
    # DeepSpeed keeps its own fp32 partition besides the moments (12 B per trainable element, half on each rank)
    assert abs(peak(out["ds2"], "optim") - 12 * t / 2) <= pad and abs(peak(out["ds3_lora"], "optim") - 12 * tl / 2) <= pad
    assert max(abs(a - b) for a, b in zip(losses(str(tmp_path / "ds3_lora")), losses(str(tmp_path / "zero3_lora")))) < 1e-5
    assert max(abs(a - b) for a, b in zip(losses(str(tmp_path / "fsdp2_lora")), losses(str(tmp_path / "zero3_lora")))) < 1e-5
    ref = losses(str(tmp_path / "ddp"))  # the same 2-rank job without partitioning: the same two steps
    assert len(ref) == 2
    for k in ("zero2", "zero3", "zero2_offload", "zero3_offload", "chunk", "fsdp2", "ds2"):
        assert max(abs(a - b) for a, b in zip(losses(str(tmp_path / k)), ref)) < 1e-5, k


# -- trajectories against float64 AdamW with lr 0 on the frozen parameters ------------------------

STEPS, LR, WD, EPS = 3, 1e-2, 0.1, 1e-4
# eps well above the fp32 noise of gradients that are zero in exact arithmetic (the key bias: softmax is
# invariant to it), which Adam with eps 1e-8 would blow up to +-lr in either precision
OPT = [f"optim.lr={LR}", "optim.schedule=constant", "optim.warmup_steps=0", "optim.grad_clip=0", f"optim.weight_decay={WD}",
       f"optim.eps={EPS}"]


def engine_run(overrides):
    """Build the engine in this process, take STEPS steps on fixed batches; (initial state, final state, model)."""
    from memopt.engines import build_engine
    from memopt.memory.tracker import NullTracker
    from memopt.parallel import setup, teardown

    cfg = typed(BASE + OPT + list(overrides))
    device = torch.device("cpu")
    dims = setup(device, cfg.parallel)
    try:
        engine = build_engine(cfg, device, dims, NullTracker())
        first = {k: v.clone() for k, v in engine.full_state_dict().items()}
        for x, y in batches():
            engine.forward_backward(x, y, 0, 1)
            engine.step(LR)
        return first, engine.full_state_dict()
    finally:
        teardown()


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 256, (B, 32), generator=g), torch.randint(0, 256, (B, 32), generator=g)) for _ in range(STEPS)]


def reference(model, first: dict):
    """Float64 AdamW (Loshchilov & Hutter, torch.optim.AdamW's update), lr 0 for parameters that do
    not require grad, from the engine's initial weights; returns the final state dict."""
    model = model.double()
    names = dict(model.named_parameters())
    with torch.no_grad():
        for k, p in names.items():
            p.copy_(first[k].double())
    m = {k: torch.zeros_like(p) for k, p in names.items()}
    v = {k: torch.zeros_like(p) for k, p in names.items()}
    b1, b2, eps = 0.9, 0.95, EPS
    for step, (x, y) in enumerate(batches(), 1):
        model.zero_grad()
        model(x, y)[1].backward()
        with torch.no_grad():
            for k, p in names.items():
                lr = LR if p.requires_grad else 0.0
                if lr == 0.0:
                    continue
                g = p.grad
                p.mul_(1 - lr * (WD if p.ndim >= 2 else 0.0))
                m[k].mul_(b1).add_(g, alpha=1 - b1)
                v[k].mul_(b2).addcmul_(g, g, value=1 - b2)
                mh, vh = m[k] / (1 - b1 ** step), v[k] / (1 - b2 ** step)
                p.sub_(lr * mh / (vh.sqrt() + eps))
    return {k: t.detach() for k, t in model.state_dict().items()}


@pytest.mark.parametrize("engine", ["memopt", "chunk"])
def test_frozen_trajectory_against_float64(engine):
    extra = [FREEZE] + (["+strategy=chunk"] if engine == "chunk" else [])
    first, last = engine_run(extra)
    model = meta([FREEZE])
    from memopt.compose import materialize_params

    materialize_params(model, torch.device("cpu"), torch.float64, storage=True)
    ref = reference(model, first)
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    for k in ref:
        if k in frozen:
            assert torch.equal(last[k], first[k]), k  # bitwise unchanged
        else:
            assert not torch.equal(last[k], first[k]), k  # it did train
            torch.testing.assert_close(last[k].double(), ref[k], rtol=2e-4, atol=2e-5)


def test_lora_trajectory_against_float64_and_merged_save(tmp_path):
    first, last = engine_run(["+strategy=lora", "strategy.lora.alpha=4"])
    model = meta(["+strategy=lora", "strategy.lora.alpha=4"])
    from memopt.compose import materialize_params

    materialize_params(model, torch.device("cpu"), torch.float64, storage=True)
    ref = reference(model, first)
    for k in ref:
        if k.endswith(("lora_A", "lora_B")):
            torch.testing.assert_close(last[k].double(), ref[k], rtol=2e-4, atol=2e-5)
            assert not torch.equal(last[k], first[k])
        else:
            assert torch.equal(last[k], first[k]), k  # the base model is frozen
    assert all(torch.equal(first[k], torch.zeros_like(first[k])) for k in first if k.endswith("lora_B"))  # B starts at 0
    # merged model.pt: W + (alpha/rank) B A under the base names, a plain model for memopt.load_model
    import memopt

    d = str(tmp_path / "run")
    s = train(BASE + ["trainer.max_steps=3", "+strategy=lora", "strategy.lora.alpha=4", "trainer.save_checkpoint=true",
                      "optim.lr=1e-2"], d)
    assert s["status"] == "ok", s

    plain = memopt.load_model(d)
    assert not any("lora" in k for k in plain.state_dict())
    ad = train(BASE + ["trainer.max_steps=3", "+strategy=lora", "strategy.lora.alpha=4", "trainer.save_checkpoint=true",
                       "optim.lr=1e-2", "strategy.lora.save=adapters"], str(tmp_path / "ad"))
    assert ad["status"] == "ok"
    adapters = torch.load(str(tmp_path / "ad" / "model.pt"), weights_only=True)["state_dict"]
    assert set(adapters) == {f"blocks.{i}.attn.{m}.{x}" for i in range(4) for m in ("qkv", "proj") for x in ("lora_A", "lora_B")}
    base = meta([]).state_dict()  # names and shapes; the values: the seeded init, as the run's first state
    for k in plain.state_dict():
        want = first[k].double()
        prefix = k.rpartition(".")[0]
        if k.endswith(".weight") and f"{prefix}.lora_A" in adapters:
            want = want + (4 / 8) * adapters[f"{prefix}.lora_B"].double() @ adapters[f"{prefix}.lora_A"].double()
        assert k in base
        torch.testing.assert_close(plain.state_dict()[k].double(), want, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="adapters alone"):
        memopt.load_model(str(tmp_path / "ad"))
    from memopt.strategies.lora import load_adapters

    on_base = load_adapters(meta_plain_model(first), str(tmp_path / "ad"))
    x = torch.randint(0, 256, (1, 16))
    torch.testing.assert_close(on_base.eval()(x)[0], plain(x)[0], rtol=1e-5, atol=1e-5)


def meta_plain_model(state: dict):
    from memopt.models import model_class

    cfg = typed(BASE).model
    model = model_class(cfg)(cfg)
    model.load_state_dict({k: v for k, v in state.items() if "lora" not in k})
    return model


# -- resume ------------------------------------------------------------------------------------------

def _resume_exact(tmp_path, name, overrides):
    """2 + 2 steps: the resumed run's losses and model.pt equal the straight run's, bit for bit (the
    checkpoints hold base weights and adapters unmerged, and the adapters' optimizer states)."""
    from tests.e2e.test_resume import pair, records, run_in_process

    jobs = pair(tmp_path, name, ["model=gpt_tiny", "optim.lr=1e-2", *overrides], steps=4)
    run_in_process(jobs)
    (_, straight), (_, resumed) = jobs
    import json

    for d in (straight, resumed):
        s = json.loads(open(f"{d}/summary.json").read())
        assert s["status"] == "ok" and name in d, s
    a, b = records(straight), records(resumed)
    assert sorted(b) == [2, 3] and [a[s] for s in (2, 3)] == [b[s] for s in (2, 3)]
    wa, wb = (torch.load(f"{d}/model.pt", weights_only=True)["state_dict"] for d in (straight, resumed))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    return wa


def test_lora_resume_is_exact(tmp_path):
    w = _resume_exact(tmp_path, "lora", ["+strategy=lora", "strategy.lora.save=adapters"])
    assert all(k.endswith(("lora_A", "lora_B")) for k in w)


@pytest.mark.parametrize("save", ["merged", "adapters"])
def test_lora_checkpoint_merges_into_what_model_pt_holds(tmp_path, save):
    """``python -m memopt.checkpoint merge`` of a LoRA run's last checkpoint (base weights and adapters kept
    apart for an exact resume) writes what the run's model.pt holds: W + alpha/rank B A under the base names, or
    the adapters alone with their record (it had written the adapters unmerged beside the base weights, which
    memopt.load_model refused and memopt.export wrote into a model that was not the trained one)."""
    import memopt
    from memopt.api import run_job
    from memopt.checkpoint import main

    run = str(tmp_path / "run")
    run_job(["model=gpt_tiny", "data=synthetic", "trainer.eval_every=0", "trainer.micro_batch_size=2", "model.seq_len=32",
             "optim.lr=1e-2", "trainer.max_steps=2", "trainer.checkpoint_every=2", "+strategy=lora",
             f"strategy.lora.save={save}", "logger=none"], run)
    out = str(tmp_path / "new" / "merged.pt")  # a folder that does not exist yet is made
    assert main(["merge", f"{run}/checkpoints/step_2", out]) == 0
    got, want = (torch.load(f, weights_only=True) for f in (out, f"{run}/model.pt"))
    assert got["state_dict"].keys() == want["state_dict"].keys()
    assert all(torch.allclose(got["state_dict"][k], want["state_dict"][k], rtol=0, atol=1e-6) for k in want["state_dict"])
    if save == "adapters":
        assert got["lora"]["rank"] == want["lora"]["rank"] and sorted(got["lora"]["modules"]) == sorted(want["lora"]["modules"])
    else:
        assert not any("lora" in k for k in got["state_dict"]) and memopt.load_model(out) is not None
        from memopt.export import export

        unmerged = str(tmp_path / "unmerged.pt")  # the old merge's file: adapters beside the base weights
        torch.save({**want, "state_dict": {**want["state_dict"], "blocks.0.attn.qkv.lora_A": torch.zeros(8, 64)}}, unmerged)
        with pytest.raises(ConfigError, match="unmerged"):
            export(unmerged, str(tmp_path / "hf"))


@pytest.mark.slow  # the chunk engine and a frozen memopt run: 8 more short runs
@pytest.mark.parametrize("extra", [["+strategy=[chunk,lora]"], ["model.freeze=[wte.*,blocks.0.*]", "+strategy=zero2"]])
def test_frozen_resume_is_exact_chunk_and_zero(tmp_path, extra):
    _resume_exact(tmp_path, "r", extra)


# -- the planner counts them so --------------------------------------------------------------------

@pytest.mark.parametrize("extra", [["+strategy=lora"], [FREEZE, "+strategy=zero2"], ["+strategy=[chunk,lora]"]])
def test_plan_equals_the_run(tmp_path, extra):
    """trainer.mode=plan runs the same build and step on fake tensors: the same params / grads / optim /
    chunks bytes as the measured run."""
    ran = train(BASE + extra, str(tmp_path / "run"))
    planned = train(BASE + extra + ["trainer.mode=plan"], str(tmp_path / "plan"))
    assert ran["status"] == planned["status"] == "ok"
    for cat in ("params", "grads", "optim", "chunks"):
        for dev in ("cpu", "host"):
            assert peak(planned, cat, dev) == peak(ran, cat, dev), (cat, dev)


def test_lora_on_llama_defaults_to_its_attention_projections(tmp_path):
    m = meta(["model=llama_tiny", "+strategy=lora"])
    _, t = counts(m)
    cfg = m.cfg
    D = cfg.head_dim
    q, kv = cfg.n_head * D, cfg.kv_heads * D
    C = cfg.d_model
    assert t == cfg.n_layer * 8 * ((C + q) + 2 * (C + kv) + (q + C))  # q, k, v, o of every block at rank 8
    s = train(BASE + ["model=llama_tiny", "+strategy=[lora,zero2]"], str(tmp_path / "l"))
    assert s["status"] == "ok" and peak(s, "grads") == 4 * t and peak(s, "optim") == 8 * t


def test_freeze_glob_refused_before_any_rank_starts():
    from memopt.config import to_dataclass, validate
    from tests.conftest import compose

    cfg = to_dataclass(compose(BASE + ["model.freeze=[blocks.9.*]", "+strategy=zero3", "trainer.nproc_per_node=2"]))
    with pytest.raises(ConfigError, match="'blocks.9.\\*' matches no parameter"):
        validate(cfg)
    validate(to_dataclass(compose(BASE + ["+strategy=lora", "model.freeze=[*.lora_A]"])))  # adapters' names are known


RESUME_TWO_RANKS = {"zero3_lora": ["+strategy=[zero3,lora]"], "zero2_offload_frozen": ["+strategy=[zero2,cpu_offload]", "model.freeze=[wte.*,blocks.0.*]"],
                    "chunk_lora": ["+strategy=[chunk,lora]", "strategy.chunk.chunk_size=65536"],
                    "fsdp2_lora": ["engine=fsdp2", "+strategy=[zero3,lora]"],
                    "deepspeed_frozen": ["engine=deepspeed", "+strategy=zero2", "model.freeze=[wte.*,blocks.0.*]"],
                    "deepspeed_lora": ["engine=deepspeed", "+strategy=[zero3,lora]", "strategy.lora.save=adapters"]}


@pytest.mark.slow  # one 2-rank launch of 12 short runs
def test_frozen_and_lora_resume_is_exact_two_ranks(tmp_path):
    """2 + 2 steps on 2 ranks for every engine: the resumed run's losses and model.pt equal the straight run's."""
    import json

    from memopt.api import run_jobs_on_ranks
    from tests.e2e.test_resume import pair, records

    jobs = [j for name, o in RESUME_TWO_RANKS.items() for j in pair(tmp_path, name, ["model=gpt_tiny", "optim.lr=1e-2", *o], steps=4)]
    run_jobs_on_ranks(2, jobs)
    for (_, straight), (_, resumed) in zip(jobs[::2], jobs[1::2]):
        for d in (straight, resumed):
            s = json.loads(open(f"{d}/summary.json").read())
            assert s["status"] == "ok", (d, s)
        a, b = records(straight), records(resumed)
        assert sorted(b) == [2, 3] and [a[s] for s in (2, 3)] == [b[s] for s in (2, 3)], straight
        wa, wb = (torch.load(f"{d}/model.pt", weights_only=True)["state_dict"] for d in (straight, resumed))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), straight
