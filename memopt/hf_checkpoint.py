"""``model.init_from=DIR``: start from a local Hugging Face checkpoint directory (GPT-2, Llama).

A directory is ``config.json`` and either ``model.safetensors`` or shards listed by
``model.safetensors.index.json`` (what ``save_pretrained`` writes). Three steps, at three places:

1. ``apply_shapes`` (``config.to_dataclass``, on the composed DictConfig): the preset names the family
   (``model=llama_tiny`` for any Llama directory, ``model=gpt_small`` for any GPT-2); its shape fields are
   replaced by ``config.json``'s. A field the command sets (even to the preset's value), or that holds another
   value than the preset's, and disagrees with ``config.json`` is refused naming the field.
2. ``check`` (``config.validate``, before anything is allocated): the architecture is one memopt reads,
   every shard exists, every parameter of the model is in the directory with its shape and nothing
   else is (refusals name the tensor or the field). Only the safetensors headers are read.
3. ``install`` (``compose.model_on_meta``, before the strategies): the model's ``init_tensor(name,
   shape, seed)`` (every engine fills its weights through it, one parameter at a time: ZeRO flat groups,
   ZeRO-3 shards, chunks, FSDP2 shards, DeepSpeed's partitions, tp's rows) returns the directory's
   tensor instead of the seeded one. Each tensor is read alone (``safe_open`` maps the file; only that
   tensor's bytes are touched), converted to fp32 on the host, and the engine keeps its part of it: no
   process holds more than one full tensor of the checkpoint at a time (plus its own part of the model).
"""
from __future__ import annotations

import json
import os

import torch

from memopt.errors import ConfigError
from memopt.models.hf import config_from_hf, family_of, match, normalise, positions_cut

INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"
# fields the directory decides; the others (seq_len of a Llama, dropout, attention, init) stay the run's
_SHAPE_FIELDS = ("arch", "n_layer", "n_head", "n_kv_head", "d_model", "d_ff", "seq_len", "vocab_size", "pos_emb",
                 "bias", "tie_embeddings", "ln_eps", "rope_theta", "rope_scaling", "rope_factor",
                 "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_pos")


def read_config(path: str) -> dict:
    d = os.path.expanduser(path)
    if not os.path.isdir(d):
        raise ConfigError(f"model.init_from={path!r}: no such directory (a Hugging Face checkpoint directory: "
                          "config.json + model.safetensors)")
    f = os.path.join(d, "config.json")
    if not os.path.isfile(f):
        raise ConfigError(f"model.init_from={path!r} has no config.json")
    with open(f) as fh:
        return json.load(fh)


def hf_fields(path: str) -> dict:
    """The ``ModelConfig`` fields the directory's ``config.json`` decides."""
    hf = read_config(path)
    fields = config_from_hf(hf)
    if family_of(hf) == "llama":
        fields.pop("seq_len", None)  # rotary positions: the training context is the run's choice
    return fields


def _preset(name: str) -> dict:
    """The preset's values (conf/model/<name>.yaml over the schema's defaults); {} when there is no such preset."""
    import dataclasses

    from omegaconf import OmegaConf

    from memopt.models.base import ModelConfig

    # conf/ beside the package (memopt.config.CONF_DIR; not imported: config imports this module)
    f = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf", "model", f"{name}.yaml")
    if not os.path.isfile(f):
        return {}
    out = {fl.name: fl.default for fl in dataclasses.fields(ModelConfig)}
    out.update(OmegaConf.to_container(OmegaConf.load(f)))
    return out


def apply_shapes(model_node, typed: set[str] = frozenset()) -> None:
    """Replace the preset's shape fields of ``model_node`` (the composed ``model`` DictConfig, changed in
    place) by the directory's; refuse a field set otherwise (another value than the preset's, or a field in
    ``typed``: the command sets it) that disagrees. Idempotent."""
    path = model_node.get("init_from")
    if not path:
        return
    fields = hf_fields(path)
    preset = _preset(model_node.get("name"))
    if preset and preset.get("arch", "gpt") != fields["arch"]:
        fam = {"gpt": "GPT-2", "llama": "Llama"}
        raise ConfigError(f"model.init_from={path!r} is a {fam.get(fields['arch'], fields['arch'])} checkpoint but "
                          f"model={model_node.get('name')} is a model.arch={preset.get('arch', 'gpt')} preset; name a preset "
                          f"of its family (model.arch={fields['arch']}: e.g. "
                          f"{'model=llama_tiny' if fields['arch'] == 'llama' else 'model=gpt_small'})")
    for key in _SHAPE_FIELDS:
        if key not in fields:
            continue
        want, have = fields[key], model_node.get(key)
        if _same(have, want):
            continue
        if key not in typed and preset and key in preset and _same(have, preset[key]):  # the preset's: replaced
            model_node[key] = want
            continue
        if key == "seq_len" and have is not None and have < want:
            continue  # a GPT-2's shorter training context than its n_positions: the first rows of its position table
        if key == "seq_len":
            raise ConfigError(f"model.seq_len={have} is longer than model.init_from={path!r}'s n_positions ({want}: the "
                              f"rows of its position table): give model.seq_len={want} or less")
        raise ConfigError(f"model.{key}={have} disagrees with model.init_from={path!r}, whose config.json gives "
                          f"{want}: drop the override (the directory decides the shapes)")


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and float(a) == float(b)
    return a == b


