"""Config composition: every model composes, bad inputs fail early with the field named."""
from __future__ import annotations

import os

import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf.errors import ValidationError

from memopt.config import ConfigError
from memopt.models import model_class
from tests.conftest import CONF, compose, typed

MODELS = sorted(f[:-5] for f in os.listdir(os.path.join(CONF, "model")))
# Published sizes (GPT-2 / GPT-3 papers, with the 50304-padded vocabulary), in millions.
EXPECTED_M = {"gpt_small": (20, 30), "gpt_125m": (120, 130), "gpt_350m": (345, 365), "gpt_1b": (1250, 1400), "gpt_10b": (9800, 10500),
              # Meta's model cards: Llama 3.2 1B 1.24B, Llama 3.1 8B 8.03B, 70B 70.6B (tests/unit/test_llama.py: exact)
              "llama3_1b": (1235, 1245), "llama3_8b": (8025, 8035), "llama3_70b": (70550, 70650)}


@pytest.mark.parametrize("name", MODELS)
def test_every_model_composes_and_counts(name):
    cfg = typed([f"model={name}"])
    assert cfg.model.name == name
    cls = model_class(cfg.model)
    n = cls.num_params(cfg.model)
    # num_params is a formula; check it against PyTorch's own count on a meta-device model
    import torch

    with torch.device("meta"):
        model = cls(cfg.model)
    assert n == sum(p.numel() for p in model.parameters())
    if name in EXPECTED_M:
        lo, hi = EXPECTED_M[name]
        assert lo <= n / 1e6 <= hi, f"{name} has {n / 1e6:.1f}M parameters"


def test_default_is_plain_tiny_run():
    cfg = typed()
    assert cfg.model.name == "gpt_tiny" and cfg.strategy.selected() == [] and cfg.engine.name == "memopt"
    assert cfg.data.name == "pydoc" and cfg.logger.name == "wandb"


def test_unknown_model_lists_options():
    with pytest.raises(MissingConfigException) as e:
        compose(["model=gpt_nope"])
    assert "gpt_nope" in str(e.value) and "gpt_tiny" in str(e.value)


def test_unknown_strategy_lists_available():
    with pytest.raises(MissingConfigException) as e:
        compose(["+strategy=zero9"])
    msg = str(e.value)
    assert "strategy/zero9" in msg and "fp16" in msg and "ckpt" in msg


def test_typo_in_field_fails():
    with pytest.raises(ConfigCompositionException) as e:
        compose(["trainer.max_step=3"])
    assert "max_step" in str(e.value.__cause__ or e.value)


def test_wrong_type_fails():
    with pytest.raises((ConfigCompositionException, ValidationError)) as e:
        compose(["trainer.max_steps=many"])
    assert "max_steps" in str(e.value.__cause__ or e.value)


def test_typo_in_strategy_field_fails():
    with pytest.raises(ConfigCompositionException) as e:
        compose(["+strategy=ckpt", "strategy.ckpt.polcy=full"])
    assert "polcy" in str(e.value.__cause__ or e.value)


def test_several_strategies_append():
    cfg = typed(["+strategy=[bf16,ckpt]"])
    assert set(cfg.strategy.selected()) == {"bf16", "ckpt"}


@pytest.mark.parametrize(
    "overrides, needles",
    [
        (["+strategy=[fp16,bf16]"], ["fp16", "bf16"]),
        (["+strategy=act_offload"], ["act_offload", "ckpt"]),
        (["+strategy=ckpt", "strategy.ckpt.policy=sometimes"], ["strategy.ckpt.policy", "full", "every_k", "selective"]),
        (["+strategy=ckpt", "strategy.ckpt.policy=every_k", "strategy.ckpt.k=9"], ["strategy.ckpt.k=9", "n_layer=4"]),
        (["+strategy=ckpt", "strategy.ckpt.policy=every_k", "strategy.ckpt.k=0"], ["strategy.ckpt.k=0"]),
        (["+strategy=[ckpt,act_offload]", "strategy.ckpt.policy=selective"], ["act_offload", "selective"]),
        (["model.n_head=3"], ["model.d_model=128", "model.n_head=3"]),
        (["trainer.micro_batch_size=0"], ["trainer.micro_batch_size"]),
        (["+strategy=fp16", "strategy.fp16.params=int8"], ["strategy.fp16.params", "int8"]),
        (["optim.betas=[1.5,2.0]"], ["optim.betas=[1.5, 2.0]", "[0, 1)"]),
        (["optim.min_lr_ratio=-0.5"], ["optim.min_lr_ratio=-0.5", "[0, 1]"]),
        (["optim.eps=0"], ["optim.eps=0", "> 0"]),
        (["optim.weight_decay=-0.1"], ["optim.weight_decay=-0.1", ">= 0"]),
        (["model.vocab_size=100"], ["model.vocab_size=100", "256"]),
        (["model.attention=flash"], ["model.attention='flash'", "+strategy=flash_attn"]),
        (["model.arch=mamba"], ["model.arch='mamba'", "gpt", "llama"]),
        (["model.dropout=1.5"], ["model.dropout=1.5", "[0, 1)"]),  # had failed in nn.Dropout, after the launch
        (["trainer.num_threads=-2"], ["trainer.num_threads=-2", ">= 0"]),  # had been ignored silently
        (["trainer.throughput_warmup_steps=-1"], ["trainer.throughput_warmup_steps=-1", ">= 0"]),
        (["trainer.eval_batches=-1"], ["trainer.eval_batches=-1", "trainer.eval_every=0"]),  # had turned evaluation off
        (["trainer.watchdog_s=0.01"], ["trainer.watchdog_s=0.01", "at least 1 second"]),  # its heartbeats ran late
        (["optim.lr=0"], ["optim.lr=0.0 must be > 0"]),
        (["optim.grad_clip=-1"], ["optim.grad_clip=-1.0", "0 disables"]),
    ],
)
def test_bad_combinations_are_refused(overrides, needles):
    with pytest.raises(ConfigError) as e:
        typed(overrides)
    for n in needles:
        assert n in str(e.value)


