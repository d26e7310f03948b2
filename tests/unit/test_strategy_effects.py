"""Every registered strategy does what it exists for: the same tiny job with and without it, and the
difference it must make, measured by the tracker, a spy on the kernel or the collectives counter, or
the losses, against references computed here from the model's shapes.

A strategy whose ``apply`` becomes a no-op (or an engine option that stops moving memory) leaves its
run identical to the run without it, so its check fails; a strategy added to the registry without a
check here fails ``test_every_registered_strategy_has_an_effect_check``.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # flash_attn runs under the interpreter on CPU (set before triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from memopt.api import run_jobs_on_ranks  # noqa: E402
from memopt.models.gpt import GPT, GPTConfig  # noqa: E402
from memopt.strategies.base import registry  # noqa: E402
from tests.conftest import losses, train  # noqa: E402

B, T, C, V, L, H = 2, 128, 128, 256, 4, 4  # gpt_tiny at micro-batch 2
BASE = ["model=gpt_tiny", "data=synthetic", "trainer.max_steps=1", "trainer.eval_every=0", "trainer.log_every=1",
        f"trainer.micro_batch_size={B}"]
RUN2 = ["logger=none", "trainer.progress_bar=false", "trainer.save_checkpoint=false", "trainer.count_comm=true"]
# chunk-engine jobs: seq 32 and a 6 MiB device budget, well below the model's ~17 MiB of chunks
CHUNK = ["model.seq_len=32", "trainer.max_steps=2", f"strategy.chunk.device_budget_gb={6 / 1024}",
         "strategy.chunk.warmup_gpu_chunk_mem_ratio=0.4"]
FLASH = ["model.n_layer=2", "model.seq_len=32", "model.d_model=64", "model.n_head=2"]


def meta_model(**kw) -> GPT:
    cfg = GPTConfig(**{"name": "t", "n_layer": L, "n_head": H, "d_model": C, "seq_len": T, "vocab_size": V, **kw})
    with torch.device("meta"):
        return GPT(cfg)


P = sum(p.numel() for p in meta_model().parameters())


def peak(summary, cat, device="cpu", rank="0") -> int:
    return summary["peak_bytes"][rank].get(device, {}).get(cat, 0)


def rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


class Runs:
    """Each single-process job once per module: name -> (summary, losses)."""

    def __init__(self, root):
        self.root, self.done = root, {}

    def __call__(self, name: str, extra: list[str]):
        if name not in self.done:
            d = str(self.root / name)
            s = train(BASE + extra, d)
            assert s["status"] == "ok", s
            self.done[name] = (s, losses(d))
        return self.done[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("effects"))


# -- model phase ---------------------------------------------------------------------------------

def check_ckpt(runs):
    plain, lp = runs("plain", [])
    ck, lc = runs("ckpt", ["+strategy=ckpt"])
    assert lc == lp  # recomputation is the same fp32 arithmetic
    # full checkpointing keeps each block's input (B*T*C fp32) instead of everything the block saves
    assert peak(plain, "activations") - peak(ck, "activations") >= (L - 1) * 4 * B * T * C * 3


def check_act_offload(runs):
    ck, _ = runs("ckpt", ["+strategy=ckpt"])
    off, lo = runs("act_offload", ["+strategy=[ckpt,act_offload]"])
    assert peak(off, "activations", "host") == L * 4 * B * T * C  # every checkpointed block input on the host
    assert peak(ck, "activations") - peak(off, "activations") >= (L - 1) * 4 * B * T * C
    assert lo == runs("plain", [])[1]


def check_chunked_loss(runs):
    plain, lp = runs("plain", [])
    cl, lc = runs("chunked_loss", ["+strategy=chunked_loss", "strategy.chunked_loss.chunk_tokens=64"])
    logits = 4 * B * T * V  # fp32 logits of the whole micro-batch; a chunk holds 64 of its B*T rows
    assert peak(plain, "activations") - peak(cl, "activations") >= (1 - 64 / (B * T)) * logits
    assert rel(lc, lp) < 1e-5


def check_flash_attn(runs, monkeypatch):
    import memopt.kernels.flash_attn as fa

    calls = {"fwd": 0, "bwd": 0}

    def counted(key, fn):
        def spy(*a, **k):
            calls[key] += 1
            return fn(*a, **k)
        return spy

    monkeypatch.setattr(fa, "_flash_forward", counted("fwd", fa._flash_forward))
    monkeypatch.setattr(fa, "_flash_backward", counted("bwd", fa._flash_backward))
    _, ls = runs("flash_ref", FLASH)
    assert calls == {"fwd": 0, "bwd": 0}
    _, lf = runs("flash_attn", FLASH + ["+strategy=flash_attn"])
    assert calls == {"fwd": 2, "bwd": 2}  # the Triton kernels ran in each block, forward and backward
    assert rel(lf, ls) < 1e-4


def check_moe(runs):
    moe, _ = runs("moe", ["+strategy=moe"])  # 4 experts, top-1, in every block
    dense = meta_model().blocks[0].mlp
    per_block = 3 * sum(p.numel() for p in dense.parameters()) + C * 4  # 3 more expert MLPs + router
    assert peak(moe, "params") == 4 * (P + L * per_block)


def check_lora(runs):
    plain, _ = runs("plain", [])
    lo, ll = runs("lora", ["+strategy=lora"])  # rank 8 on every block's qkv (C -> 3C) and proj (C -> C)
    adapters = L * 8 * ((C + 3 * C) + (C + C))
    assert peak(lo, "params") == 4 * (P + adapters)  # the frozen base weights and the adapters
    assert peak(lo, "grads") == 4 * adapters and peak(lo, "optim") == 8 * adapters  # the adapters' alone
    assert peak(plain, "grads") == 4 * P
    assert ll == runs("plain", [])[1]  # lora_B starts at zero: the first forward is the base model's


COMPILE = ["model.n_layer=2", "model.seq_len=64", "model.d_model=64", "model.n_head=2", "trainer.max_steps=3"]


def check_compile(runs):
    """The compiled run follows the eager fp32 run, and keeps per block fewer activation bytes by the
    point-wise outputs it recomputes: two LayerNorm outputs (B T C each) and GELU's (B T 4C)."""
    e, le = runs("compile_eager", COMPILE)
    c, lc = runs("compile", COMPILE + ["+strategy=compile"])
    assert len(lc) == 3 and rel(lc, le) < 1e-5
    for cat in ("params", "grads", "optim"):
        assert peak(c, cat) == peak(e, cat) > 0
    l_, t_, c_ = 2, 64, 64
    assert peak(e, "activations") - peak(c, "activations") == l_ * (c_ + c_ + 4 * c_) * B * t_ * 4


