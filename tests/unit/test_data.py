from __future__ import annotations

import torch

from memopt.data import DataConfig, TokenBatches, load_tokens


def test_pydoc_corpus_is_real_text():
    toks = load_tokens(DataConfig())
    assert 300_000 < len(toks) < 2_000_000 and toks.dtype == torch.uint8
    text = bytes(toks[:20000].tolist()).decode("utf-8", errors="replace")
    assert " the " in text and "Python" in text


def test_text_file(tmp_path):
    p = tmp_path / "c.txt"
    p.write_text("héllo world " * 50, encoding="utf-8")
    toks = load_tokens(DataConfig(name="text_file", path=str(p)))
    assert bytes(toks.tolist()).decode() == "héllo world " * 50


def test_batches_do_not_depend_on_world_size():
    data = TokenBatches(load_tokens(DataConfig()), 32, 0.05, seed=3)
    x8, y8 = data.micro_batch(step=5, micro=0, rank=0, world=1, micro_bs=8, grad_accum=1)
    parts = [data.micro_batch(5, 0, r, 2, 4, 1) for r in range(2)]
    assert torch.equal(torch.cat([p[0] for p in parts]), x8) and torch.equal(torch.cat([p[1] for p in parts]), y8)
    acc = [data.micro_batch(5, m, 0, 1, 2, 4) for m in range(4)]
    assert torch.equal(torch.cat([a[0] for a in acc]), x8)
    # targets are inputs shifted by one token
    assert torch.equal(x8[:, 1:], y8[:, :-1])


def test_train_and_validation_are_disjoint_and_fixed():
    data = TokenBatches(load_tokens(DataConfig()), 16, 0.05, seed=0)
    assert len(data.train) + len(data.val) == len(load_tokens(DataConfig()))
    a, b = data.eval_batches(2, 4), data.eval_batches(2, 4)
    assert all(torch.equal(p[0], q[0]) for p, q in zip(a, b))


def test_a_validation_split_too_short_names_the_fraction_that_works():
    """The refusal said 'a smaller data.val_fraction' for a split too short, which only shortens it; it names the
    fraction that gives the split seq_len + 1 tokens, and that fraction works."""
    import re

    import pytest

    from memopt.data import DataError, TokenBatches

    tokens = torch.arange(200) % 256
    with pytest.raises(DataError, match="validation split has 20 tokens") as e:
        TokenBatches(tokens, 64, 0.1, 0)
    frac = float(re.search(r"data.val_fraction \(at least ([\d.]+)", str(e.value)).group(1))
    assert len(TokenBatches(tokens, 64, frac, 0).val) >= 65 and "val_fraction=0" in str(e.value)
