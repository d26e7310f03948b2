"""memopt: train large transformers in less accelerator memory, with every byte measured."""
from __future__ import annotations

__version__ = "0.1.0"


def load_model(path: str, device: str = "cpu"):
    """Load a trained model: ``memopt.load_model("outputs/runs/.../")`` (a run dir or its model.pt)."""
    import os

    import torch

    from memopt.models import ModelConfig, model_class
    from memopt.strategies.base import registry

    if os.path.isdir(path):
        path = os.path.join(path, "model.pt")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint at {path}: a finished run directory holds model.pt")
    ckpt = torch.load(path, map_location=device, weights_only=True)
    cfg = ModelConfig(**ckpt["model_config"])
    model = model_class(cfg)(cfg).to(device)
    strategies = registry()
    for name, opts in ckpt.get("architecture", {}).items():  # strategies that changed the model (moe)
        with torch.device(device):
            strategies[name].install(model, strategies[name].Config(**opts), cfg)
    model.load_state_dict(ckpt["state_dict"])
    return model.eval()
