"""ProMoE's GOODPRED(i, k) = accuracy(i, k) x fetch-rate(k) of a trained `promoe` predictor on a held-out
trace: for every target MoE layer i and trained distance k, the share of a token's true top-k that the
prediction from layer i-k finds, times `prediction.fetch_rate`. Measurement only: the policy does not import it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from moestream.bench.tools.prediction import fetch_rate
from moestream.predictors.paths import expert_mask, top_k_mask

if TYPE_CHECKING:
    from moestream.policies.designs.promoe import PromoePredictor
    from moestream.trace.schema import Trace


@dataclass(frozen=True)
class GoodPred:
    layer: int  # target MoE layer i
    distance: int  # k: predicted from layer i-k
    accuracy: float  # mean share of a token's true top-k found in its predicted top-k
    fetch_rate: float  # share of a top-k prediction that k layers of compute can fetch in time
    goodpred: float  # accuracy x fetch_rate


def goodpred_table(predictor: PromoePredictor, trace: Trace, layer_compute_ms: float,
                   transfer_ms: float) -> list[GoodPred]:
    """GOODPRED(i, k) for every target layer i and trained distance k (transfer_ms: one expert over the link)."""
    k_top, rows = trace.topology.top_k, []
    actual = expert_mask(trace.experts, trace.topology.num_experts)  # [N, L, E]
    for k in range(1, predictor.num_distances + 1):
        hits = top_k_mask(predictor.trace_probabilities(trace, k), k_top) & actual[:, k:]  # [N, L-k, E]
        accuracy = hits.sum(axis=-1).mean(axis=0) / k_top  # [L-k]
        rate = fetch_rate(k, layer_compute_ms, transfer_ms, k_top)
        rows += [GoodPred(i + k, k, float(a), rate, float(a) * rate) for i, a in enumerate(accuracy)]
    return rows
