"""memopt: train large transformers in less accelerator memory, with every byte measured."""
from __future__ import annotations

__version__ = "0.1.0"


def load_model(path: str, device: str = "cpu"):
    """Load a trained model: ``memopt.load_model("outputs/runs/.../")`` (a run dir or its model.pt)."""
    import os

    import torch

    from memopt.model_file import logical_model

    if os.path.isdir(path):
        path = os.path.join(path, "model.pt")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint at {path}: a finished run directory holds model.pt")
    ckpt = torch.load(path, map_location=device, weights_only=True)
    if ckpt.get("lora"):
        raise ValueError(f"{path} holds LoRA adapters alone (strategy.lora.save=adapters), not a model: put them on "
                         "the base model with memopt.strategies.lora.load_adapters(model, path), or train with "
                         "strategy.lora.save=merged for a plain model.pt")
    model = logical_model(ckpt, device)
    model.load_state_dict(ckpt["state_dict"])
    return model.eval()
