"""Records the engine's routing events into a Trace, as an Observer beside the policies.

Each iteration is held until its last MoE layer has routed, then its rows are filed under their sequences;
`to_trace` groups rows by sequence (in order of first appearance), ordered by position. Optional fields are kept
when every recorded row carries them, else dropped with a log line; a sequence id reused after end_sequence gets
a fresh id. Knows events and the schema, not the engine."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from moestream.contracts import Observer
from moestream.errors import TraceError
from moestream.events import IterationContext, RoutingEvent
from moestream.topology import Topology
from moestream.trace.schema import Trace

log = logging.getLogger(__name__)

LAYER_FIELDS = ("gate_weights", "gate_probs", "hidden")  # per (token, layer)
ROW_FIELDS = ("token_ids", "tokens", "embeddings")  # per token


@dataclass
class _Rows:
    """Rows of one sequence, in the order they were recorded."""

    seq_id: int
    order: int  # rank of first appearance
    chunks: list[dict] = field(default_factory=list)


class TraceRecorder(Observer):
    def __init__(self, topology: Topology, fields: tuple[str, ...] = LAYER_FIELDS + ROW_FIELDS, source: str = ""):
        unknown = set(fields) - set(LAYER_FIELDS + ROW_FIELDS)
        if unknown:
            raise ValueError(f"unknown trace fields {sorted(unknown)}")
        self.topology, self.fields, self.source = topology, tuple(fields), source
        self.texts: dict[int, str] = {}
        self._ctx: IterationContext | None = None
        self._layers: dict[int, RoutingEvent] = {}
        self._open: dict[int, _Rows] = {}
        self._done: list[_Rows] = []
        self._missing, self._present = set(), set()  # optional fields some iteration lacked, and fields some had
        self._num_sequences = 0

    def begin_iteration(self, ctx: IterationContext) -> None:
        self._flush()
        self._ctx = ctx

    def observe(self, event: RoutingEvent) -> None:
        if self._ctx is None:
            raise TraceError("routing event before begin_iteration")
        if not 0 <= event.layer < self.topology.num_layers or event.layer in self._layers:
            raise TraceError(f"unexpected routing event for MoE layer {event.layer} at step {self._ctx.step}")
        if event.expert_ids.shape != (self._ctx.num_tokens, self.topology.top_k):
            raise TraceError(f"layer {event.layer} routed {event.expert_ids.shape}, "
                             f"expected ({self._ctx.num_tokens}, {self.topology.top_k})")
        self._layers[event.layer] = event

    def end_sequence(self, seq_id: int) -> None:
        self._flush()
        rows = self._open.pop(int(seq_id), None)
        if rows is not None:
            self._done.append(rows)

    def set_text(self, seq_id: int, text: str) -> None:
        self.texts[int(seq_id)] = text

    def to_trace(self) -> Trace:
        """Everything recorded so far (a finished iteration is included, a partial one is an error)."""
        self._flush()
        sequences = sorted(self._done + list(self._open.values()), key=lambda s: s.order)
        chunks = [_take(c, np.argsort(c["positions"], kind="stable")) for c in (_concat(s.chunks) for s in sequences)]
        return self._build(chunks, _unique_ids([s.seq_id for s in sequences]))

    def _flush(self) -> None:
        if self._ctx is None:
            return
        if len(self._layers) != self.topology.num_layers:
            if self._layers:
                raise TraceError(f"step {self._ctx.step} routed {len(self._layers)} of {self.topology.num_layers} "
                                 "MoE layers")
            self._ctx = None
            return
        rows = self._iteration_rows()
        for seq in np.unique(self._ctx.seq_ids).tolist():
            if seq not in self._open:
                self._open[seq] = _Rows(seq, self._num_sequences)
                self._num_sequences += 1
            self._open[seq].chunks.append(_take(rows, np.flatnonzero(self._ctx.seq_ids == seq)))
        self._ctx, self._layers = None, {}

    def _iteration_rows(self) -> dict:
        ctx, events = self._ctx, [self._layers[layer] for layer in range(self.topology.num_layers)]
        rows = {"experts": np.stack([e.expert_ids for e in events], axis=1).astype(np.int16),  # [T, L, K]
                "positions": np.asarray(ctx.positions, dtype=np.int32),
                "is_prefill": np.full(ctx.num_tokens, ctx.is_prefill)}
        for name in self.fields:
            if (value := self._field(name, ctx, events)) is None:
                self._missing.add(name)
            else:
                self._present.add(name)
                rows[name] = value
        return rows

    def _field(self, name: str, ctx: IterationContext, events: list[RoutingEvent]):
        if name in LAYER_FIELDS:
            values = [getattr(e, name) for e in events]
            return None if any(v is None for v in values) else np.stack(values, axis=1).astype(np.float16)
        if (value := getattr(ctx, name)) is None:
            return None
        if name == "tokens":
            return np.asarray(value, dtype=object)
        return np.asarray(value, dtype=np.int32 if name == "token_ids" else np.float16)

    def _build(self, chunks: list[dict], seq_ids: list[int]) -> Trace:
        counts = [len(c["positions"]) for c in chunks]
        keep = [name for name in self.fields if name not in self._missing]
        for name in sorted(self._present & self._missing):
            log.warning("trace field %s was missing from some iterations: not recorded", name)
        data = {"experts": np.zeros((0, self.topology.num_layers, self.topology.top_k), dtype=np.int16),
                "positions": np.zeros(0, np.int32), "is_prefill": np.zeros(0, bool)}
        if chunks:
            data = {name: np.concatenate([c[name] for c in chunks]) for name in (*data, *keep)}
        return Trace(topology=self.topology, experts=data["experts"], positions=data["positions"],
                     seq_ids=np.repeat(np.asarray(seq_ids, dtype=np.int32), counts).astype(np.int32),
                     is_prefill=data["is_prefill"], token_ids=data.get("token_ids"),
                     tokens=None if "tokens" not in data else [str(t) for t in data["tokens"]],
                     texts={s: self.texts[s] for s in seq_ids if s in self.texts},
                     source=self.source or "moestream recorder",
                     **{name: data.get(name) for name in ("gate_weights", "gate_probs", "hidden", "embeddings")})


def _take(rows: dict, pick: np.ndarray) -> dict:
    return {name: value[pick] for name, value in rows.items()}


def _concat(chunks: list[dict]) -> dict:
    names = set.intersection(*(set(c) for c in chunks))
    return {name: np.concatenate([c[name] for c in chunks]) for name in names}


def _unique_ids(seq_ids: list[int]) -> list[int]:
    """The same ids, except that a repeated one becomes a fresh id above all others."""
    seen, result, fresh = set(), [], max(seq_ids, default=-1) + 1
    for seq in seq_ids:
        if seq in seen:
            seq, fresh = fresh, fresh + 1
        seen.add(seq)
        result.append(seq)
    return result
