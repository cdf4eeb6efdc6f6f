"""Bounds oneDNN's per-shape caches, which the engine's CPU matmuls would otherwise grow for hours.

On a CPU with bf16 instructions (AVX512-BF16, AMX), torch runs bf16 linears through oneDNN, which keeps
what it built for every (rows, in, out) shape it has seen in two caches: ideep's (`LRU_CACHE_CAPACITY`)
and oneDNN's primitive cache (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`), 1024 entries each by default. An entry
holds about 0.3-0.65 MiB of heap, and the engine meets a new shape at every prompt length, batch size
and expert token count: 40 prompts of random lengths grew a demo engine's RSS by 306 MiB, still
growing, where 256 entries each held it flat (docs/design.md, Memory). A new shape costs 0.4-0.6 ms to
build, so the bound keeps a batch of 16's decode shapes (about 210) cached.

Both variables are read when the caches are first used: set before a process's first bf16 matmul,
they hold; a value the user set is kept. Knows nothing of models or policies.
"""

from __future__ import annotations

import os

CACHE_ENTRIES = 256
VARIABLES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")


def bound_shape_caches(entries: int = CACHE_ENTRIES) -> dict[str, str]:
    """Sets each cache's capacity to entries where the environment does not already; returns both."""
    for name in VARIABLES:
        os.environ.setdefault(name, str(entries))
    return {name: os.environ[name] for name in VARIABLES}
