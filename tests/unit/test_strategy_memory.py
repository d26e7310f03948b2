"""Memory effects of the single-process strategies, measured by the tracker on gpt_small
(T=512) and checked against byte counts derived independently of the tracker: the tensors that
autograd saves for one block (counted with saved-tensor hooks) and the shapes of the model."""
from __future__ import annotations

import pytest
import torch

from memopt.models.gpt import GPT, GPTConfig, count_params
from tests.conftest import train

B = 2  # micro-batch; gpt_small has L=8, C=512, H=8, T=512
SMALL = ["model=gpt_small", "trainer.max_steps=1", "trainer.eval_every=0", f"trainer.micro_batch_size={B}", "data=synthetic"]


def saved_bytes(fn, *args, exclude=()) -> int:
    """Bytes of the distinct storages autograd saves while running fn (the activations it keeps),
    not counting parameters and the storages of ``exclude``."""
    seen: dict[int, int] = {}
    skip = {t.untyped_storage().data_ptr() for t in exclude}

    def pack(t):
        st = t.untyped_storage()
        if not isinstance(t, torch.nn.Parameter) and st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(seen.values())


@pytest.fixture(scope="module")
def shapes():
    cfg = GPTConfig(name="gpt_small", n_layer=8, n_head=8, d_model=512, seq_len=512, vocab_size=256)
    T, C = cfg.seq_len, cfg.d_model
    blk = GPT(GPTConfig(**{**cfg.__dict__, "n_layer": 1})).blocks[0]
    x = torch.randn(B, T, C, requires_grad=True)
    naive = GPTConfig(**{**cfg.__dict__, "n_layer": 1, "attention": "naive"})
    core = GPT(naive).blocks[0].attn.core
    q = torch.randn(B, cfg.n_head, T, C // cfg.n_head, requires_grad=True)
    return {
        "cfg": cfg,
        "block": saved_bytes(blk, x, exclude=list(blk.parameters())),  # one block's saved activations (sdpa), its input included
        "boundary": B * T * C * 4,  # one block input, fp32
        "scores": saved_bytes(core, q, k := q * 1.0, v := q * 1.0, exclude=(q, k, v)),  # softmax + mask, per layer
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for name, extra in {
        "plain": [],
        "full": ["+strategy=ckpt"],
        "offload": ["+strategy=[ckpt,act_offload]"],
        "naive": ["model.attention=naive"],
        "selective": ["model.attention=naive", "+strategy=ckpt", "strategy.ckpt.policy=selective"],
    }.items():
        s = train(SMALL + extra, str(tmp_path_factory.mktemp(name)))
        assert s["status"] == "ok", s
        out[name] = s
    return out


def act(summary, device="cpu") -> int:
    return summary["peak_bytes"]["0"].get(device, {}).get("activations", 0)


def test_full_checkpointing_bound_and_ratio(runs, shapes):
    L = shapes["cfg"].n_layer
    plain, full = act(runs["plain"]), act(runs["full"])
    # outside the blocks: embedding output, final LayerNorm, logits and their fp32 copy for the loss
    nonblock = plain - L * shapes["block"]
    assert 0 <= nonblock < shapes["block"], "plain activations should be L blocks plus a small tail"
    bound = shapes["block"] + L * shapes["boundary"] + nonblock
    assert full <= bound, (full, bound)
    assert plain / full >= 3.0, plain / full


def test_selective_removes_exactly_the_score_bytes(runs, shapes):
    L = shapes["cfg"].n_layer
    saved = act(runs["naive"]) - act(runs["selective"])
    assert shapes["scores"] > 0
    assert saved == pytest.approx(L * shapes["scores"], rel=0.05), (saved, L * shapes["scores"])
    # and nothing else: parameters, gradients and optimizer states are unchanged
    for cat in ("params", "grads", "optim"):
        assert runs["selective"]["peak_bytes"]["0"]["cpu"][cat] == runs["naive"]["peak_bytes"]["0"]["cpu"][cat]


def test_act_offload_moves_boundaries_to_host(runs, shapes):
    L = shapes["cfg"].n_layer
    host = act(runs["offload"], "host")
    assert host == L * shapes["boundary"]  # every checkpoint input lives on the host
    assert act(runs["full"]) - act(runs["offload"]) >= (L - 1) * shapes["boundary"]


@pytest.mark.slow  # gpt_small in bf16: emulated matmuls on AVX2-only CPUs
def test_bf16_parameters_halve_parameter_bytes(runs, shapes, tmp_path):
    # only its model-state bytes are checked: one sequence
    base = [o for o in SMALL if not o.startswith("trainer.micro_batch_size")] + ["trainer.micro_batch_size=1"]
    runs = {**runs, "bf16p": train(base + ["+strategy=bf16", "strategy.bf16.params=bf16"], str(tmp_path / "bf16p"))}
    n = count_params(shapes["cfg"])
    assert runs["plain"]["peak_bytes"]["0"]["cpu"]["params"] == 4 * n
    assert runs["bf16p"]["peak_bytes"]["0"]["cpu"]["params"] == 2 * n
    # the fp32 master copy is an optimizer state (ZeRO's accounting): 4 (master) + 8 (moments)
    assert runs["bf16p"]["peak_bytes"]["0"]["cpu"]["optim"] >= 12 * n
    # gradients stay in bf16 (2 B/param, padding aside): the step converts them to fp32 one group at
    # a time, under `temp`, instead of holding an fp32 copy of all of them (which would be 6 B/param)
    grads = runs["bf16p"]["peak_bytes"]["0"]["cpu"]["grads"]
    assert 2 * n <= grads < 2 * n + 4096, (grads, 2 * n)