def _shard_map(path: str) -> dict[str, str]:
    """Hugging Face tensor name -> the file holding it; a missing shard is refused naming it and a tensor."""
    d = os.path.expanduser(path)
    index = os.path.join(d, INDEX)
    if os.path.isfile(index):
        with open(index) as fh:
            wmap = json.load(fh)["weight_map"]
        for name, shard in sorted(wmap.items()):
            if not os.path.isfile(os.path.join(d, shard)):
                raise ConfigError(f"model.init_from={path!r}: shard {shard!r} (listed in {INDEX}, holding tensor "
                                  f"{name!r}) is missing")
        return {n: os.path.join(d, s) for n, s in wmap.items()}
    single = os.path.join(d, SINGLE)
    if not os.path.isfile(single):
        raise ConfigError(f"model.init_from={path!r} holds neither {SINGLE} nor {INDEX} (only safetensors "
                          "checkpoints are read)")
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return {n: single for n in f.keys()}


def _expected(cfg) -> dict[str, tuple[int, ...]]:
    from memopt.models import model_class

    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}  # tied head: wte.weight alone


def plan(cfg) -> dict[str, tuple[str, str, bool]]:
    """memopt parameter -> (the directory's tensor name, its file, transposed), after every check: the
    family, the shards, every parameter present with its shape, no tensor left over. Headers only."""
    from safetensors import safe_open

    path = cfg.init_from
    hf = read_config(path)
    arch = family_of(hf)
    if arch != cfg.arch:
        raise ConfigError(f"model.init_from={path!r} is a model.arch={arch} checkpoint; the model is model.arch={cfg.arch}")
    files = _shard_map(path)
    found: dict[str, tuple[str, tuple[int, ...]]] = {}  # normalised name -> (name, shape)
    file_of: dict[str, str] = {}
    by_file: dict[str, list[str]] = {}
    for n, f in files.items():
        by_file.setdefault(f, []).append(n)
    for f, names in by_file.items():
        with safe_open(f, framework="pt") as fh:
            keys = set(fh.keys())
            for n in names:
                if n not in keys:
                    raise ConfigError(f"model.init_from={path!r}: tensor {n!r} is listed in {INDEX} but absent from "
                                      f"{os.path.basename(f)}")
                found[normalise(arch, n)] = (n, tuple(fh.get_slice(n).get_shape()))
                file_of[n] = f
    matched = match(cfg, _expected(cfg), found, f"model.init_from={path!r}")
    return {name: (n, file_of[n], transposed) for name, (n, transposed) in matched.items()}


def check(cfg) -> None:
    """Every refusal of ``plan`` (``config.validate``: before allocation)."""
    if cfg.init_from:
        plan(cfg)


class Weights:
    """The directory's tensors by memopt name, read one at a time (``init_tensor``'s replacement)."""

    def __init__(self, cfg, fallback):
        self.plan = plan(cfg)
        self.fallback = fallback  # the seeded init: the planner's fake tensors have no values to read
        self.open: dict[str, object] = {}

    def __call__(self, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        from torch._guards import detect_fake_mode

        if detect_fake_mode() is not None:
            return self.fallback(name, shape, seed)
        from safetensors import safe_open

        n, f, transposed = self.plan[name]
        if f not in self.open:
            self.open[f] = safe_open(f, framework="pt")
        t = self.open[f].get_tensor(n)
        if transposed:
            t = t.t()
        t = positions_cut(name, t, shape[0])  # a shorter context than the checkpoint's: the first positions
        if tuple(t.shape) != tuple(shape):
            raise ConfigError(f"tensor {n!r} has shape {tuple(t.shape)}; memopt's {name} is {tuple(shape)}")
        return t.to(torch.float32).contiguous()  # the seeded init's dtype and device (the host)


def install(model) -> None:
    """Make ``model.init_tensor`` read ``model.cfg.init_from`` (before strategies wrap it: tp slices the result)."""
    if model.cfg.init_from:
        model.init_tensor = Weights(model.cfg, model.init_tensor)
