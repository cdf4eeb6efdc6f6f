"""A checkpoint's tokenizer: loading it (`load_tokenizer`, one line naming what is missing or unusable) and,
for test models, a small byte-level BPE tokenizer (any text round-trips) trained deterministically on the
packaged text, saved as a PreTrainedTokenizerFast that `AutoTokenizer.from_pretrained(dir)` loads offline."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from moestream.checkpoint.spec import MIN_VOCAB_SIZE, SPECIAL_TOKENS
from moestream.errors import CheckpointError

PAD, BOS, EOS = SPECIAL_TOKENS
TOKENIZER_FILE = "tokenizer.json"
SLOW_TOKENIZER_FILES = ("tokenizer.model", "vocab.json", "vocab.txt", "tiktoken.model")  # what transformers converts


@dataclass(frozen=True)
class SpecialTokenIds:
    pad: int = 0
    bos: int = 1
    eos: int = 2


def corpus_text() -> str:
    """The packaged English and code text the tokenizer is trained on."""
    return (resources.files("moestream") / "data" / "tokenizer_corpus.txt").read_text(encoding="utf-8")


def train_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE with at most `vocab_size` tokens (fewer if the corpus runs out of merges)."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise CheckpointError(f"vocab size {vocab_size} is too small for a byte-level tokenizer "
                              f"(need >= {MIN_VOCAB_SIZE})")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus_text().splitlines(keepends=True), trainer=trainer)
    if tokenizer.get_vocab_size() < vocab_size:
        raise CheckpointError(f"vocab size {vocab_size} is larger than the packaged corpus supports "
                              f"({tokenizer.get_vocab_size()})")
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD)


def load_tokenizer(path: str | Path):
    """The tokenizer of the checkpoint in `path`; CheckpointError in one line when it is missing or unusable."""
    path = Path(path)
    if not any((path / name).is_file() for name in (TOKENIZER_FILE, *SLOW_TOKENIZER_FILES)):
        raise CheckpointError(f"checkpoint directory {path} has no {TOKENIZER_FILE} (the model's tokenizer)")
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as error:  # tokenizers raises plain Exception (and KeyError...) on a malformed file
        why = " ".join(str(error).split())  # transformers' messages run over lines
        raise CheckpointError(f"checkpoint {path} has no usable tokenizer ({type(error).__name__}: {why})") from None
