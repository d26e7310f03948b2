"""``python -m memopt.export RUN_DIR OUT``: a run's weights as a Hugging Face directory.

Reads the run's ``model.pt`` (memory-mapped: one tensor at a time is touched) and writes ``OUT/config.json`` and
``OUT/model.safetensors`` in the layout of ``GPT2LMHeadModel`` (model.arch=gpt) or ``LlamaForCausalLM``
(model.arch=llama), which ``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` loads. The weights
are written in fp32, as model.pt holds them; a tied head is written once (as the embedding). A model that
Hugging Face's class cannot express (rotary GPT, no biases, MoE) is refused naming what.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from memopt.errors import ConfigError


def export(run_dir: str, out: str) -> str:
    """Write ``out`` (a directory) from ``run_dir`` (a run directory or its model.pt); returns ``out``."""
    from safetensors.torch import save_file

    from memopt.models.base import ModelConfig
    from memopt.models.hf import hf_config, hf_name

    path = os.path.join(run_dir, "model.pt") if os.path.isdir(run_dir) else run_dir
    if not os.path.isfile(path):
        raise ConfigError(f"no model.pt at {path}: a finished run directory holds one")
    ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if ckpt.get("lora"):
        raise ConfigError(f"{path} holds LoRA adapters alone (strategy.lora.save=adapters): export needs the whole "
                          "model; train with strategy.lora.save=merged (the adapters merged into the base weights)")
    if ckpt.get("architecture"):
        raise ConfigError(f"{path}: the model was changed by +strategy={', '.join(ckpt['architecture'])}, which "
                          "Hugging Face's GPT-2 and Llama classes do not have")
    cfg = ModelConfig(**ckpt["model_config"])
    config = hf_config(cfg)
    tensors = {}
    for name, t in ckpt["state_dict"].items():
        if cfg.tie_embeddings and name == "lm_head.weight":
            continue  # the embedding, once (transformers ties it back)
        hf, transposed = hf_name(cfg.arch, name)
        tensors[hf] = (t.t() if transposed else t).contiguous()
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m memopt.export", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", help="a finished run directory (or its model.pt)")
    p.add_argument("out", help="the Hugging Face directory to write (config.json + model.safetensors)")
    a = p.parse_args(argv)
    try:
        print(export(a.run_dir, a.out))
    except ConfigError as e:
        print(f"memopt.export: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
