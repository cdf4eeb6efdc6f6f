"""Configuration of the learned predictors and their training: plain dataclasses, no torch, so that
policies can build and validate them without importing the models."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from moestream.errors import MoestreamError


class ConfigError(MoestreamError, ValueError):
    """A predictor or training setting out of its range."""


@dataclass
class TrainConfig:
    num_epochs: int = 8
    batch_size: int = 256
    learning_rate: float = 2e-3
    weight_decay: float = 1e-4
    seed: int = 0
    num_threads: int = 1  # torch intra-op threads while training
    progress: bool = False  # show a tqdm bar on stderr

    def __post_init__(self):
        if self.num_epochs < 1 or self.batch_size < 1 or self.num_threads < 1:
            raise ConfigError("num_epochs, batch_size and num_threads must be >= 1")
        if self.learning_rate <= 0 or self.weight_decay < 0:
            raise ConfigError("learning_rate must be > 0 and weight_decay >= 0")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RoutingPathConfig:
    window_tokens: int = 16  # the token itself and up to window_tokens-1 tokens before it
    model_dim: int = 128
    num_heads: int = 4
    num_blocks: int = 2
    ff_dim: int = 256
    dropout: float = 0.0
    max_vocab: int = 16384  # most frequent training tokens kept; the rest map to UNK
    min_token_count: int = 2  # rarer training tokens map to UNK, so that UNK is learned

    def __post_init__(self):
        if self.window_tokens < 1 or self.num_blocks < 1 or self.ff_dim < 1:
            raise ConfigError("window_tokens, num_blocks and ff_dim must be >= 1")
        if self.model_dim < 1 or self.num_heads < 1 or self.model_dim % self.num_heads:
            raise ConfigError(f"model_dim ({self.model_dim}) must be a positive multiple of num_heads "
                              f"({self.num_heads})")
        if not 0.0 <= self.dropout < 1.0 or self.max_vocab < 1 or self.min_token_count < 1:
            raise ConfigError("need 0 <= dropout < 1, max_vocab >= 1 and min_token_count >= 1")
