"""memopt's Llama against transformers' own LlamaForCausalLM (same weights: logits, loss, gradients),
its counts against formulas written here from the architecture, and its config rules.

Nothing is downloaded: the reference model is built from a LlamaConfig with random weights."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from memopt.errors import ConfigError
from memopt.models import model_class
from memopt.models.base import ModelConfig
from memopt.models.hf import hf_llama_name, llama_config_from_hf, llama_name, load_state
from memopt.models.llama import Llama, rope_cache, rope_frequencies
from tests.conftest import typed

transformers = pytest.importorskip("transformers")

# the shapes of conf/model/llama_tiny.yaml; original context 64 puts the 8 frequencies of head dim 16
# in all three bands of the llama3 scaling (kept, interpolated, divided by the factor)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
CASES = {  # name -> LlamaConfig keyword arguments
    "gqa_llama3_untied": dict(num_key_value_heads=2, rope_scaling=LLAMA3, tie_word_embeddings=False),
    "mha_tied_bias": dict(num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    "mqa_untied": dict(num_key_value_heads=1, tie_word_embeddings=False),
}


def hf_pair(case: str, attention: str = "sdpa"):
    """A random transformers Llama and memopt's Llama holding the same weights (through memopt.models.hf)."""
    kw = dict(CASES[case])
    scaling = kw.pop("rope_scaling", None)
    hc = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=128, rope_theta=500000.0,
                                  rms_norm_eps=1e-5, rope_scaling=scaling, attn_implementation="eager", **kw)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(hc).float().eval()
    with torch.no_grad():  # non-trivial norm weights and biases (their init is ones and zeros)
        for name, p in ref.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn(p.shape))
    fields = llama_config_from_hf(hc.to_dict())
    cfg = ModelConfig(name=case, seq_len=128, attention=attention, **fields)
    Llama.validate(cfg)
    model = Llama(cfg).eval()
    load_state(model, ref.state_dict())
    return ref, model


def batch(T: int = 40):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (3, T), generator=g), torch.randint(0, 256, (3, T), generator=g)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_loss_and_gradients_equal_transformers(case):
    ref, model = hf_pair(case)
    idx, tgt = batch()
    want = ref(input_ids=idx).logits
    logits, loss = model(idx, tgt)
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    ref_loss = F.cross_entropy(want.view(-1, 256), tgt.reshape(-1))
    assert abs(loss.item() - ref_loss.item()) < 1e-5
    loss.backward()
    ref_loss.backward()
    hf = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        g = hf[hf_llama_name(name)].grad
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_naive_core_equals_transformers():
    ref, model = hf_pair("gqa_llama3_untied", attention="naive")
    idx, _ = batch(17)
    torch.testing.assert_close(model(idx)[0], ref(input_ids=idx).logits, rtol=1e-5, atol=1e-5)


def test_rope_frequencies_are_transformers_llama3_scaling():
    ref, model = hf_pair("gqa_llama3_untied")
    ours = rope_frequencies(model.cfg).float()
    torch.testing.assert_close(ours, ref.model.rotary_emb.inv_freq, rtol=1e-6, atol=0)
    plain = 1.0 / 500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    wavelen = 2 * math.pi / plain
    # each band of the llama3 rule occurs: kept (< 64/4), interpolated, divided by 8 (> 64/1)
    kept, scaled = wavelen < 16, wavelen > 64
    assert kept.any() and scaled.any() and (~kept & ~scaled).any()
    torch.testing.assert_close(ours.double()[kept], plain[kept])
    torch.testing.assert_close(ours.double()[scaled], plain[scaled] / 8)
    cos, sin = rope_cache(model.cfg, 5, "cpu")
    assert cos.shape == (5, 16) and torch.equal(cos[:, :8], cos[:, 8:])


def test_names_map_both_ways_and_unknown_tensors_are_named():
    _, model = hf_pair("gqa_llama3_untied")
    for name, _ in model.named_parameters():
        assert llama_name(hf_llama_name(name)) == name
    with pytest.raises(ConfigError, match="model.layers.0.self_attn.qkv.weight"):
        llama_name("model.layers.0.self_attn.qkv.weight")
    ref, model = hf_pair("mqa_untied")
    state = ref.state_dict()
    up = state["model.layers.1.mlp.up_proj.weight"]
    state["model.layers.1.mlp.up_proj.weight"] = up[:100]
    before = model.wte.weight.clone()
    with pytest.raises(ConfigError, match=r"model.layers.1.mlp.up_proj.weight.*\(100, 64\).*\(176, 64\)"):
        load_state(model, torch.nn.Module.state_dict(ref) | {"model.layers.1.mlp.up_proj.weight": up[:100],
                                                                    "model.embed_tokens.weight": up.new_zeros(256, 64)})
    assert torch.equal(model.wte.weight, before)  # refused before anything was copied
    state["model.layers.1.mlp.up_proj.weight"] = up
    state["model.layers.1.mlp.extra.weight"] = up
    with pytest.raises(ConfigError, match="model.layers.1.mlp.extra.weight"):
        load_state(model, state)
    del state["model.layers.1.mlp.extra.weight"], state["model.norm.weight"]
    with pytest.raises(ConfigError, match="model.norm.weight"):
        load_state(model, state)


# ---- counts from the architecture, written here independently of memopt/models/llama.py ------------

