"""How far ahead each expert use is used again, on a trace replayed as one decode stream.

For every access (token t, layer l, expert e), the next use is the first later token of the
stream that routes to e at l. Its distance in tokens, and whether that token belongs to the same
sequence, say how much foresight an eviction policy needs: Belady keeps the experts whose next
use is nearest, so a policy that cannot see that far cannot match it.
Knows traces, not policies or caches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moestream.predictors.paths import expert_mask
from moestream.trace.schema import Trace

TOKEN_SPANS = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class ReuseProfile:
    num_accesses: int
    reused_share: float  # accesses whose expert is used again later in the stream
    median_tokens: float  # median distance to the next use, over the reused accesses
    same_sequence_share: float  # of the reused accesses, next use in the same sequence
    within_tokens: dict[int, float] = field(default_factory=dict)  # span -> share reused within it


def reuse_profile(trace: Trace) -> ReuseProfile:
    distances, same = next_uses(trace)
    if not len(distances):
        return ReuseProfile(0, 0.0, 0.0, 0.0, {span: 0.0 for span in TOKEN_SPANS})
    reused = distances > 0
    num_reused = max(1, int(reused.sum()))
    return ReuseProfile(
        num_accesses=len(distances),
        reused_share=float(reused.mean()),
        median_tokens=float(np.median(distances[reused])) if reused.any() else 0.0,
        same_sequence_share=float(same[reused].sum() / num_reused),
        within_tokens={span: float((reused & (distances <= span)).sum() / num_reused) for span in TOKEN_SPANS},
    )


def next_uses(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """[A] tokens to each distinct (token, layer, expert) access's next use (0: never), and [A]
    whether that next use is in the same sequence."""
    distances, same = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=bool)]
    if not trace.num_tokens:
        return distances[0], same[0]
    for layer in range(trace.topology.num_layers):
        mask = expert_mask(trace.experts[:, layer], trace.topology.num_experts)  # [N, E]
        experts, rows = np.nonzero(mask.T)  # grouped by expert, rows ascending within each
        later = np.r_[rows[1:], 0]
        has_next = np.r_[experts[1:] == experts[:-1], False]
        distances.append(np.where(has_next, later - rows, 0))
        same.append(has_next & (trace.seq_ids[later] == trace.seq_ids[rows]))
    return np.concatenate(distances), np.concatenate(same)
