"""The GPT's logits against an independent float64 re-implementation of the same math."""
from __future__ import annotations

import math

import pytest
import torch

from memopt.compose import materialize
from memopt.models.gpt import GPT, GPTConfig, count_params, flops_per_token


def reference_logits(sd: dict, cfg: GPTConfig, idx: torch.Tensor) -> torch.Tensor:
    """Written from the GPT-2 paper's equations, in float64, with no torch.nn module."""
    sd = {k: v.double() for k, v in sd.items()}
    B, T = idx.shape
    H, D = cfg.n_head, cfg.d_model // cfg.n_head

    def ln(x, w, b):
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + cfg.ln_eps) * w + b

    def gelu(x):
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))

    x = sd["wte.weight"][idx]
    if cfg.pos_emb == "learned":
        x = x + sd["wpe.weight"][:T]
    for i in range(cfg.n_layer):
        p = f"blocks.{i}."
        h = ln(x, sd[p + "ln1.weight"], sd[p + "ln1.bias"])
        qkv = h @ sd[p + "attn.qkv.weight"].T + sd[p + "attn.qkv.bias"]
        q, k, v = [t.reshape(B, T, H, D).permute(0, 2, 1, 3) for t in qkv.split(cfg.d_model, -1)]
        if cfg.pos_emb == "rope":
            pos = torch.arange(T, dtype=torch.float64)
            freq = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
            ang = pos[:, None] * freq[None]
            c, s = ang.cos(), ang.sin()

            def rot(t):
                a, b = t[..., 0::2], t[..., 1::2]
                return torch.stack((a * c - b * s, a * s + b * c), -1).flatten(-2)

            q, k = rot(q), rot(k)
        scores = q @ k.transpose(-1, -2) / math.sqrt(D)
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
        att = torch.softmax(scores.masked_fill(mask, -math.inf), -1) @ v
        att = att.permute(0, 2, 1, 3).reshape(B, T, cfg.d_model)
        x = x + att @ sd[p + "attn.proj.weight"].T + sd[p + "attn.proj.bias"]
        h = ln(x, sd[p + "ln2.weight"], sd[p + "ln2.bias"])
        x = x + gelu(h @ sd[p + "mlp.fc.weight"].T + sd[p + "mlp.fc.bias"]) @ sd[p + "mlp.proj.weight"].T + sd[p + "mlp.proj.bias"]
    x = ln(x, sd["ln_f.weight"], sd["ln_f.bias"])
    return x @ sd["wte.weight"].T


@pytest.mark.parametrize("attention", ["sdpa", "naive"])
@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_logits_match_reference(attention, pos_emb):
    cfg = GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16, vocab_size=64, attention=attention, pos_emb=pos_emb)
    model = GPT(cfg)
    model.init_weights(seed=1)
    idx = torch.randint(0, 64, (3, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for p in model.parameters():  # non-trivial LayerNorm and bias values
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        logits, _ = model(idx)
    ref = reference_logits(model.state_dict(), cfg, idx)
    torch.testing.assert_close(logits.double(), ref, rtol=1e-5, atol=1e-5)


def test_loss_is_cross_entropy_of_logits():
    cfg = GPTConfig(n_layer=1, n_head=2, d_model=16, seq_len=8, vocab_size=32)
    model = GPT(cfg)
    idx = torch.randint(0, 32, (2, 8))
    logits, loss = model(idx, idx)
    ref = -torch.log_softmax(logits.double(), -1).gather(-1, idx[..., None]).mean()
    assert abs(loss.item() - ref.item()) < 1e-6


def test_init_is_a_function_of_the_seed_alone():
    cfg = GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16, vocab_size=64)
    a, b = GPT(cfg), GPT(cfg)
    a.init_weights(7)
    torch.manual_seed(123)  # the global RNG must not matter
    with torch.device("meta"):
        c = GPT(cfg)
    materialize(c, torch.device("cpu"), torch.float32, seed=7)
    b.init_weights(8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sc[k]) for k in sa)
    assert not torch.equal(sa["blocks.0.attn.qkv.weight"], sb["blocks.0.attn.qkv.weight"])
    assert c.lm_head.weight is c.wte.weight  # tying survives materialisation
    # GPT-2 init statistics
    w = GPT(GPTConfig(n_layer=4, d_model=256, n_head=4))
    w.init_weights(0)
    assert abs(w.blocks[0].mlp.fc.weight.std().item() - 0.02) < 0.002
    assert abs(w.blocks[0].mlp.proj.weight.std().item() - 0.02 / math.sqrt(8)) < 0.001
    assert torch.all(w.blocks[0].ln1.weight == 1) and torch.all(w.blocks[0].attn.qkv.bias == 0)


def test_flops_per_token_formula():
    cfg = GPTConfig(n_layer=12, n_head=12, d_model=768, seq_len=1024, vocab_size=50304)
    n = count_params(cfg) - 1024 * 768
    assert flops_per_token(cfg) == 6 * n + 12 * 12 * 768 * 1024
    # GPT-2 small: ~124M parameters with the padded vocabulary
    assert 123e6 < count_params(cfg) < 125e6