# -- precision -----------------------------------------------------------------------------------

def check_fp16(runs):
    s, lf = runs("fp16", ["+strategy=fp16", "strategy.fp16.init_scale=1024"])
    assert peak(s, "params") == 2 * P
    assert peak(s, "optim") >= 12 * P  # fp32 master + two moments
    assert s["loss_scale"] == 1024.0
    assert rel(lf, runs("plain", [])[1]) < 5e-3


def check_bf16(runs):
    plain, lp = runs("plain", [])
    auto_, la = runs("bf16", ["+strategy=bf16"])  # autocast: matmul inputs saved in bf16
    assert peak(auto_, "params") == 4 * P
    assert peak(auto_, "activations") < 0.85 * peak(plain, "activations")
    w, lw = runs("bf16_params", ["+strategy=bf16", "strategy.bf16.params=bf16"])
    assert peak(w, "params") == 2 * P and 2 * P <= peak(w, "grads") < 2 * P + 4096
    assert rel(la, lp) < 4e-2 and rel(lw, lp) < 4e-2


# -- the chunk engine ----------------------------------------------------------------------------

def check_chunk(runs):
    s, lc = runs("chunk", ["+strategy=chunk"])
    assert peak(s, "params") == 0 and peak(s, "grads") == 0  # the weights live in chunks
    assert peak(s, "chunks") + peak(s, "chunks", "host") >= 12 * P  # fp32 params + Adam moments, at least
    assert lc == runs("plain", [])[1]


