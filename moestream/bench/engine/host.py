"""The host-RAM tier in `bench engine` and `bench quant` (`--host-budget`): whether it fits, the copy link that
serves it, and the warm-up that fills it before the timed steps.

- whether it fits is `moestream.memory_plan.check_host_room`'s (as for `generate` and `serve`).
- `copy_gbps`: the host -> device copy's bandwidth through the store's own copy link (`LINKS`: a pinned,
  asynchronous H2D copy on CUDA, a memcpy on the CPU), the link the planner sees when the host tier holds
  every expert.
- `fill_tiers`: the child's warm-up: the first experts in layer order brought through the store, as many as
  its larger tier holds, so that the host tier (or, where the store merges the tiers, the one tier) is full.
- where the store keeps a host tier apart (CUDA, --sync, or --host-compute other than off) is
  `moestream.store.factory.merges_tiers`'s; on the CPU otherwise the host budget joins the device tier, and the
  bench says so.
"""

from __future__ import annotations

import time

from moestream.budget import Budget
from moestream.errors import MoestreamError
from moestream.memory_plan import FLAG

COPY_BYTES = 256 * 2**20  # moved per round of the copy measurement
COPY_ROUNDS = 3  # after one warm-up round; the best is kept


def budget_text(budget: Budget | str) -> str:
    """A budget as a RunSpec carries it: a share ("25%") or bytes ("1048576B"); `auto` is refused."""
    if budget == "auto":
        raise MoestreamError(f"{FLAG} auto: the bench takes a ratio (1.0) or a size (8GiB); `moestream plan` "
                             "says what fits")
    budget = Budget.parse(budget, FLAG)
    return f"{budget.ratio * 100:g}%" if budget.ratio is not None else f"{budget.size_bytes}B"


def copy_gbps(expert_bytes: int, device: str) -> float:
    """The store's host -> device copy link's bandwidth (GB/s): slots of expert_bytes copied one by one from
    host slots (pinned on CUDA) into device slots, COPY_BYTES a round, the best of COPY_ROUNDS."""
    import torch

    from moestream.store.pool import SlotPool
    from moestream.store.streams import make_link

    count = max(1, min(64, COPY_BYTES // expert_bytes))
    host = SlotPool(count, expert_bytes, "cpu", pin_memory=device.startswith("cuda"))
    dest = SlotPool(count, expert_bytes, device)
    host.data.fill_(1)  # touched: no page faults in the copies
    dest.data.zero_()
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)  # the zeros written before the copies start
    link, best = make_link(device), 0.0
    repeats = max(1, COPY_BYTES // (count * expert_bytes))
    for round_ in range(COPY_ROUNDS + 1):
        began = time.perf_counter()
        for _ in range(repeats):
            for i in range(count):
                link.copy(dest.slot(i), host.slot(i))
        link.synchronize()
        seconds = time.perf_counter() - began
        if round_:  # the first round warms the link up
            best = max(best, repeats * count * expert_bytes / seconds / 1e9)
    host.release()
    dest.release()
    return best


def fill_tiers(engine) -> int:
    """Brings the first experts in layer order through the engine's store, as many as its larger tier holds,
    a layer's worth (at most the device tier) at a time, each used once and released: the host tier holds
    them after (the device tier the last it could). Returns how many were brought."""
    import itertools

    store = engine.store
    keys = engine.owned_keys()[: max(store.host_slots, store.device_slots)]
    for _, layer in itertools.groupby(keys, key=lambda key: key.layer):
        layer = list(layer)
        for start in range(0, len(layer), store.device_slots):
            store.release(store.acquire(layer[start : start + store.device_slots]))
    store.wait_idle()
    return len(keys)
