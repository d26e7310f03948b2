"""model.pt written tensor by tensor (``memopt.model_file``) against ``torch.save`` of the whole dict."""
from __future__ import annotations

import os
import random

import pytest
import torch

from memopt.model_file import ModelFileWriter, logical_model

RECORD = {"model_config": {"name": "t", "arch": "gpt", "n_layer": 2, "n_head": 2, "d_model": 32, "vocab_size": 96,
                           "seq_len": 16}, "architecture": {}}


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = logical_model(RECORD, "cpu")
    return {k: torch.randn(v.shape) for k, v in model.state_dict().items()}


def test_streamed_file_equals_torch_save_of_the_dict(tmp_path):
    sd = _weights()
    sd["lm_head.weight"] = sd["wte.weight"]  # tied, as the model's state dict has them
    path = str(tmp_path / "model.pt")
    w = ModelFileWriter(path, RECORD)
    names = [n for n in sd if n != "lm_head.weight"]  # a tied weight arrives once, under one name
    random.Random(0).shuffle(names)
    for n in names:
        w.put(n, sd[n].to(torch.bfloat16).float())  # any dtype in, fp32 out
    assert not os.path.exists(path)  # nothing under the name before commit
    w.commit()
    ref = str(tmp_path / "ref.pt")
    torch.save({**RECORD, "state_dict": {k: v.to(torch.bfloat16).float() for k, v in sd.items()}}, ref)
    got, want = torch.load(path, weights_only=True), torch.load(ref, weights_only=True)
    assert got.keys() == want.keys() and got["model_config"] == want["model_config"]
    assert list(got["state_dict"]) == list(want["state_dict"])
    for k in want["state_dict"]:
        assert torch.equal(got["state_dict"][k], want["state_dict"][k]), k
    sdg = got["state_dict"]
    assert sdg["lm_head.weight"].untyped_storage().data_ptr() == sdg["wte.weight"].untyped_storage().data_ptr()
    import memopt

    loaded = memopt.load_model(path).state_dict()
    assert all(torch.equal(loaded[k], sdg[k]) for k in sdg)


def test_missing_weight_or_wrong_shape_leaves_the_previous_file(tmp_path):
    path = str(tmp_path / "model.pt")
    with open(path, "wb") as f:
        f.write(b"previous")
    sd = _weights()
    w = ModelFileWriter(path, RECORD)
    with pytest.raises(ValueError, match="wpe.weight has shape"):
        w.put("wpe.weight", sd["wpe.weight"][:-1])
    with pytest.raises(KeyError, match="not a weight"):
        w.put("nope", sd["wpe.weight"])
    w.put("wpe.weight", sd["wpe.weight"])
    with pytest.raises(RuntimeError, match="never arrived"):
        w.commit()
    assert open(path, "rb").read() == b"previous"
    assert os.listdir(tmp_path) == ["model.pt"]  # the temporary file is gone
