"""One rank's experts and the combine of a MoE layer's routed rows across ranks.

Every rank routes the same tokens alike; an expert's owner computes its (token, k) rows into their places of a
[S = T * K, H] buffer, other rows zero, and `combine` is an all-reduce SUM, exact: each row is nonzero on one rank
and x + 0 == x in any order (-0 + 0 = +0 aside, which the sum over k and the residual add make alike).
Knows no store, policy or scheduler."""

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
        self.ranks, self.placement = ranks, placement
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
