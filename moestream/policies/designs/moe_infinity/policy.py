"""MoE-Infinity (Xue et al., "MoE-Infinity: Activation-Aware Expert Offloading"): prefetching and
caching guided by sequence-level Expert Activation Matrices.

- EAM: per sequence, an [L, E] count of the tokens each expert served so far; the EAMC: at most P
  EAMs kept from a dataset (fit: one per training sequence), k-means medoids (`build_collection`).
- Algorithm 1 (prefetch): the sequence's nearest EAM gives, for every later layer fl, ratio =
  eam[fl][e] / sum(eam[fl]) (the score) and priority (ratio + eps) * (1 - fl / L). As in the released
  implementation, experts the matched EAM never activated are not submitted (`prefetch_unseen` submits them).
- Algorithm 2 (replacement): evict the lowest (ratio + eps) * (1 - l / L), ratio in the sequence's own EAM.
- Distribution shift: after `rebuild_after_poor` sequences whose top-k accuracy from their match ends below
  `poor_accuracy`, the EAMC is rebuilt from the dataset plus those on a daemon thread and installed exactly
  `rebuild_lag_sequences` ended sequences later (waiting if needed), so results never depend on thread
  timing; a lag of 0 rebuilds inline.
- Batches: one EAM per sequence; the ratios of their matches are averaged.
Knows the cache's contents only through a CacheView; not time or bytes.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import ClassVar, Sequence

import numpy as np

from moestream.contracts import (
    POLICIES,
    CacheView,
    EvictionPolicy,
    Policy,
    Prediction,
    Predictor,
    PrefetchPlanner,
    TransferRequest,
)
from moestream.events import IterationContext, RoutingEvent
from moestream.policies.eviction import ScoredEviction
from moestream.policies.planning import ranked
from moestream.predictors.paths import unit_rows
from moestream.topology import Topology
from moestream.trace.schema import Trace

log = logging.getLogger(__name__)


def sequence_eams(trace: "Trace") -> np.ndarray:
    """One EAM per sequence of the trace, in trace order: [S, L, E] float32 token counts."""
    t = trace.topology
    offsets = (np.arange(t.num_layers) * t.num_experts)[None, :, None]  # [1, L, 1]
    flat = trace.experts.astype(np.int64) + offsets  # [N, L, K] index into L*E
    bounds = trace.sequence_bounds()
    eams = np.zeros((len(bounds), t.num_layers * t.num_experts), dtype=np.float32)
    for i, (_, start, end) in enumerate(bounds):
        eams[i] = np.bincount(flat[start:end].ravel(), minlength=t.num_layers * t.num_experts)
    return eams.reshape(len(bounds), t.num_layers, t.num_experts)


def layer_shares(eams: np.ndarray) -> np.ndarray:
    """ratio[l][e] = eam[l][e] / sum(eam[l]); all-zero rows stay zero. [..., L, E]."""
    sums = eams.sum(axis=-1, keepdims=True)
    return np.divide(eams, sums, out=np.zeros_like(eams, dtype=np.float32), where=sums > 0)


def build_collection(eams: np.ndarray, capacity: int, seed: int = 0) -> np.ndarray:
    """At most `capacity` representative EAMs [P, L, E]: per k-means cluster, the member nearest the centroid.
    k-means runs on flattened EAMs with L2-normalised rows: ||x - y||^2 = 2 L (1 - mean_l cos(x[l], y[l]))
    (a zero row counts as cosine 0), so it ranks pairs exactly like the paper's distance."""
    points = unit_rows(eams).reshape(len(eams), -1)  # [n, L*E]
    num_clusters = min(capacity, len(np.unique(points, axis=0)))
    if num_clusters >= len(eams):
        return eams.astype(np.float32, copy=True)
    from sklearn.cluster import KMeans
    kmeans = KMeans(n_clusters=num_clusters, n_init=1, random_state=seed).fit(points)
    spread = ((points - kmeans.cluster_centers_[kmeans.labels_]) ** 2).sum(axis=1)  # [n]
    order = np.lexsort((spread, kmeans.labels_))
    labels = kmeans.labels_[order]
    medoids = order[np.r_[True, labels[1:] != labels[:-1]]]
    return eams[np.sort(medoids)].astype(np.float32, copy=True)