def test_missing_data_file_is_named(tmp_path):
    from memopt.data import DataError, load_tokens

    with pytest.raises(ConfigError, match="data.path=.*nope.txt.*no such file"):
        typed(["data=text_file", f"data.path={tmp_path}/nope.txt"])
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    cfg = typed(["data=text_file", f"data.path={empty}"])
    with pytest.raises(DataError, match="empty"):
        load_tokens(cfg.data)


def test_text_file_needs_path():
    with pytest.raises(ConfigError, match="data=text_file needs data.path"):
        typed(["data=text_file"])


@pytest.mark.parametrize("data", ["pydoc", "synthetic"])
def test_a_data_path_the_corpus_does_not_read_is_warned(tmp_path, data):
    """data.path with another corpus than text_file trained on that corpus, the file never opened, without a word:
    warned (not refused: a sweep over data=pydoc,text_file gives every job the file's path)."""
    import warnings

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text")
    with pytest.warns(UserWarning, match=f"is not read: .* this run's data is {data}"):
        typed([f"data={data}", f"data.path={corpus}"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert typed(["data=text_file", f"data.path={corpus}"]).data.path == str(corpus)


def test_experiment_config_is_global():
    cfg = typed(["experiment=quick"])
    assert cfg.experiment == "quick" and cfg.trainer.max_steps == 30


def test_oversubscribed_cpu_ranks_warn_only_when_they_run():
    """More CPU ranks than cores slows a run; a plan runs nothing (a GPU node planned from here would warn)."""
    import warnings

    ranks = f"trainer.nproc_per_node={(os.cpu_count() or 1) + 1}"
    with pytest.warns(UserWarning, match="CPU ranks on"):
        typed([ranks, "trainer.device=cpu"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        typed([ranks, "trainer.device=cpu", "trainer.mode=plan", "hardware=a100_80g"])


@pytest.mark.parametrize("overrides, name, near", [
    (["+trainer.max_step=5"], "trainer.max_step", "trainer.max_steps"),
    (["+strategy=ckpt", "+strategy.ckpt.polcy=every_k"], "strategy.ckpt.polcy", "strategy.ckpt.policy"),
    (["+max_steps=5"], "max_steps", "trainer"),
])
def test_a_key_added_with_plus_that_the_schema_lacks_is_refused(overrides, name, near):
    """Hydra suggests '+key=value' for a typo, which adds the key silently (10 steps ran for max_step=5)."""
    from memopt.config import to_dataclass
    from memopt.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        to_dataclass(compose(overrides))
    assert f"{name} is not a field" in str(e.value) and near in str(e.value)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU profile on a machine without CUDA")
def test_training_on_the_cpu_with_an_accelerators_profile_warns_that_mfu_and_budget_are_its():
    """hardware=h100_sxm trained here without a word: MFU 0.1% against the H100's peak, its 80 GB as the device
    budget. Warned (planning for that machine is what the profile is for: no warning in plan mode)."""
    import warnings

    with pytest.warns(UserWarning, match=r"hardware=h100_sxm describes an accelerator .* trains on the CPU"):
        typed(["hardware=h100_sxm"])
    for quiet in (["hardware=h100_sxm", "trainer.mode=plan"], []):
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            typed(quiet)
