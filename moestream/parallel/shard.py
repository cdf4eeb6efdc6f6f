"""One rank's experts and the combine of a MoE layer's routed rows across ranks.

Every rank runs the same dense part on the same tokens, so every rank holds the same routing
[T, K] of a layer. The rank that owns an expert (the placement) computes all of that expert's
(token, k) rows, exactly as one process computes them (the same rows through the same matrix
products, `runtime/layer_experts.py`), into their own places of a [S = T * K, H] buffer; the rows of
experts owned elsewhere stay zero. `combine` is an all-reduce SUM of those buffers.

Why it is exact: each row is nonzero on exactly one rank, and every other rank adds exact zeros.
x + 0 == x in IEEE arithmetic for every x (NaN and infinities included), whatever the order or tree
in which the backend adds the ranks' buffers, so each summed row holds the owner's bits. (The one
exception is the sign of a zero: -0 + 0 = +0; the sum over k and the residual add that follow give
the same result for either zero unless all of them are zero.) The engine then sums the rows over k
in its usual fixed order (`OffloadedExperts._combined`), on every rank alike, so every rank's layer
output equals one process's bit for bit. This module knows no store, policy or scheduler.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from moestream.parallel.placement import Placement
from moestream.parallel.ranks import RankContext
from moestream.topology import ExpertKey


class ExpertShard:
    """The experts one rank owns under a placement, and the layer combine (timed)."""

    def __init__(self, placement: Placement, ranks: RankContext):
        self.ranks = ranks
        self.placement = placement
        self.owned = np.asarray(placement.owners) == ranks.rank  # [L, E] bool
        self.combine_s = 0.0  # time in `combine`, this rank

    def owns(self, key: ExpertKey) -> bool:
        return bool(self.owned[key.layer, key.expert])

    def owned_rows(self, layer: int, ids: np.ndarray) -> np.ndarray:
        return self.owned[layer][ids]  # [S] bool

    def combine(self, layer: int, out: torch.Tensor) -> torch.Tensor:
        """[S, H] this rank's rows, others zero -> the same buffer holding every rank's rows."""
        began = time.perf_counter()
        with self.ranks.collective(f"the combine of MoE layer {layer}"):
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.ranks.steps)
        self.combine_s += time.perf_counter() - began
        return out

    def reset(self) -> None:
        self.combine_s = 0.0
