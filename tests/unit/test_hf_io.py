"""Hugging Face checkpoints in and out, against ``transformers`` itself (nothing downloaded).

A tiny random ``GPT2LMHeadModel`` and ``LlamaForCausalLM`` are written with ``save_pretrained`` (once
whole, once sharded with an index); ``model.init_from=DIR`` then builds memopt's model from them
through the configuration path of ``python -m memopt.train`` and its logits must equal transformers'
(fp32, 1e-5). A one-step run at a learning rate too small to change an fp32 weight (1e-30) writes
model.pt, ``memopt.export`` turns it back into a directory, and ``from_pretrained`` of it gives
exactly the original logits. The refusals: a missing shard, a tensor of another shape, an unknown
architecture, a shape override that disagrees with config.json, a preset of the other family.
``slow``: the same round trip through ZeRO-3, the chunk engine, FSDP2 and tp on 2 ranks (each rank
fills only its part from the directory).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from memopt.errors import ConfigError
from tests.conftest import train, typed

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

RUN = ["trainer.micro_batch_size=2", "trainer.eval_every=0", "trainer.log_every=1", "data=synthetic",
       "data.synthetic_tokens=20000", "model.seq_len=32", "trainer.max_steps=1", "optim.lr=1e-30", "optim.warmup_steps=0",
       "trainer.save_checkpoint=true", "trainer.preflight=false"]


def _perturb(model):
    with torch.no_grad():  # non-trivial norm weights and biases (their init is ones and zeros)
        for name, p in model.named_parameters():
            if "norm" in name or "ln" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn(p.shape))
    return model.float().eval()


def gpt2(tied: bool = True):
    hc = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                 tie_word_embeddings=tied, attn_implementation="eager")
    torch.manual_seed(0)
    return _perturb(transformers.GPT2LMHeadModel(hc))


def llama(tied: bool = False):
    hc = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=88, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                  rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=tied,
                                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                                  attn_implementation="eager")
    torch.manual_seed(0)
    return _perturb(transformers.LlamaForCausalLM(hc))


FAMILIES = {"gpt2": (gpt2, "model=gpt_tiny"), "llama": (llama, "model=llama_tiny")}


def save(ref, d, shards: bool = False) -> str:
    ref.save_pretrained(d, max_shard_size="20KB" if shards else "5GB")
    return str(d)


def tokens(T: int = 24):
    return torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(1))


def memopt_model(overrides):
    from memopt.compose import materialize, model_on_meta
    from memopt.memory.tracker import NullTracker

    cfg = typed(overrides)
    model = model_on_meta(cfg, torch.device("cpu"), None, NullTracker())
    return materialize(model, torch.device("cpu"), torch.float32, cfg.seed).eval(), cfg


@pytest.mark.parametrize("shards", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_init_from_logits_equal_transformers(tmp_path, family, shards):
    make, preset = FAMILIES[family]
    ref = make()
    d = save(ref, tmp_path / "hf", shards)
    if shards:
        assert os.path.isfile(os.path.join(d, "model.safetensors.index.json"))
    model, cfg = memopt_model([preset, f"model.init_from={d}"])
    assert cfg.model.n_layer == 2 and cfg.model.d_model == 32  # the directory's shapes, not the preset's
    idx = tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], ref(input_ids=idx).logits, rtol=1e-5, atol=1e-5)


def test_gpt2_trains_a_shorter_context_than_its_positions(tmp_path):
    """A GPT-2 directory with n_positions=32 fine-tuned at model.seq_len=16 (GPT-2 fine-tuning at 512 of 1024 is
    common; it was refused): its position table's first 16 rows, so logits over 16 tokens equal transformers'; the
    directory's 32 when the command names none, and a longer context refused naming the most it allows."""
    ref = gpt2()
    d = save(ref, tmp_path / "hf")
    model, cfg = memopt_model(["model=gpt_tiny", f"model.init_from={d}", "model.seq_len=16"])
    assert cfg.model.seq_len == 16 and tuple(model.wpe.weight.shape) == (16, 32)
    idx = tokens(16)
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], ref(input_ids=idx).logits, rtol=1e-5, atol=1e-5)
    assert typed(["model=gpt_tiny", f"model.init_from={d}"]).model.seq_len == 32
    with pytest.raises(ConfigError, match=r"model.seq_len=64 is longer than .* n_positions \(32.*model.seq_len=32 or less"):
        typed(["model=gpt_tiny", f"model.init_from={d}", "model.seq_len=64"])


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("shards", [False, True], ids=["one_file", "sharded"])
def test_run_export_round_trip(tmp_path, family, shards):
    from memopt.export import main

    make, preset = FAMILIES[family]
    ref = make(tied=family == "llama")  # the other tying than the default: both layouts are met
    d = save(ref, tmp_path / "hf")
    run = tmp_path / "run"
    train([preset, f"model.init_from={d}", *RUN], str(run))
    assert main([str(run), str(tmp_path / "out"), *(["--max-shard-gb=0.00002"] if shards else [])]) == 0
    files = sorted(f for f in os.listdir(tmp_path / "out") if f.endswith(".safetensors"))
    if shards:  # 20 KB shards, as save_pretrained(max_shard_size="20KB") cuts them, with their index
        assert len(files) > 2 and os.path.isfile(tmp_path / "out" / "model.safetensors.index.json")
        assert all(os.path.getsize(tmp_path / "out" / f) < 20_000 + 200_000 for f in files)
    else:
        assert files == ["model.safetensors"]
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), attn_implementation="eager").eval()
    assert type(back) is type(ref) and back.dtype == torch.float32
    want = ref.state_dict()
    assert back.state_dict().keys() == want.keys()
    for k, v in back.state_dict().items():
        assert torch.equal(v, want[k]), k
    idx = tokens()
    with torch.no_grad():
        assert torch.equal(back(input_ids=idx).logits, ref(input_ids=idx).logits)