@dataclass(frozen=True)
class EAMCollection:
    """The EAMC in the forms matching and prefetching need; replaced whole, never mutated."""

    eams: np.ndarray  # [P, L, E] token counts
    top_k: int  # experts routed per token
    version: int = 0
    ratios: np.ndarray = field(init=False)  # [P, L, E] per-layer shares
    top: np.ndarray = field(init=False)  # [P, L, E] bool: the top_k experts of each row
    unit: np.ndarray = field(init=False)  # [L, E, P] unit rows, laid out for per-layer matching

    def __post_init__(self):
        object.__setattr__(self, "ratios", layer_shares(self.eams))
        ranks = np.argsort(np.argsort(-self.ratios, axis=-1, kind="stable"), axis=-1)
        object.__setattr__(self, "top", ranks < self.top_k)
        object.__setattr__(self, "unit", np.ascontiguousarray(unit_rows(self.eams).transpose(1, 2, 0)))


@dataclass(frozen=True)
class MoEInfinityConfig:
    num_eams: int = 300  # P, the EAMC capacity (not tuned to any data)
    eps: float = 1e-6  # the epsilon of Algorithms 1 and 2
    refine: bool = True  # re-match at every layer; False: once per iteration
    prefetch_unseen: bool = False  # also submit experts the matched EAM never activated
    poor_accuracy: float = 0.5  # a sequence below this top-k accuracy is a poor prediction
    rebuild_after_poor: int = 32  # poor sequences that trigger a rebuild of the EAMC
    rebuild_lag_sequences: int = 8  # ended sequences between a rebuild's start and its install
    max_dataset_eams: int = 4096  # EAMs kept for rebuilds (the oldest go first)
    seed: int = 0

    def __post_init__(self):
        if self.num_eams < 1 or self.rebuild_after_poor < 1 or self.max_dataset_eams < 1:
            raise ValueError("num_eams, rebuild_after_poor and max_dataset_eams must be >= 1")
        if self.eps < 0 or not 0.0 <= self.poor_accuracy <= 1.0 or self.rebuild_lag_sequences < 0:
            raise ValueError("need eps >= 0, poor_accuracy in [0, 1], rebuild_lag_sequences >= 0")


class _Sequence:
    """One sequence's EAM, its per-layer cosines with the EAMC, its match and its accuracy."""

    def __init__(self, num_layers: int, num_experts: int):
        self.counts = np.zeros((num_layers, num_experts), dtype=np.float32)  # [L, E]
        self.cosines: np.ndarray | None = None  # [L, P] cos(counts[l], eamc[p][l])
        self.version = -1
        self.match = -1  # index in the EAMC of the latest nearest EAM
        self.hits = 0
        self.total = 0

    def nearest(self, eamc: EAMCollection) -> int:
        """Algorithm 1's FIND_NEAREST; -1 while the sequence has no routing yet."""
        if self.version != eamc.version:
            self.cosines = np.einsum("le,lep->lp", unit_rows(self.counts), eamc.unit)
            self.version = eamc.version
        similarity = self.cosines.sum(axis=0)  # [P]
        self.match = int(np.argmax(similarity)) if self.counts.any() else -1
        return self.match

    def add(self, layer: int, experts: np.ndarray, eamc: EAMCollection | None) -> None:
        row = self.counts[layer]  # [E], updated in place
        np.add.at(row, experts.ravel(), 1.0)
        if eamc is not None and self.version == eamc.version:
            self.cosines[layer] = (row / np.sqrt(row @ row)) @ eamc.unit[layer]  # [P]

    def score(self, layer: int, experts: np.ndarray, eamc: EAMCollection | None) -> None:
        """Count how many routed experts the matched EAM's top-k at this layer foresaw."""
        if eamc is None or self.match < 0 or self.version != eamc.version:
            return
        self.hits += int(eamc.top[self.match, layer][experts].sum())
        self.total += experts.size


def _fulfil(future: Future, eams: np.ndarray, capacity: int, seed: int) -> None:
    future.set_running_or_notify_cancel()
    try:
        future.set_result(build_collection(eams, capacity, seed))
    except BaseException as error:  # re-raised by whoever takes the result
        future.set_exception(error)


