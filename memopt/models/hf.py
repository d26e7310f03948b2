"""Hugging Face ``transformers`` checkpoints <-> memopt's models: parameter names and configs.

The mapping only: which memopt parameter a Hugging Face tensor is, and which ``ModelConfig`` fields a
``config.json`` gives. It needs no ``transformers`` import (a checkpoint directory is plain JSON and
safetensors), so the loader that streams a directory tensor by tensor into an engine builds on it,
and the tests check it against ``transformers``' own classes.

Llama (``LlamaForCausalLM``): the tensors have the same shapes and layouts in both (memopt's rotary
positions pair dimensions (i, i + D/2) as Hugging Face's do, so q and k need no permutation); only the
names differ:

    model.embed_tokens.weight                         wte.weight
    model.layers.{i}.input_layernorm.weight           blocks.{i}.attn_norm.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj.*       blocks.{i}.attn.{q,k,v,o}_proj.*
    model.layers.{i}.post_attention_layernorm.weight  blocks.{i}.mlp_norm.weight
    model.layers.{i}.mlp.{gate,up,down}_proj.*        blocks.{i}.mlp.{gate,up,down}_proj.*
    model.norm.weight                                 norm.weight
    lm_head.weight                                    lm_head.weight (absent when tied: wte.weight)
"""
from __future__ import annotations

import re

import torch

from memopt.errors import ConfigError

_LLAMA_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm",
                "self_attn": "attn", "mlp": "mlp"}
_LLAMA_ROOT = {"model.embed_tokens.weight": "wte.weight", "model.norm.weight": "norm.weight",
               "lm_head.weight": "lm_head.weight"}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(input_layernorm|post_attention_layernorm|self_attn|mlp)\.(.+)")
_PROJ = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def llama_name(hf_name: str) -> str:
    """The memopt Llama parameter that the Hugging Face tensor ``hf_name`` is; ConfigError naming it otherwise."""
    if hf_name in _LLAMA_ROOT:
        return _LLAMA_ROOT[hf_name]
    m = _LAYER.fullmatch(hf_name)
    if m:
        i, part, rest = m.groups()
        if part in _PROJ:
            proj, _, leaf = rest.partition(".")
            ok = proj in _PROJ[part] and leaf in ("weight", "bias")
        else:
            ok = rest == "weight"
        if ok:
            return f"blocks.{i}.{_LLAMA_BLOCK[part]}.{rest}"
    raise ConfigError(f"tensor {hf_name!r} is not a parameter of a Llama (LlamaForCausalLM) checkpoint")


def hf_llama_name(name: str) -> str:
    """The inverse of ``llama_name``: the Hugging Face name of memopt Llama parameter ``name``."""
    inverse = {v: k for k, v in _LLAMA_ROOT.items()}
    if name in inverse:
        return inverse[name]
    back = {v: k for k, v in _LLAMA_BLOCK.items()}
    m = re.fullmatch(r"blocks\.(\d+)\.(attn_norm|mlp_norm|attn|mlp)\.(.+)", name)
    if not m:
        raise ConfigError(f"parameter {name!r} is not one of memopt's Llama")
    i, part, rest = m.groups()
    return f"model.layers.{i}.{back[part]}.{rest}"


# tensors a checkpoint may carry that are no parameters (buffers older transformers versions saved)
BUFFERS = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


def normalise(arch: str, name: str) -> str:
    """GPT-2 directories written from ``GPT2Model`` (the original hub checkpoint) lack the ``transformer.`` prefix."""
    if arch == "gpt" and not name.startswith(("transformer.", "lm_head.")):
        return f"transformer.{name}"
    return name


# learned position tables: a run with a shorter context than the checkpoint's takes their first rows (positions
# 0 .. seq_len - 1 are the same positions)
POSITION_TABLES = ("wpe.weight",)


