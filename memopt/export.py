"""``python -m memopt.export RUN_DIR OUT``: a run's weights as a Hugging Face directory.

Reads the run's ``model.pt`` (memory-mapped: one tensor at a time is touched) and writes ``OUT/config.json`` and
``OUT/model.safetensors`` (or, above ``--max-shard-gb``, shards ``model-0000k-of-0000n.safetensors`` with
``model.safetensors.index.json``, as ``save_pretrained`` names them; one shard's tensors in memory at a
time) in the layout of ``GPT2LMHeadModel`` (model.arch=gpt) or ``LlamaForCausalLM``
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


def export(run_dir: str, out: str, max_shard_gb: float = 5.0) -> str:
    """Write ``out`` (a directory) from ``run_dir`` (a run directory or its model.pt); returns ``out``.
    Shards hold at most ``max_shard_gb`` GB each (Hugging Face's default 5 GB; a larger tensor alone)."""
    from memopt.models.base import ModelConfig
    from memopt.models.hf import hf_config, hf_name
    from memopt.strategies.lora import is_adapter

    if max_shard_gb <= 0:
        raise ConfigError(f"--max-shard-gb={max_shard_gb} must be > 0 (Hugging Face's default: 5)")
    path = os.path.join(run_dir, "model.pt") if os.path.isdir(run_dir) else run_dir
    if not os.path.isfile(path):
        raise ConfigError(f"no model.pt at {path}: a finished run directory holds one")
    ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if ckpt.get("lora"):
        raise ConfigError(f"{path} holds LoRA adapters alone (strategy.lora.save=adapters): export needs the whole "
                          "model; train with strategy.lora.save=merged (the adapters merged into the base weights)")
    unmerged = [n for n in ckpt["state_dict"] if is_adapter(n)]
    if unmerged:
        raise ConfigError(f"{path} holds LoRA adapters beside their base weights, unmerged ({unmerged[0]}, ...): a "
                          "resumable checkpoint's layout; python -m memopt.checkpoint merge writes it merged")
    if ckpt.get("architecture"):
        raise ConfigError(f"{path}: the model was changed by +strategy={', '.join(ckpt['architecture'])}, which "
                          "Hugging Face's GPT-2 and Llama classes do not have")
    cfg = ModelConfig(**ckpt["model_config"])
    config = hf_config(cfg)
    names = [(name, *hf_name(cfg.arch, name)) for name in ckpt["state_dict"]
             if not (cfg.tie_embeddings and name == "lm_head.weight")]  # a tied head: the embedding, once
    shards = _shards([(hf, ckpt["state_dict"][name].nbytes) for name, hf, _ in names], int(max_shard_gb * 1e9))
    os.makedirs(out, exist_ok=True)
    _write(out, shards, {hf: (ckpt["state_dict"][name], transposed) for name, hf, transposed in names})
    with open(os.path.join(out, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2)
    _copy_tokenizer(ckpt.get("tokenizer"), out)
    return out


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _copy_tokenizer(src: str | None, out: str) -> None:
    """The tokenizer the run trained with (``data.tokenizer``, in model.pt's record) beside the weights, so that
    ``AutoTokenizer.from_pretrained(out)`` loads what the model's token ids mean (a byte-level run has none). A
    directory gone since is said, not fatal: the weights are written."""
    import shutil

    if not src:
        return
    if not os.path.isdir(src):
        print(f"memopt.export: the run's tokenizer {src} is gone; {out} holds the weights without it", file=sys.stderr)
        return
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(out, name))


def _shards(sizes: list[tuple[str, int]], limit: int) -> list[list[str]]:
    """Tensor names in order, cut into shards of at most ``limit`` bytes (a larger tensor alone)."""
    shards, cur, used = [], [], 0
    for name, n in sizes:
        if cur and used + n > limit:
            shards.append(cur)
            cur, used = [], 0
        cur.append(name)
        used += n
    return shards + [cur] if cur else shards


def _write(out: str, shards: list[list[str]], tensors: dict) -> None:
    """One ``model.safetensors``, or the shards and their index; a shard's tensors made contiguous (GPT-2's
    transposed Conv1D weights copied) only while it is written."""
    from safetensors.torch import save_file

    files = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total = {}, 0
    for file, names in zip(files, shards):
        part = {}
        for hf in names:
            t, transposed = tensors[hf]
            part[hf] = (t.t() if transposed else t).contiguous()
            weight_map[hf] = file
            total += part[hf].nbytes
        save_file(part, os.path.join(out, file), metadata={"format": "pt"})
        del part
    if len(files) > 1:
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as fh:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m memopt.export", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", help="a finished run directory (or its model.pt)")
    p.add_argument("out", help="the Hugging Face directory to write (config.json + model.safetensors)")
    p.add_argument("--max-shard-gb", type=float, default=5.0,
                   help="the largest shard in GB (default 5, as save_pretrained); a larger model is written in shards")
    a = p.parse_args(argv)
    try:
        print(export(a.run_dir, a.out, a.max_shard_gb))
    except ConfigError as e:
        print(f"memopt.export: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