def check_static_partition(runs):
    dyn, _ = runs("chunk_budget", [*CHUNK, "+strategy=chunk"])
    st, _ = runs("static_partition", [*CHUNK, "+strategy=static_partition"])
    D = 6 * 2**20
    assert peak(st, "chunks") <= 0.4 * D < peak(dyn, "chunks") <= D


def check_hybrid_adam(runs):
    fp16, _ = runs("chunk_fp16_budget", [*CHUNK, "+strategy=[chunk,fp16]", "strategy.chunk.device_budget_gb=0.0088"])
    hy, _ = runs("hybrid_adam", [*CHUNK, "+strategy=hybrid_adam", "strategy.chunk.device_budget_gb=0.0088"])
    # after the warm-up step, optimizer chunks move into the device margin: more device chunk bytes, in budget
    assert peak(fp16, "chunks") < peak(hy, "chunks") <= 0.0088 * 2**30


# -- offload and auto ----------------------------------------------------------------------------

def check_cpu_offload(runs):
    two_steps = ["trainer.max_steps=2"]  # the second loss shows the first update: the host step used the gradients
    z, lz = runs("zero2_1rank", ["+strategy=zero2", *two_steps])
    off, lo = runs("cpu_offload", ["+strategy=[zero2,cpu_offload]", *two_steps])
    assert peak(z, "optim") == 8 * P and peak(off, "optim") == 0
    assert peak(off, "optim", "host") == 12 * P  # fp32 master + moments on the host
    assert peak(off, "grads", "host") == 4 * P and peak(z, "grads", "host") == 0  # the fp32 gradient leaves the device
    assert len(lo) == 2 and rel(lo, lz) < 1e-6
    import warnings

    with warnings.catch_warnings(record=True) as seen:  # zero3 + offload_param on one rank: its parameters on the host
        warnings.simplefilter("always")
        z3, l3 = runs("zero3_offload_1rank", ["+strategy=[zero3,cpu_offload]", *two_steps])
    assert peak(z3, "params", "host") == 4 * P and peak(z3, "params") < 4 * P  # only what a block uses on the device
    assert not [w for w in seen if "partitions nothing" in str(w.message)]  # it does something on one rank
    assert rel(l3, lz) < 1e-6


def check_auto(runs):
    plain, _ = runs("plain", [])
    budget = 0.8 * peak(plain, "total")  # the plain run does not fit
    axes = ["strategy.auto.precision=[fp32]", "strategy.auto.stage=[ddp]", "strategy.auto.offload=[false]",
            "strategy.auto.ckpt=[none,full]", f"strategy.auto.micro_batch_size=[{B}]", "strategy.auto.tp=false",
            "strategy.auto.chunk_budget_gb=[]"]
    s, _ = runs("auto", ["+strategy=auto", f"hardware.device_memory_gb={budget / 2**30}", *axes])
    assert s["strategy"] != ["auto"] and "ckpt" in s["strategy"], s["strategy"]
    assert peak(s, "total") <= budget < peak(plain, "total")


# -- several ranks: one launch of 2 gloo ranks ---------------------------------------------------

