"""The in-memory routing trace: every token of every sequence, its experts at every MoE layer. Rows are
tokens, grouped by sequence and ordered by position. Optional fields are None when the source did not
record them; consumers must say so rather than invent them."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from moestream.errors import TraceError
from moestream.topology import Topology

OPTIONAL_FIELDS = ("token_ids", "gate_weights", "gate_probs", "hidden", "embeddings")


@dataclass
class Trace:
    topology: Topology
    experts: np.ndarray  # [N, L, K] int16: routed expert ids (order within K means nothing)
    seq_ids: np.ndarray  # [N] int32
    positions: np.ndarray  # [N] int32: position in its sequence, from 0
    is_prefill: np.ndarray  # [N] bool: token was part of its prompt (else generated in decode)
    token_ids: np.ndarray | None = None  # [N] int32
    tokens: list[str] | None = None  # [N] token strings
    gate_weights: np.ndarray | None = None  # [N, L, K] float16: weights of the routed experts
    gate_probs: np.ndarray | None = None  # [N, L, E] float16: full router distribution
    hidden: np.ndarray | None = None  # [N, L, H] float16: each router's input
    embeddings: np.ndarray | None = None  # [N, H] float16: embedding-layer output
    texts: dict[int, str] = field(default_factory=dict)  # seq_id -> prompt text
    source: str = ""

    def __post_init__(self):
        n, t = len(self.seq_ids), self.topology
        expected = (n, t.num_layers, t.top_k)
        if self.experts.shape != expected:
            raise TraceError(f"experts has shape {self.experts.shape}, topology says {expected}")
        for name in ("positions", "is_prefill"):
            if len(getattr(self, name)) != n:
                raise TraceError(f"{name} has {len(getattr(self, name))} rows, expected {n}")
        if n and (self.experts.min() < 0 or self.experts.max() >= t.num_experts):
            raise TraceError(f"expert ids must lie in [0, {t.num_experts})")
        for name in (*OPTIONAL_FIELDS, "tokens"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise TraceError(f"{name} has {len(value)} rows, expected {n}")
        if self.gate_probs is not None and self.gate_probs.shape[1:] != (t.num_layers, t.num_experts):
            raise TraceError(f"gate_probs has shape {self.gate_probs.shape}, disagreeing with topology")

    @property
    def num_tokens(self) -> int:
        return len(self.seq_ids)

    def sequence_bounds(self) -> list[tuple[int, int, int]]:
        """(seq_id, start row, end row) of each sequence, in trace order."""
        if not self.num_tokens:
            return []
        starts = np.flatnonzero(np.r_[True, self.seq_ids[1:] != self.seq_ids[:-1]])
        ends = np.r_[starts[1:], self.num_tokens]
        return [(int(self.seq_ids[s]), int(s), int(e)) for s, e in zip(starts, ends)]

    def sequence_ids(self) -> list[int]:
        return [seq for seq, _, _ in self.sequence_bounds()]

    def select(self, seq_ids) -> "Trace":
        """The sub-trace of the given sequences, keeping trace order."""
        return self.take(np.flatnonzero(np.isin(self.seq_ids, np.asarray(list(seq_ids)))))

    def take(self, rows: np.ndarray) -> "Trace":
        pick = {name: None if getattr(self, name) is None else getattr(self, name)[rows] for name in OPTIONAL_FIELDS}
        tokens = None if self.tokens is None else [self.tokens[i] for i in rows]
        kept = set(self.seq_ids[rows].tolist())
        texts = {k: v for k, v in self.texts.items() if k in kept}
        return replace(self, experts=self.experts[rows], seq_ids=self.seq_ids[rows], positions=self.positions[rows],
                       is_prefill=self.is_prefill[rows], tokens=tokens, texts=texts, **pick)

    def split(self, test_fraction: float, seed: int = 0) -> tuple["Trace", "Trace"]:
        """(train, test): a seeded random split by whole sequences."""
        seqs = np.array(self.sequence_ids())
        rng = np.random.default_rng(seed)
        test = rng.choice(seqs, size=max(1, int(round(len(seqs) * test_fraction))), replace=False)
        return self.select(np.setdiff1d(seqs, test)), self.select(np.sort(test))