def params_formula(L, C, H, K, F_, V, tied, bias=False):
    """Per layer: q and o are C x C, k and v C x (K C / H), three C x F matrices for SwiGLU, two norms."""
    kv = K * C // H
    layer = 2 * C * C + 2 * C * kv + 3 * C * F_ + 2 * C + (bias and (C + 2 * kv + C + 2 * F_ + C))
    return L * layer + V * C * (1 if tied else 2) + C


PUBLISHED = {  # preset -> (layers, width, heads, kv heads, ffn, vocab, tied, Meta's published size)
    "llama3_1b": (16, 2048, 32, 8, 8192, 128256, True, 1.24e9),
    "llama3_8b": (32, 4096, 32, 8, 14336, 128256, False, 8.03e9),
    "llama3_70b": (80, 8192, 64, 8, 28672, 128256, False, 70.6e9),
}


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_presets_have_the_published_shapes_and_sizes(preset):
    L, C, H, K, F_, V, tied, size = PUBLISHED[preset]
    m = typed([f"model={preset}"]).model
    assert (m.arch, m.n_layer, m.d_model, m.n_head, m.n_kv_head, m.d_ff, m.vocab_size, m.tie_embeddings) == \
        ("llama", L, C, H, K, F_, V, tied)
    assert (m.rope_theta, m.rope_scaling, m.rope_factor, m.rope_original_max_pos) == \
        (500000.0, "llama3", 32.0 if preset == "llama3_1b" else 8.0, 8192)
    n = params_formula(L, C, H, K, F_, V, tied)
    with torch.device("meta"):
        model = Llama(m)
    assert Llama.num_params(m) == n == sum(p.numel() for p in model.parameters())
    assert round(n / 10 ** (len(str(n)) - 3)) == round(size / 10 ** (len(str(n)) - 3))  # 3 significant digits
    if preset == "llama3_8b":
        assert n == 8_030_261_248


def test_flops_per_token_formula():
    m = typed(["model=llama3_8b"]).model
    L, C, T, V = 32, 4096, 8192, 128256
    matmul_params = params_formula(32, 4096, 32, 8, 14336, V, tied=False) - V * C  # the embedding is a lookup
    assert Llama.flops_per_token(m) == 6 * matmul_params + 12 * L * C * T
    tied = typed(["model=llama3_1b"]).model  # tied: the one matrix is the output layer's
    assert Llama.flops_per_token(tied) == 6 * Llama.num_params(tied) + 12 * 16 * 2048 * 8192


def saved_bytes_of_one_block(cfg: ModelConfig, B: int, dtype) -> int:
    """Bytes of the distinct storages autograd saves in one block's forward, parameters and the
    rotary tables (shared by every block) excluded."""
    model = Llama(cfg).to(dtype)
    model.init_weights(0)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    rope = rope_cache(cfg, cfg.seq_len, "cpu")
    skip = params | {t.untyped_storage().data_ptr() for t in rope}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    x = torch.randn(B, cfg.seq_len, cfg.d_model, dtype=dtype, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.blocks[0](x, rope)
    return sum(seen.values())


@pytest.mark.parametrize("dtype, nbytes", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_activation_bytes_per_layer(dtype, nbytes):
    """Per token: two RMSNorms (an fp32 input, the normalised value and the output each, 1/rms in
    fp32), q and k after rotation and v (C + 2 C K / H), the attention output (C) and its
    log-sum-exp (H fp32), SwiGLU's gate, silu(gate), up and product (4 F)."""
    cfg = typed(["model=llama_tiny", "model.seq_len=32"]).model
    B, T, C, H, K, F_ = 2, 32, 64, 4, 2, 176
    per_token = 2 * (4 * C + 2 * C * nbytes + 4) + nbytes * (C + 2 * C * K // H + C + 4 * F_) + 4 * H
    want = B * T * per_token
    assert Llama.activation_bytes(cfg, B, nbytes) == want
    assert saved_bytes_of_one_block(cfg, B, dtype) == want


# ---- config rules ------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, needles", [
    (["model.n_kv_head=3"], ["model.n_kv_head=3", "model.n_head=4", "[1, 2, 4]"]),
    (["model.n_head=3"], ["model.d_model=64", "model.n_head=3"]),
    (["model.pos_emb=learned"], ["model.pos_emb='learned'", "rope"]),
    (["model.rope_scaling=yarn"], ["model.rope_scaling='yarn'", "llama3"]),
    (["model.rope_low_freq_factor=4", "model.rope_high_freq_factor=1"], ["model.rope_low_freq_factor=4", "0 < low < high"]),
    (["model.rope_factor=0.5"], ["model.rope_factor=0.5"]),
    (["model.d_ff=0"], ["model.d_ff=0"]),
    (["model.dropout=-0.1"], ["model.dropout=-0.1", "[0, 1)"]),
    (["model.attention=flash"], ["+strategy=flash_attn"]),
])
def test_bad_shapes_are_refused_naming_the_field(overrides, needles):
    with pytest.raises(ConfigError) as e:
        typed(["model=llama_tiny", *overrides])
    for n in needles:
        assert n in str(e.value), (n, str(e.value))


@pytest.mark.parametrize("overrides, needle", [
    (["model.n_kv_head=2"], "model.arch=llama"),
    (["model.rope_scaling=llama3", "model.pos_emb=rope"], "model.arch=llama"),
])
def test_gpt_refuses_llama_fields(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        typed(["model=gpt_tiny", *overrides])


def test_model_class_of_presets():
    assert model_class(typed(["model=llama_tiny"]).model) is Llama