TWO_RANK = {
    "ddp": ["+strategy=ddp"],
    "ps": ["+strategy=ps"],
    "zero1": ["+strategy=zero1"],
    "zero2": ["+strategy=zero2", "strategy.zero2.bucket_mb=0.25"],
    "zero3": ["+strategy=zero3", f"model.n_layer={2 * L}"],  # deep enough that one gathered block is a small part
    "zero3_offload": ["+strategy=[zero3,cpu_offload]"],
    "zero3_offload_no_param": ["+strategy=[zero3,cpu_offload]", "strategy.cpu_offload.offload_param=false"],
    "tp": ["+strategy=tp", "parallel.tp=2"],
    "chunk": ["+strategy=chunk"],
    "chunk_nocache": ["+strategy=chunk", "strategy.chunk.mem_cache=0"],
    "pipeline": ["+strategy=pipeline", "parallel.pp=2", "strategy.pipeline.schedule=gpipe"],
}


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    root = tmp_path_factory.mktemp("effects2")
    out = run_jobs_on_ranks(2, [(BASE + RUN2 + extra, str(root / n)) for n, extra in TWO_RANK.items()])
    assert all(s["status"] == "ok" for s in out), out
    one = train(BASE, str(root / "one_process"))  # tp=2 sees the same micro-batch as one process
    chunk = train(BASE + ["+strategy=chunk"], str(root / "chunk_one_process"))
    assert one["status"] == "ok" and chunk["status"] == "ok"
    import json

    with open(root / "chunk" / "metrics.jsonl") as f:  # the layout: elements per chunk (fp32 here)
        chunk_elems = json.loads(f.readlines()[-1])["chunk"]["chunk_size"]
    return {"one_process": (one, losses(str(root / "one_process"))), "chunk_one_process": (chunk, None),
            "chunk_bytes": (4 * chunk_elems, None),
            **{n: (s, losses(str(root / n))) for n, s in zip(TWO_RANK, out)}}


def comm(summary, kind) -> int:
    return summary["comm_per_step"]["ops"].get(kind, {}).get("bytes", 0)


def check_ddp(two):
    s, _ = two["ddp"]
    assert comm(s, "all_reduce") >= 4 * P  # every fp32 gradient all-reduced


def check_ps(two):
    """The server (rank 0) alone holds Adam's moments; it receives the worker's gradients and sends the
    weights back point to point, with no all-reduce (parity with ddp: tests/distributed/test_ps.py)."""
    s, _ = two["ps"]
    assert peak(s, "optim") == 8 * P and peak(s, "optim", rank="1") == 0
    assert comm(s, "recv") == 4 * P and comm(s, "send") >= 4 * P and comm(s, "all_reduce") == 0


def check_zero1(two):
    s, _ = two["zero1"]
    assert abs(peak(s, "optim") - 8 * P / 2) <= 64 and peak(s, "params") == 4 * P
    assert comm(s, "reduce_scatter") >= 4 * P and comm(s, "all_gather") >= 4 * P


def check_zero2(two):
    s, _ = two["zero2"]
    bucket = int(0.25 * 2**20)
    assert peak(s, "grads") <= 4 * P / 2 + 2 * bucket + 4 * 128 * 512  # own partition + buckets + one weight
    assert peak(s, "grads") < 0.8 * peak(two["ddp"][0], "grads")


def check_zero3(two):
    s, _ = two["zero3"]
    deep = meta_model(n_layer=2 * L)
    n = sum(p.numel() for p in deep.parameters())
    block = sum(p.numel() for p in deep.blocks[0].parameters())
    root = n - 2 * L * block  # embeddings and the final LayerNorm: one unit, gathered for the whole step
    # its own shard + the root unit + the gathered block and its prefetch, where data parallelism holds 4n
    assert peak(s, "params") <= 4 * n / 2 + 4 * root + 2 * 4 * block + 64 < 4 * n
    assert abs(peak(s, "grads") - 4 * n / 2) <= 64  # the gradient shard it owns
    assert comm(s, "all_gather") >= 4 * n  # parameters gathered before use


def check_offload_param(two):
    on, off = two["zero3_offload"][0], two["zero3_offload_no_param"][0]
    assert peak(on, "params", "host") == pytest.approx(4 * P / 2, abs=64) and peak(off, "params", "host") == 0
    assert peak(off, "params") - peak(on, "params") >= 0.8 * 4 * P / 2