def test_export_of_a_seeded_run_loads(tmp_path):
    """A run that did not start from a directory (the seeded init) exports too: memopt's logits = transformers'."""
    import memopt
    from memopt.export import export

    run = tmp_path / "run"
    train(["model=llama_tiny", "model.d_model=32", "model.d_ff=88", *RUN], str(run))
    export(str(run), str(tmp_path / "out"))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).float().eval()
    mine = memopt.load_model(str(run))
    idx = tokens()
    with torch.no_grad():
        torch.testing.assert_close(mine(idx)[0], back(input_ids=idx).logits, rtol=1e-5, atol=1e-5)


# ---- refusals, before anything is allocated ------------------------------------------------------
def test_missing_shard_refused(tmp_path):
    d = save(gpt2(), tmp_path / "hf", shards=True)
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        shard = sorted(set(json.load(f)["weight_map"].values()))[-1]
    os.remove(os.path.join(d, shard))
    with pytest.raises(ConfigError, match=f"shard '{shard}'.*missing"):
        typed(["model=gpt_tiny", f"model.init_from={d}"])


def test_wrong_shape_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    d = save(llama(), tmp_path / "hf")
    f = os.path.join(d, "model.safetensors")
    state = load_file(f)
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(80, 32)
    save_file(state, f, metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"tensor 'model.layers.1.mlp.up_proj.weight' has shape \(80, 32\)"):
        typed(["model=llama_tiny", f"model.init_from={d}"])


def test_missing_and_extra_tensors_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    d = save(gpt2(), tmp_path / "hf")
    f = os.path.join(d, "model.safetensors")
    state = load_file(f)
    state["transformer.h.0.extra.weight"] = state.pop("transformer.h.0.mlp.c_fc.weight")
    save_file(state, f, metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="no tensor 'transformer.h.0.mlp.c_fc.weight'"):
        typed(["model=gpt_tiny", f"model.init_from={d}"])


