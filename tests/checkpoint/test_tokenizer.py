"""The packaged byte-level BPE tokenizer: deterministic, loadable offline, lossless."""

import pytest
from transformers import AutoTokenizer

from moestream.checkpoint.tokenizer import EOS, corpus_text, load_tokenizer, train_tokenizer
from moestream.errors import CheckpointError

TEXTS = [
    "The lighthouse keeper climbed the stairs.",
    "def f(x):\n    return {'k': x ** 2}  # tabs\tand spaces",
    "Ünïcödé, 日本語, emoji 😀 and bytes \x00\x7f",
    "",
]


def test_written_tokenizer_loads_offline_and_round_trips(tmp_path):
    train_tokenizer(400).save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert len(tokenizer) == 400
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.eos_token == EOS
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_training_is_deterministic_and_follows_the_vocab_size():
    first, second = train_tokenizer(700), train_tokenizer(700)
    assert first.get_vocab() == second.get_vocab() and len(first) == 700
    assert len(train_tokenizer(300)) == 300
    text = corpus_text()
    assert len(first(text)["input_ids"]) < len(train_tokenizer(300)(text)["input_ids"])


@pytest.mark.parametrize("vocab_size, problem", [(100, "too small"), (100_000, "larger than the packaged corpus")])
def test_unusable_vocab_sizes(vocab_size, problem):
    with pytest.raises(CheckpointError, match=problem):
        train_tokenizer(vocab_size)


def test_a_checkpoint_s_tokenizer_loads_and_a_missing_or_broken_one_is_one_line(tmp_path):
    train_tokenizer(400).save_pretrained(tmp_path)
    assert len(load_tokenizer(tmp_path)) == 400
    for text in ("{not json", "{}"):
        (tmp_path / "tokenizer.json").write_text(text)
        with pytest.raises(CheckpointError) as broken:
            load_tokenizer(tmp_path)
        assert str(broken.value).startswith(f"checkpoint {tmp_path} has no usable tokenizer (")
        assert len(str(broken.value).splitlines()) == 1
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError) as missing:
        load_tokenizer(tmp_path)
    assert str(missing.value) == f"checkpoint directory {tmp_path} has no tokenizer.json (the model's tokenizer)"