def check_tp(two):
    s, lt = two["tp"]
    # Megatron split: LayerNorms, position embeddings and the row-parallel biases stay whole
    whole = sum(p.numel() for n, p in meta_model().named_parameters()
                if ".ln" in n or n.startswith("ln_f") or n.startswith("wpe") or n.endswith("proj.bias"))
    assert peak(s, "params") == 4 * (whole + (P - whole) // 2)
    assert comm(s, "all_reduce") > 0
    assert rel(lt, two["one_process"][1]) < 1e-5


def check_chunk_two_ranks(two):
    """Each rank owns half of the chunks and frees the other rank's after using them: its device holds
    its own chunks and the communication group in use (gpt_tiny's groups are large: ~85% of the one-process
    peak), never every chunk as one process does; its host half of the optimizer chunks."""
    one, two_ = two["chunk_one_process"][0], two["chunk"][0]
    for rank in ("0", "1"):
        assert peak(two_, "chunks", rank=rank) <= 0.9 * peak(one, "chunks")
        assert peak(two_, "chunks", "host", rank=rank) <= 0.6 * peak(one, "chunks", "host")
    assert comm(two_, "all_gather") > 0 and comm(two_, "reduce_scatter") > 0


def check_mem_cache(two):
    """PatrickStar's allocation cache keeps the payloads of the last released units on the device (they
    count as device chunk bytes) instead of freeing and allocating them again."""
    cache, nocache, chunk = two["chunk"][0], two["chunk_nocache"][0], two["chunk_bytes"][0]
    extra = peak(cache, "chunks") - peak(nocache, "chunks")
    assert chunk <= extra <= 2 * 2 * chunk, (extra, chunk)  # at least one remote chunk, at most mem_cache=2 units


def check_pipeline(two):
    """Each stage holds its half of the blocks (the first the embeddings, the last the final norm and
    its copy of the tied output layer: V x C more in all), activations cross with send / recv, and the
    loss is the one-process loss."""
    s, lp = two["pipeline"]
    p0, p1 = peak(s, "params", rank="0"), peak(s, "params", rank="1")
    assert p0 + p1 == 4 * (P + V * C) and max(p0, p1) < 0.75 * 4 * P
    assert comm(s, "send") >= 4 * B * T * C
    assert rel(lp, two["one_process"][1]) < 1e-5


ONE_RANK = {"ckpt": check_ckpt, "act_offload": check_act_offload, "chunked_loss": check_chunked_loss,
            "flash_attn": check_flash_attn, "moe": check_moe, "lora": check_lora, "fp16": check_fp16, "bf16": check_bf16,
            "chunk": check_chunk, "static_partition": check_static_partition, "hybrid_adam": check_hybrid_adam,
            "cpu_offload": check_cpu_offload, "auto": check_auto, "compile": check_compile}
TWO = {"ddp": check_ddp, "ps": check_ps, "zero1": check_zero1, "zero2": check_zero2, "zero3": check_zero3, "tp": check_tp,
       "cpu_offload.offload_param": check_offload_param, "chunk.two_ranks": check_chunk_two_ranks,
       "chunk.mem_cache": check_mem_cache, "pipeline": check_pipeline}


def test_every_registered_strategy_has_an_effect_check():
    assert set(registry()) == set(ONE_RANK) | {k for k in TWO if "." not in k}


@pytest.mark.parametrize("name", list(ONE_RANK))
def test_strategy_changes_what_it_exists_for(runs, name, monkeypatch):
    check = ONE_RANK[name]
    check(runs, monkeypatch) if name == "flash_attn" else check(runs)


@pytest.mark.parametrize("name", list(TWO))
def test_two_rank_strategy_changes_what_it_exists_for(two, name):
    TWO[name](two)
