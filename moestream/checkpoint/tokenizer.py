"""A small byte-level BPE tokenizer for test models, trained deterministically on the packaged text.

The result is saved as a PreTrainedTokenizerFast (tokenizer.json + tokenizer_config.json), so
`AutoTokenizer.from_pretrained(dir)` loads it offline. Byte-level: any text round-trips.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from moestream.checkpoint.spec import MIN_VOCAB_SIZE, SPECIAL_TOKENS
from moestream.errors import CheckpointError

PAD, BOS, EOS = SPECIAL_TOKENS


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
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_text().splitlines(keepends=True), trainer=trainer)
    if tokenizer.get_vocab_size() < vocab_size:
        raise CheckpointError(
            f"vocab size {vocab_size} is larger than the packaged corpus supports ({tokenizer.get_vocab_size()})"
        )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD)


def write_tokenizer(directory: Path, vocab_size: int) -> PreTrainedTokenizerFast:
    """Train and save the tokenizer files into `directory` (which must exist)."""
    tokenizer = train_tokenizer(vocab_size)
    tokenizer.save_pretrained(directory)
    return tokenizer
