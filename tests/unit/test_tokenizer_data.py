"""``data.tokenizer=DIR``: a text corpus encoded by a local ``tokenizer.json`` (the tokenizers package).

Reference: the tokenizers package itself (a small byte-level BPE trained here, as a model directory
would ship one): the corpus memopt loads is the library's encoding of the file, and decodes back to it."""
from __future__ import annotations

import pytest

from memopt.errors import ConfigError
from tests.conftest import train, typed

TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog, {i * i} times.\n" for i in range(600))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    (root / "tokdir").mkdir()
    tok.save(str(root / "tokdir" / "tokenizer.json"))
    (root / "corpus.txt").write_text(TEXT)
    return root, tok


def test_the_corpus_is_the_tokenizers_encoding_of_the_file(corpus):
    from memopt.data import DataConfig, load_tokens, vocab_size

    root, tok = corpus
    cfg = DataConfig(name="text_file", path=str(root / "corpus.txt"), tokenizer=str(root / "tokdir"))
    ids = load_tokens(cfg)
    want = tok.encode(TEXT).ids
    assert ids.tolist() == want and len(want) < len(TEXT.encode()) / 2  # merged: fewer ids than bytes
    assert tok.decode(ids.tolist()) == TEXT
    assert vocab_size(cfg) == tok.get_vocab_size() > 256 and int(ids.max()) >= 256  # ids beyond a byte


def test_a_run_trains_on_the_tokenized_corpus(corpus, tmp_path):
    root, tok = corpus
    data = ["data=text_file", f"data.path={root / 'corpus.txt'}", f"data.tokenizer={root / 'tokdir'}"]
    base = ["model=gpt_tiny", "model.seq_len=32", "trainer.max_steps=3", "trainer.eval_every=0", *data]
    s = train([*base, "model.vocab_size=512", "trainer.save_checkpoint=true", "trainer.checkpoint_every=3"],
              str(tmp_path / "run"))
    assert s["status"] == "ok"
    # exported with the tokenizer it trained with, from model.pt or a merged checkpoint: transformers reads what the
    # token ids mean (it had written none)
    from memopt.checkpoint import merge
    from memopt.export import export

    transformers = pytest.importorskip("transformers")
    merged = merge(str(tmp_path / "run" / "checkpoints" / "step_3"), str(tmp_path / "merged.pt"))
    for i, src in enumerate((str(tmp_path / "run"), merged)):
        out = export(src, str(tmp_path / f"hf{i}"))
        assert transformers.AutoTokenizer.from_pretrained(out).encode(TEXT[:200]) == tok.encode(TEXT[:200]).ids
    n = tok.get_vocab_size()
    with pytest.raises(ConfigError, match=rf"model.vocab_size=300 is smaller than data.tokenizer=.* \({n} token ids\); "
                                          rf"use model.vocab_size>={n}"):
        typed([*base, "model.vocab_size=300"])


def test_bad_tokenizer_directories_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="no tokenizer.json there"):
        typed(["data.tokenizer=" + str(tmp_path)])
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not a tokenizer the tokenizers package reads"):
        typed(["data.tokenizer=" + str(tmp_path)])
    with pytest.raises(ConfigError, match="data=synthetic draws random byte tokens"):
        typed(["data=synthetic", "data.tokenizer=" + str(tmp_path)])
