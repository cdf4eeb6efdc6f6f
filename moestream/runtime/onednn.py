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

`native_single_row` turns oneDNN off for a step whose products have one row (a decode step of one
sequence, or a one-token prompt): torch's native bf16 matrix-vector product then streams weights at
1.6-1.7x oneDNN's speed (64-70% of the single-core read bandwidth at DeepSeek-V2-Lite's expert sizes,
against 33%), but its sums round differently in the last bit (about 0.02% of output elements), so the
engine's tokens no longer equal transformers' run with oneDNN on. With more rows the native product is
slower than oneDNN's, so other steps keep it. `onednn_inside` keeps oneDNN on inside the modules it is
given during such a step: the engine gives it the attention modules, whose small products and attention
kernel ran 2.4x slower without oneDNN (DeepSeek-V2-Lite at half width: 81 against 35 ms a token,
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


@contextlib.contextmanager
def native_single_row(enabled: bool, num_rows: int, device: str):
    """oneDNN off inside, where enabled, a step of num_rows == 1 runs on the CPU and oneDNN is on; on again
    after. The flag is torch's, process-wide: other threads' products inside also run without oneDNN, and
    a second engine's step that begins meanwhile finds it off and leaves it to this one."""
    act = enabled and num_rows == 1 and torch.device(device).type == "cpu" and torch.backends.mkldnn.enabled
    if act:
        torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        if act:
            torch.backends.mkldnn.enabled = True


def onednn_inside(modules) -> list:
    """Forward hooks that turn oneDNN on inside each module where a step turned it off (native_single_row),
    and off again after it, also when it raises; returns their handles."""
    turned_on: list[bool] = []  # per call under way: whether its pre-hook turned oneDNN on

    def enter(module, args) -> None:
        turned_on.append(not torch.backends.mkldnn.enabled)
        torch.backends.mkldnn.enabled = True

    def leave(module, args, output) -> None:
        if turned_on.pop():
            torch.backends.mkldnn.enabled = False

    return [handle for module in modules for handle in (module.register_forward_pre_hook(enter),
                                                        module.register_forward_hook(leave, always_call=True))]
