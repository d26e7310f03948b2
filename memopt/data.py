"""Token streams and the world-size-independent batch sampler.

Corpora are byte-level by default: a token is one UTF-8 byte (vocabulary 256), so no tokenizer has to
be downloaded. ``data.tokenizer=DIR`` reads a local tokenizer directory instead (its ``tokenizer.json``,
the format of Hugging Face's ``tokenizers`` package, which every Llama and GPT-2 checkpoint directory
ships): the text corpora are encoded by it once, at load. ``pydoc`` is the default corpus: the standard library's ``pydoc_data.topics`` (real
English text that ships with every CPython, ~460 KB).

Batches: the global batch of step s is drawn by a generator seeded with (seed, s) and depends on
the global batch size alone. Rank r, micro-step m takes rows [(m * W + r) * b, (m * W + r + 1) * b)
of it, so 2 ranks x micro-batch 4 see exactly the samples of 1 rank x micro-batch 8, and
grad_accum=4 with micro-batch b sees exactly one batch of 4b.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from memopt.errors import ConfigError


BYTE_VOCAB = 256  # token ids of every corpus: one UTF-8 byte each

@dataclass
class DataConfig:
    """The ``data`` config group."""

    name: str = "pydoc"  # pydoc | text_file | synthetic
    path: str | None = None  # UTF-8 text file for name=text_file
    val_fraction: float = 0.05  # tail of the corpus held out for evaluation
    synthetic_tokens: int = 1_000_000  # corpus length for name=synthetic (uniform random bytes)
    tokenizer: str | None = None  # a directory with tokenizer.json (the tokenizers package); null: bytes


class DataError(ConfigError):
    """A data config that cannot produce batches (missing or empty file, unknown corpus): found
    before the model is built, so the run is ``refused`` like any other bad input."""


def tokenizer_of(cfg: DataConfig):
    """The ``tokenizers.Tokenizer`` of ``data.tokenizer`` (None: byte tokens), refused with the reason."""
    if not cfg.tokenizer:
        return None
    if cfg.name == "synthetic":
        raise DataError("data.tokenizer applies to text corpora (data=pydoc or data=text_file); data=synthetic "
                        "draws random byte tokens: drop data.tokenizer")
    path = os.path.join(os.path.expanduser(cfg.tokenizer), "tokenizer.json")
    if not os.path.isfile(path):
        raise DataError(f"data.tokenizer={cfg.tokenizer!r}: no tokenizer.json there; give a directory holding "
                        "the tokenizers package's tokenizer.json (a Hugging Face model directory has one)")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise DataError("data.tokenizer needs the tokenizers package (pip install tokenizers)") from None
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # the library's own parse error: name the file
        raise DataError(f"data.tokenizer={cfg.tokenizer!r}: {path} is not a tokenizer the tokenizers package reads "
                        f"({type(e).__name__}: {e})") from None


def vocab_size(cfg: DataConfig) -> int:
    """Token ids the corpus may hold: the tokenizer's vocabulary (added tokens included), or 256 bytes."""
    tok = tokenizer_of(cfg)
    return BYTE_VOCAB if tok is None else tok.get_vocab_size(with_added_tokens=True)


def load_tokens(cfg: DataConfig, seed: int = 0) -> torch.Tensor:
    """The whole corpus as a 1-D tensor of token ids: uint8 bytes, or int32 ids of ``data.tokenizer``."""
    raw = _load_bytes(cfg, seed)
    tok = tokenizer_of(cfg)  # None for bytes (refused with synthetic, whose tokens are random bytes)
    if tok is None:
        return raw
    return torch.tensor(tok.encode(bytes(raw.numpy()).decode("utf-8")).ids, dtype=torch.int32)


def _load_bytes(cfg: DataConfig, seed: int) -> torch.Tensor:
    if cfg.name == "pydoc":
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[k] for k in sorted(topics))
        raw = text.encode("utf-8")
    elif cfg.name == "text_file":
        if not cfg.path:
            raise DataError("data.path is required with data=text_file (e.g. data.path=/path/to/corpus.txt)")
        path = os.path.expanduser(cfg.path)
        if not os.path.isfile(path):
            raise DataError(f"data.path={cfg.path!r}: no such file; give a UTF-8 text file")
        with open(path, "rb") as f:
            raw = f.read()
        if not raw:
            raise DataError(f"data.path={cfg.path!r}: the file is empty; give a non-empty UTF-8 text file")
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"data.path={cfg.path!r}: not valid UTF-8 ({e})") from None
    elif cfg.name == "synthetic":
        g = torch.Generator().manual_seed(seed + 12345)
        return torch.randint(0, BYTE_VOCAB, (cfg.synthetic_tokens,), generator=g, dtype=torch.uint8)
    else:
        raise DataError(f"data.name={cfg.name!r} is not one of: pydoc, text_file, synthetic")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


class TokenBatches:
    """Random (input, target) windows from a train/validation split of one token stream."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, val_fraction: float, seed: int):
        n_val = int(len(tokens) * val_fraction)
        self.train = tokens[: len(tokens) - n_val]
        self.val = tokens[len(tokens) - n_val :]
        self.seq_len = seq_len
        self.seed = seed
        for split, t in (("train", self.train), ("validation", self.val)):
            if len(t) < seq_len + 1 and (split == "train" or n_val > 0):
                need = (f"a larger data.val_fraction (at least {math.ceil((seq_len + 1) / len(tokens) * 1000) / 1000:g} of the corpus), or "
                        "data.val_fraction=0 for no validation split" if split == "validation" else
                        "a smaller data.val_fraction")
                raise DataError(
                    f"the {split} split has {len(t)} tokens, fewer than model.seq_len + 1 = {seq_len + 1}; "
                    f"use a larger corpus, a smaller model.seq_len, or {need}"
                )

    def _windows(self, data: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]  # (N, T+1)
        w = data[idx].long()
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()  # (N, T) inputs, (N, T) next-token targets

    def global_batch(self, step: int, size: int, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        """The ``size`` samples of global step ``step``: a function of (seed, step, size, split) only."""
        data = self.train if split == "train" else self.val
        salt = 0 if split == "train" else 0x5EED
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + step * 7919 + salt) % (2**63))
        starts = torch.randint(0, len(data) - self.seq_len, (size,), generator=g)
        return self._windows(data, starts)

    def micro_batch(self, step: int, micro: int, rank: int, world: int, micro_bs: int, grad_accum: int):
        """Rank ``rank``'s share of micro-step ``micro`` of global step ``step``."""
        x, y = self.global_batch(step, micro_bs * world * grad_accum)
        lo = (micro * world + rank) * micro_bs
        return x[lo : lo + micro_bs], y[lo : lo + micro_bs]

    def eval_batches(self, n_batches: int, batch_size: int):
        """A fixed list of held-out batches (the same at every evaluation)."""
        return [self.global_batch(i, batch_size, split="val") for i in range(n_batches)]
