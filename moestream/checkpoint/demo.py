"""The demo checkpoint and the prompts run on it: DeepSeek-V2-Lite's topology at reduced width with random weights
(or, for tests, a small one), written to the cache directory ($MOESTREAM_CACHE, else ~/.cache/moestream) on first use.
Its text is noise; what runs on it shows what offloading costs. Knows no command."""

from __future__ import annotations

import os
from pathlib import Path

PROMPTS = (
    "The quickest way to learn a new programming language is",
    "def fibonacci(n):\n    ",
    "Mixture-of-experts models route every token to",
    "Once upon a time, in a city built on a river,",
)
DEMO_NAME = "demo-deepseek-v2-lite"
SMALL_NAME = "demo-small"


def cache_dir() -> Path:
    return Path(os.environ.get("MOESTREAM_CACHE") or Path.home() / ".cache" / "moestream")


def demo_checkpoint(small: bool = False) -> Path:
    """The demo checkpoint, written on first use (small: 3 layers (2 MoE) of 16 experts, for tests)."""
    from dataclasses import replace

    from moestream.checkpoint.make_model import make_model
    from moestream.checkpoint.spec import demo_spec

    path, spec = cache_dir() / (SMALL_NAME if small else DEMO_NAME), demo_spec()
    if small:
        spec = replace(spec, num_layers=3, num_experts=16, hidden_size=64, intermediate_size=64, vocab_size=512,
                       max_shard_bytes=None)
    if not (path / "config.json").is_file():
        print(f"creating the demo checkpoint in {path} (first use only)")
        make_model(spec, path, progress=True)
    return path