def positions_cut(name: str, t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` as the model's parameter ``name`` holds it: a position table's first ``rows`` rows."""
    return t[:rows] if name in POSITION_TABLES and t.shape[0] > rows else t


def match(cfg, expected: dict[str, tuple[int, ...]], found: dict[str, tuple[str, tuple[int, ...]]],
          where: str) -> dict[str, tuple[str, bool]]:
    """memopt parameter -> (the checkpoint's tensor name, transposed), after every check, whatever holds the
    tensors (a directory's headers, a state dict): every parameter of ``expected`` (name -> shape) present
    in ``found`` (normalised Hugging Face name -> (its name, shape)) with its shape, no tensor left over
    (buffers and a tied head's ``lm_head.weight`` aside). Refusals name the tensor; ``where``: what holds them."""
    out = {}
    for name, shape in expected.items():
        want, transposed = hf_name(cfg.arch, name)
        if want not in found:
            raise ConfigError(f"{where} has no tensor {want!r} (memopt's {name})")
        n, have = found[want]
        hf_shape = tuple(reversed(shape)) if transposed else tuple(shape)
        if tuple(have) != hf_shape and not (name in POSITION_TABLES and have[1:] == hf_shape[1:] and have[0] >= hf_shape[0]):
            raise ConfigError(f"{where}: tensor {n!r} has shape {tuple(have)}; the model ({cfg.name}) expects {hf_shape}")
        out[name] = (n, transposed)
    used = {v[0] for v in out.values()}
    for key, (n, _) in sorted(found.items()):
        if n in used or n.endswith(BUFFERS) or (cfg.tie_embeddings and key == "lm_head.weight"):
            continue
        raise ConfigError(f"{where}: tensor {n!r} has no place in the model ({cfg.name})")
    return out


@torch.no_grad()
def load_state(model, hf_state: dict[str, torch.Tensor]) -> None:
    """Copy a Hugging Face GPT-2 or Llama state dict into memopt's model (whole, on one process), after
    ``match``'s checks: a refused state changes nothing."""
    arch = model.cfg.arch
    found = {normalise(arch, k): (k, tuple(v.shape)) for k, v in hf_state.items()}
    params = dict(model.named_parameters())  # tied head: only wte.weight
    plan = match(model.cfg, {n: tuple(p.shape) for n, p in params.items()}, found, "the checkpoint")
    for name, (n, transposed) in plan.items():
        t = hf_state[n]
        params[name].copy_(positions_cut(name, t.t() if transposed else t, params[name].shape[0]))


def llama_config_from_hf(hf: dict) -> dict:
    """``ModelConfig`` fields from a Llama ``config.json`` (a dict): its shapes and rotary settings.
    Both spellings of the rotary settings are read (``rope_theta`` + ``rope_scaling`` of transformers
    4, ``rope_parameters`` of 5). What memopt's Llama cannot express is refused naming the key."""
    if hf.get("model_type", "llama") != "llama":
        raise ConfigError(f"config.json model_type={hf.get('model_type')!r} is not a Llama (model_type llama)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json hidden_act={hf['hidden_act']!r}: memopt's Llama has SwiGLU (silu) only")
    C, H = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, C // H):
        raise ConfigError(f"config.json head_dim={hf['head_dim']}: memopt's Llama has head_dim = hidden_size / "
                          f"num_attention_heads = {C // H}")
    if hf.get("attention_bias", False) != hf.get("mlp_bias", False):
        raise ConfigError(f"config.json attention_bias={hf.get('attention_bias')} and mlp_bias={hf.get('mlp_bias')}: "
                          "memopt's model.bias puts biases on every Linear or none")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise ConfigError(f"config.json rope_type={kind!r}: memopt's Llama has the default and llama3 rotary scalings")
    out = dict(arch="llama", n_layer=hf["num_hidden_layers"], n_head=H,
               n_kv_head=hf.get("num_key_value_heads") or H, d_model=C, d_ff=hf["intermediate_size"],
               vocab_size=hf["vocab_size"], pos_emb="rope", bias=bool(hf.get("attention_bias", False)),
               tie_embeddings=bool(hf.get("tie_word_embeddings", False)), ln_eps=float(hf.get("rms_norm_eps", 1e-6)),
               rope_theta=float(theta), rope_scaling=None)
    if kind == "llama3":
        out.update(rope_scaling="llama3", rope_factor=float(rope["factor"]),
                   rope_low_freq_factor=float(rope["low_freq_factor"]),
                   rope_high_freq_factor=float(rope["high_freq_factor"]),
                   rope_original_max_pos=int(rope["original_max_position_embeddings"]))
    return out


# ---- GPT-2 (GPT2LMHeadModel) ----------------------------------------------------------------------
# Same tensors, other names; GPT-2's projections are ``Conv1D`` modules whose weight is (in, out), the
# transpose of ``nn.Linear``'s (out, in): those four are transposed on the way in and out.
#
#     transformer.wte.weight / wpe.weight                 wte.weight / wpe.weight
#     transformer.h.{i}.ln_1.* / ln_2.*                   blocks.{i}.ln1.* / ln2.*
#     transformer.h.{i}.attn.c_attn.* / attn.c_proj.*     blocks.{i}.attn.qkv.* / attn.proj.*   (weights transposed)
#     transformer.h.{i}.mlp.c_fc.* / mlp.c_proj.*         blocks.{i}.mlp.fc.* / mlp.proj.*      (weights transposed)
#     transformer.ln_f.*                                  ln_f.*
#     lm_head.weight                                      lm_head.weight (absent when tied: wte.weight)
_GPT2_BLOCK = {"ln1": "ln_1", "ln2": "ln_2", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj",
               "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}
_GPT2_CONV1D = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")


def hf_gpt2_name(name: str) -> tuple[str, bool]:
    """The Hugging Face name of memopt GPT parameter ``name`` and whether its layout is transposed (Conv1D)."""
    if name == "lm_head.weight":
        return name, False
    if name in ("wte.weight", "wpe.weight") or name.startswith("ln_f."):
        return f"transformer.{name}", False
    m = re.fullmatch(r"blocks\.(\d+)\.(ln1|ln2|attn\.qkv|attn\.proj|mlp\.fc|mlp\.proj)\.(weight|bias)", name)
    if not m:
        raise ConfigError(f"parameter {name!r} has no GPT-2 (GPT2LMHeadModel) counterpart")
    i, part, leaf = m.groups()
    return f"transformer.h.{i}.{_GPT2_BLOCK[part]}.{leaf}", part in _GPT2_CONV1D and leaf == "weight"


def hf_name(arch: str, name: str) -> tuple[str, bool]:
    """(Hugging Face name, transposed) of memopt parameter ``name`` of model family ``arch``."""
    if arch == "llama":
        return hf_llama_name(name), False
    if arch == "gpt":
        return hf_gpt2_name(name)
    raise ConfigError(f"model.arch={arch!r} has no Hugging Face layout here (gpt: GPT2LMHeadModel, llama: LlamaForCausalLM)")


def gpt2_config_from_hf(hf: dict) -> dict:
    """``ModelConfig`` fields from a GPT-2 ``config.json``; what memopt's GPT cannot compute is refused naming the key."""
    if hf.get("model_type", "gpt2") != "gpt2":
        raise ConfigError(f"config.json model_type={hf.get('model_type')!r} is not GPT-2 (model_type gpt2)")
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ConfigError(f"config.json activation_function={act!r}: memopt's GPT has the tanh GELU only "
                          "(gelu_new, gelu_pytorch_tanh)")
    if hf.get("scale_attn_by_inverse_layer_idx", False) or not hf.get("scale_attn_weights", True):
        raise ConfigError("config.json scale_attn_weights/scale_attn_by_inverse_layer_idx: memopt's GPT scales "
                          "attention scores by 1/sqrt(head dim) only (scale_attn_weights true, by_inverse_layer_idx false)")
    C = hf["n_embd"]
    return dict(arch="gpt", n_layer=hf["n_layer"], n_head=hf["n_head"], n_kv_head=None, d_model=C,
                d_ff=hf.get("n_inner") or 4 * C, seq_len=hf["n_positions"], vocab_size=hf["vocab_size"],
                pos_emb="learned", bias=True, tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
                ln_eps=float(hf.get("layer_norm_epsilon", 1e-5)), rope_scaling=None)


# config.json architectures/model_type -> memopt's model.arch
HF_FAMILIES = {"GPT2LMHeadModel": "gpt", "LlamaForCausalLM": "llama"}
HF_MODEL_TYPES = {"gpt2": "gpt", "llama": "llama"}


def family_of(hf: dict) -> str:
    """memopt's ``model.arch`` for a ``config.json`` (a dict); ConfigError naming the field otherwise."""
    archs = hf.get("architectures") or []
    for a in archs:
        if a not in HF_FAMILIES:
            raise ConfigError(f"config.json architectures={archs}: {a!r} is not one memopt reads "
                              f"(one of: {', '.join(HF_FAMILIES)})")
    mt = hf.get("model_type")
    if mt is None and not archs:
        raise ConfigError("config.json has neither architectures nor model_type: the architecture is unknown")
    if mt is not None and mt not in HF_MODEL_TYPES:
        raise ConfigError(f"config.json model_type={mt!r} is not one memopt reads (one of: {', '.join(HF_MODEL_TYPES)})")
    fams = {HF_FAMILIES[a] for a in archs} | ({HF_MODEL_TYPES[mt]} if mt else set())
    if len(fams) != 1:
        raise ConfigError(f"config.json architectures={archs} and model_type={mt!r} disagree")
    return fams.pop()


def config_from_hf(hf: dict) -> dict:
    """``ModelConfig`` fields of a GPT-2 or Llama ``config.json`` (a dict)."""
    return gpt2_config_from_hf(hf) if family_of(hf) == "gpt" else llama_config_from_hf(hf)


def hf_config(cfg) -> dict:
    """The ``config.json`` that ``transformers`` builds memopt model config ``cfg`` from (export)."""
    if cfg.arch == "gpt":
        if cfg.pos_emb != "learned" or not cfg.bias:
            raise ConfigError(f"model {cfg.name}: pos_emb={cfg.pos_emb}, bias={cfg.bias}; GPT-2 (GPT2LMHeadModel) has "
                              "learned positions and biases")
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
                "n_positions": cfg.seq_len, "n_embd": cfg.d_model, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
                "n_inner": cfg.ff, "activation_function": "gelu_new", "layer_norm_epsilon": cfg.ln_eps,
                "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
                "scale_attn_weights": True, "tie_word_embeddings": cfg.tie_embeddings, "dtype": "float32",
                # GPT2Config's defaults name GPT-2's <|endoftext|> (50256); a smaller vocabulary has no such token
                **({} if cfg.vocab_size > 50256 else {"bos_token_id": None, "eos_token_id": None})}
    if cfg.arch == "llama":
        rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
        scaling = None
        if cfg.rope_scaling == "llama3":
            scaling = {"rope_type": "llama3", "factor": cfg.rope_factor, "low_freq_factor": cfg.rope_low_freq_factor,
                       "high_freq_factor": cfg.rope_high_freq_factor,
                       "original_max_position_embeddings": cfg.rope_original_max_pos}
            rope = {**scaling, "rope_theta": cfg.rope_theta}
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.d_model, "intermediate_size": cfg.ff, "num_hidden_layers": cfg.n_layer,
                "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
                "hidden_act": "silu", "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.ln_eps,
                "rope_theta": cfg.rope_theta, "rope_scaling": scaling, "rope_parameters": rope,
                "attention_bias": cfg.bias, "mlp_bias": cfg.bias, "attention_dropout": cfg.dropout,
                "tie_word_embeddings": cfg.tie_embeddings, "dtype": "float32"}
    raise ConfigError(f"model.arch={cfg.arch!r}: export writes GPT-2 (arch gpt) and Llama (arch llama) only")
