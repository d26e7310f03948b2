"""Models: the interface (base.py) and its implementations, registered by ``model.arch``.

Adding a model: a module implementing ``memopt.models.base.Model`` and one line in ``MODELS``.
"""
from memopt.errors import ConfigError
from memopt.models.base import Model, ModelConfig
from memopt.models.gpt import GPT, GPTConfig, count_params, flops_per_token
from memopt.models.llama import Llama

MODELS: dict[str, type[Model]] = {"gpt": GPT, "llama": Llama}


def model_class(cfg: ModelConfig) -> type[Model]:
    """The implementation of ``cfg.arch``; ConfigError naming the options otherwise."""
    if cfg.arch not in MODELS:
        raise ConfigError(f"model.arch={cfg.arch!r} is not one of: {', '.join(MODELS)}")
    return MODELS[cfg.arch]


__all__ = ["GPT", "GPTConfig", "Llama", "MODELS", "Model", "ModelConfig", "count_params", "flops_per_token", "model_class"]