class _Rebuild:
    """Builds a new EAMC on a worker thread; hands it over after a fixed number of ended sequences."""

    def __init__(self, capacity: int, seed: int, lag_sequences: int):
        self.capacity, self.seed, self.lag = capacity, seed, lag_sequences
        self._future: Future | None = None
        self._countdown = 0

    @property
    def pending(self) -> bool:
        return self._future is not None

    def start(self, eams: np.ndarray) -> np.ndarray | None:
        """Begin a rebuild; the new EAMs at once when the lag is 0, else None."""
        if self.lag == 0:
            return build_collection(eams, self.capacity, self.seed)
        self._countdown = self.lag
        self._future = Future()
        # Not a ThreadPoolExecutor: the interpreter joins its threads at exit, so a k-means still running
        # held Ctrl-C for as long as it took (issue 43).
        threading.Thread(target=_fulfil, args=(self._future, eams, self.capacity, self.seed),
                         name="moestream-eamc", daemon=True).start()
        return None

    def sequence_ended(self) -> np.ndarray | None:
        """The rebuilt EAMs when their install point has come (waiting if needed), else None."""
        if self._future is None:
            return None
        self._countdown -= 1
        if self._countdown > 0:
            return None
        future, self._future = self._future, None
        try:
            return future.result()
        except BaseException as error:  # raised in the worker, re-raised in the predictor's thread
            raise RuntimeError("rebuilding the EAM collection failed") from error


class MoEInfinityPredictor(Predictor):
    """Tracks an EAM per sequence; predicts from the nearest EAM of the EAMC (Algorithm 1)."""

    def __init__(self, topology: Topology, config: MoEInfinityConfig = MoEInfinityConfig()):
        super().__init__(topology)
        self.config = config
        self.eamc: EAMCollection | None = None
        self.dataset = np.zeros((0, topology.num_layers, topology.num_experts), dtype=np.float32)
        self.num_rebuilds = 0
        self._versions = 0  # collections installed so far: a cached cosine is valid for one only
        self._rebuild = _Rebuild(config.num_eams, config.seed, config.rebuild_lag_sequences)
        self._poor: list[np.ndarray] = []
        self.reset()

    def fit(self, trace: "Trace") -> None:
        self.dataset = sequence_eams(trace)[-self.config.max_dataset_eams :]
        self._install(build_collection(self.dataset, self.config.num_eams, self.config.seed), rebuilt=False)

    def reset(self) -> None:
        self._sequences: dict[int, _Sequence] = {}
        self._active: tuple[int, ...] = ()
        self._plan: np.ndarray | None = None  # [L, E] combined ratios of the current matches
        self._current_shares: np.ndarray | None = None

    def begin_iteration(self, ctx: IterationContext) -> None:
        self._active = tuple(int(s) for s in np.unique(ctx.seq_ids))
        self._plan = self._current_shares = None

    def observe(self, event: RoutingEvent) -> None:
        seqs, inverse = np.unique(event.seq_ids, return_inverse=True)
        if not self._active:
            self._active = tuple(int(s) for s in seqs)
        for i, seq in enumerate(seqs.tolist()):
            state = self._sequence(seq)
            experts = event.expert_ids if len(seqs) == 1 else event.expert_ids[inverse == i]  # [T_seq, K]
            state.score(event.layer, experts, self.eamc)
            state.add(event.layer, experts, self.eamc)
        self._current_shares = None

    def end_sequence(self, seq_id: int) -> None:
        rebuilt = self._rebuild.sequence_ended()
        if rebuilt is not None:
            self._install(rebuilt, rebuilt=True)
        state = self._sequences.pop(seq_id, None)
        if state is not None and state.total and state.hits / state.total < self.config.poor_accuracy:
            self._record_poor(state.counts)

    def predict(self, layer_now: int, horizon_layers: int) -> list[Prediction]:
        first, last = layer_now + 1, min(self.topology.num_layers - 1, layer_now + horizon_layers)
        if first > last or self.eamc is None:
            return []
        if self.config.refine or self._plan is None:
            self._plan = self._match()
        if self._plan is None:
            return []
        block = self._plan[first : last + 1]  # [D, E]
        layers, experts = np.nonzero(block >= 0 if self.config.prefetch_unseen else block > 0)
        scores = np.minimum(block[layers, experts], 1.0).tolist()
        return [Prediction(first + l, e, s) for l, e, s in zip(layers.tolist(), experts.tolist(), scores)]

    def eam(self, seq_id: int) -> np.ndarray:
        """[L, E] a copy of a live sequence's EAM (zeros for an unknown sequence)."""
        state = self._sequences.get(seq_id)
        shape = (self.topology.num_layers, self.topology.num_experts)
        return np.zeros(shape, np.float32) if state is None else state.counts.copy()

    def current_shares(self) -> np.ndarray:
        """[L, E]: the active sequences' own EAM rows as shares, averaged (Algorithm 2's ratio)."""
        if self._current_shares is None:
            states = [self._sequences[s] for s in self._active if s in self._sequences]
            shape = (self.topology.num_layers, self.topology.num_experts)
            shares = [layer_shares(state.counts) for state in states]
            self._current_shares = np.mean(shares, axis=0) if shares else np.zeros(shape, np.float32)
        return self._current_shares

    def _sequence(self, seq: int) -> _Sequence:
        if seq not in self._sequences:
            self._sequences[seq] = _Sequence(self.topology.num_layers, self.topology.num_experts)
        return self._sequences[seq]

    def _match(self) -> np.ndarray | None:
        """[L, E]: the mean over active sequences of their nearest EAM's ratios, None if none matched."""
        matches = [self._sequences[s].nearest(self.eamc) for s in self._active if s in self._sequences]
        matches = [m for m in matches if m >= 0]
        if len(matches) <= 1:
            return self.eamc.ratios[matches[0]] if matches else None
        return self.eamc.ratios[matches].mean(axis=0)

    def _record_poor(self, counts: np.ndarray) -> None:
        self._poor.append(counts)
        if len(self._poor) < self.config.rebuild_after_poor or self._rebuild.pending:
            return
        self.dataset = np.concatenate([self.dataset, np.stack(self._poor)])[-self.config.max_dataset_eams :]
        self._poor = []
        log.info("moe-infinity: rebuilding the EAMC from %d EAMs", len(self.dataset))
        rebuilt = self._rebuild.start(self.dataset)
        if rebuilt is not None:
            self._install(rebuilt, rebuilt=True)

    def _install(self, eams: np.ndarray, rebuilt: bool) -> None:
        self.num_rebuilds += rebuilt
        self.eamc = EAMCollection(eams, self.topology.top_k, self._versions)
        self._versions += 1
        self._plan = None


