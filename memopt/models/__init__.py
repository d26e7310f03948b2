"""Model definitions: the dense GPT (gpt.py)."""
from memopt.models.gpt import GPT, GPTConfig, count_params, flops_per_token

__all__ = ["GPT", "GPTConfig", "count_params", "flops_per_token"]
