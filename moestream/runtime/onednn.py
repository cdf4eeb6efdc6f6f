"""Bounds oneDNN's per-shape caches, which the engine's CPU matmuls would otherwise grow for hours.

On a CPU with bf16 instructions (AVX512-BF16, AMX), torch runs bf16 linears through oneDNN, which keeps
what it built for every (rows, in, out) shape it has seen in two caches: ideep's (`LRU_CACHE_CAPACITY`)
and oneDNN's primitive cache (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`), 1024 entries each by default. An entry
holds about 0.3-0.65 MiB of heap, and the engine meets a new shape at every prompt length, batch size
and expert token count: 40 prompts of random lengths grew a demo engine's RSS by 306 MiB, still
growing, where 256 entries each held it flat (docs/design.md, Memory). A new shape costs 0.4-0.6 ms to
build, so the bound keeps a batch of 16's decode shapes (about 210) cached.

Both variables are read when the caches are first used: set before a process's first bf16 matmul,
they hold; a value the user set is kept.

`NativeGemv` (`native_single_row` for one step) turns oneDNN off for a step whose products have one row
(a decode step of one sequence, or a one-token prompt): torch's native bf16 matrix-vector product then
streams weights at 1.6-1.7x oneDNN's speed (64-70% of the single-core read bandwidth at DeepSeek-V2-Lite's expert sizes,
against 33%), but its sums round differently in the last bit (about 0.02% of output elements), so the
engine's tokens no longer equal transformers' run with oneDNN on. With more rows the native product is
slower than oneDNN's, so other steps keep it. `NativeGemv.keep_onednn` keeps oneDNN on inside the modules
it is given during such a step: the engine gives it the attention modules, whose small products and
attention kernel ran 2.3x slower without oneDNN (DeepSeek-V2-Lite at half width: 81 against 35 ms a token,
docs/measurements/engine-tpot.md). Knows nothing of models or policies.
"""

from __future__ import annotations

import contextlib
import os

import torch

CACHE_ENTRIES = 256
VARIABLES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")


def bound_shape_caches(entries: int = CACHE_ENTRIES) -> dict[str, str]:
    """Sets each cache's capacity to entries where the environment does not already; returns both."""
    for name in VARIABLES:
        os.environ.setdefault(name, str(entries))
    return {name: os.environ[name] for name in VARIABLES}


class NativeGemv:
    """An engine's one-row CPU steps without oneDNN (where enabled), but for the modules it keeps oneDNN in.
    The flag is torch's, process-wide: other threads' products inside a step also run without oneDNN, and a
    second engine's step that begins meanwhile finds it off and leaves it to this one (its kept modules then
    run without oneDNN too); whatever the interleaving, the last step to end leaves oneDNN on."""

    def __init__(self, enabled: bool, device: str):
        self.enabled = enabled and torch.device(device).type == "cpu"
        self.acting = False  # whether this engine's step under way turned oneDNN off

    @contextlib.contextmanager
    def step(self, num_rows: int):
        """oneDNN off inside, where enabled, the step has one row and oneDNN is on; on again after."""
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
        """Forward hooks (their handles) that turn oneDNN on inside each module during a step that turned it
        off, and off again after it, also when it raises; none where not enabled."""
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
    """One step of `NativeGemv` (a context manager), for a caller with no modules to keep oneDNN in."""
    return NativeGemv(enabled, device).step(num_rows)