@pytest.mark.parametrize("field,value", [("architectures", ["MistralForCausalLM"]), ("model_type", "mistral")])
def test_unknown_architecture_refused(tmp_path, field, value):
    d = save(llama(), tmp_path / "hf")
    with open(os.path.join(d, "config.json")) as f:
        hf = json.load(f)
    hf[field] = value
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(hf, f)
    with pytest.raises(ConfigError, match=f"config.json {field}="):
        typed(["model=llama_tiny", f"model.init_from={d}"])


def test_disagreeing_override_refused(tmp_path):
    d = save(llama(), tmp_path / "hf")
    with pytest.raises(ConfigError, match="model.d_model=48 disagrees with model.init_from"):
        typed(["model=llama_tiny", "model.d_model=48", f"model.init_from={d}"])
    with pytest.raises(ConfigError, match="model.n_layer=3 disagrees"):
        typed(["model=llama_tiny", "model.n_layer=3", f"model.init_from={d}"])
    cfg = typed(["model=llama_tiny", "model.n_layer=2", "model.seq_len=48", f"model.init_from={d}"])  # agrees; seq_len is the run's
    assert (cfg.model.n_layer, cfg.model.seq_len, cfg.model.d_model) == (2, 48, 32)
    # typed as the preset has it (llama_tiny's d_ff is 176): still the command's, refused (it was taken for the preset's
    # and the directory's 88 trained without a word); the preset's value not typed gives way to the directory's
    with pytest.raises(ConfigError, match="model.d_ff=176 disagrees"):
        typed(["model=llama_tiny", "model.d_ff=176", f"model.init_from={d}"])
    assert typed(["model=llama_tiny", f"model.init_from={d}"]).model.d_ff == 88


def test_other_family_refused(tmp_path):
    d = save(gpt2(), tmp_path / "hf")
    with pytest.raises(ConfigError, match="GPT-2 checkpoint but model=llama_tiny"):
        typed(["model=llama_tiny", f"model.init_from={d}"])


def test_moe_refused(tmp_path):
    d = save(gpt2(), tmp_path / "hf")
    with pytest.raises(ConfigError, match="changes the architecture"):
        typed(["model=gpt_tiny", f"model.init_from={d}", "+strategy=moe"])


# ---- every engine fills its own part from the directory ------------------------------------------
@pytest.mark.slow
def test_partitioned_engines_round_trip(tmp_path):
    """ZeRO-3, the chunk engine, FSDP2 and tp on 2 ranks (one launch): each rank fills its shards or chunks
    from the sharded directory; the exported weights are the directory's, exactly."""
    from memopt.api import run_jobs_on_ranks
    from memopt.export import export

    jobs, refs = [], {}
    for family, (make, preset) in FAMILIES.items():
        refs[family] = make()
        d = save(refs[family], tmp_path / family, shards=True)
        for name, strategy in (("zero3", ["+strategy=zero3"]), ("chunk", ["+strategy=chunk"]),
                               ("fsdp2", ["+strategy=zero3", "engine=fsdp2"]),
                               ("tp", ["+strategy=tp", "parallel.tp=2"])):
            jobs.append(([preset, f"model.init_from={d}", *RUN, *strategy, "logger=none", "trainer.progress_bar=false",
                          "trainer.device=cpu"], str(tmp_path / f"{family}-{name}")))
    summaries = run_jobs_on_ranks(2, jobs)
    for (_, run), s in zip(jobs, summaries):
        assert s["status"] == "ok" and s.get("world_size", 2) == 2, (run, s)
        family = os.path.basename(run).split("-")[0]
        export(run, run + "-hf")
        back = transformers.AutoModelForCausalLM.from_pretrained(run + "-hf")
        want = refs[family].state_dict()
        for k, v in back.state_dict().items():
            assert torch.equal(v, want[k]), (run, k)
