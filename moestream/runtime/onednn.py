"""Bounds oneDNN's per-shape caches, which the engine's CPU matmuls would otherwise grow for hours.

On a CPU with bf16 instructions torch runs bf16 linears through oneDNN, which caches what it built for
every (rows, in, out) shape in ideep's cache (`LRU_CACHE_CAPACITY`) and oneDNN's primitive cache
(`ONEDNN_PRIMITIVE_CACHE_CAPACITY`), 1024 entries each by default, 0.3-0.65 MiB an entry; the engine
meets new shapes at every prompt length and batch: 40 prompts grew a demo engine's RSS by 306 MiB, where
256 entries held it flat (docs/design.md, Memory), enough for a batch of 16's decode shapes. Both are
read at the first bf16 matmul; a value the user set is kept.

`NativeGemv` turns oneDNN off for a step whose products have one row: torch's native bf16 gemv streams
weights 1.6-1.7x faster, but rounds the last bit differently (about 0.02% of outputs). With more rows it
is slower, so other steps keep oneDNN. `keep_onednn` keeps it on inside the given modules (attention,
2.3x slower without it: docs/measurements/engine-tpot.md). Knows nothing of models or policies.
"""

from __future__ import annotations

import contextlib
import os

import torch

CACHE_ENTRIES = 256
VARIABLES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")


def bound_shape_caches(entries: int = CACHE_ENTRIES) -> dict[str, str]:
    for name in VARIABLES:
        os.environ.setdefault(name, str(entries))
    return {name: os.environ[name] for name in VARIABLES}


class NativeGemv:
    """An engine's one-row CPU steps without oneDNN (where enabled), but for the modules it keeps oneDNN in.
    The flag is process-wide: whatever the interleaving of threads and engines, the last step leaves it on."""

    def __init__(self, enabled: bool, device: str):
        self.enabled = enabled and torch.device(device).type == "cpu"
        self.acting = False  # whether this engine's step under way turned oneDNN off

    @contextlib.contextmanager
    def step(self, num_rows: int):
        act = self.enabled and num_rows == 1 and torch.backends.mkldnn.enabled
        if act:
            torch.backends.mkldnn.enabled = False
        self.acting = act
        try:
            yield
        finally:
            self.acting = False
            if act:
                torch.backends.mkldnn.enabled = True

    def keep_onednn(self, modules) -> list:
        """Hooks (their handles) that turn oneDNN on inside each module during a step that turned it off."""
        def enter(module, args) -> None:
            if self.acting:
                torch.backends.mkldnn.enabled = True

        def leave(module, args, output) -> None:
            if self.acting:
                torch.backends.mkldnn.enabled = False

        if not self.enabled:
            return []
        return [handle for module in modules for handle in (module.register_forward_pre_hook(enter),
                                                            module.register_forward_hook(leave, always_call=True))]


def native_single_row(enabled: bool, num_rows: int, device: str):
    return NativeGemv(enabled, device).step(num_rows)