class MoEInfinityPlanner(PrefetchPlanner):
    """Algorithm 1's queue order: priority = (ratio + eps) * (1 - fl / L), at most `capacity` requests."""

    def __init__(self, eps: float):
        self.eps = eps

    def plan(self, predictions: Sequence[Prediction], view: CacheView) -> list[TransferRequest]:
        eps, num_layers = self.eps, view.num_layers
        best = ranked(predictions, view, lambda score, layer, ahead: (score + eps) * (1.0 - layer / num_layers), -1.0)
        return [TransferRequest(key, priority) for key, priority, _, _ in best]


class MoEInfinityEviction(ScoredEviction):
    """Algorithm 2: evict the lowest (ratio + eps) * (1 - layer / L); ties go to the least recent."""

    def __init__(self, predictor: MoEInfinityPredictor, eps: float):
        super().__init__()
        self.predictor = predictor
        self.eps = eps

    def score_inputs(self) -> tuple:
        return (self.predictor.current_shares(),)

    def score_matrix(self) -> np.ndarray:
        num_layers = self.predictor.topology.num_layers
        layer_weight = 1.0 - np.arange(num_layers)[:, None] / num_layers  # [L, 1]
        return (self.predictor.current_shares() + self.eps) * layer_weight  # [L, E]


@POLICIES.register("moe-infinity")
class MoEInfinity(Policy):
    """MoE-Infinity: EAMC matching refined at every layer, Algorithm 1 prefetch, Algorithm 2 eviction."""

    config: ClassVar[MoEInfinityConfig] = MoEInfinityConfig()

    def make_predictor(self) -> MoEInfinityPredictor:
        self.eam_predictor = MoEInfinityPredictor(self.topology, self.config)
        return self.eam_predictor

    def make_planner(self) -> PrefetchPlanner:
        return MoEInfinityPlanner(self.config.eps)

    def make_eviction(self, tier: str) -> EvictionPolicy:
        return MoEInfinityEviction(self.eam_predictor, self.config.eps)


@POLICIES.register("moe-infinity-norefine")
class MoEInfinityNoRefine(MoEInfinity):
    """Ablation: the nearest EAM is found once per iteration, not refined at later layers."""

    config: ClassVar[MoEInfinityConfig] = replace(MoEInfinityConfig(), refine=False)
