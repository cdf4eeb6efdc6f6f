"""`default`: calibrated probabilities from the lean routing model drive prefetch and eviction
(docs/default-policy.md). Prediction: state.IterationState; prefetch: planning.BandwidthAwarePlanner;
eviction: DefaultEviction, the resident with the longest expected wait to its next use (reuse.py); while
recency beats the model, the duel (duel.py) evicts LRU and plans no speculation. Without a trained model it
refuses to run (UntrainedPolicyError), never silently acting as LRU. Knows the policy contract, not the
mechanism, time or bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np

from moestream.contracts import POLICIES, EvictionPolicy, Observer, Prediction, PrefetchPlanner
from moestream.errors import MoestreamError
from moestream.events import IterationContext, RoutingEvent
from moestream.policies.default import reuse
from moestream.policies.default.duel import Duel, DuelEviction, DuelPlanner
from moestream.policies.default.duel import warm_up as warm_up_duel
from moestream.policies.default.features import TraceFeatures, build_vocabulary, token_keys
from moestream.policies.default.model import START, DefaultConfig, DefaultWeights, logits, sigmoid, weight_index
from moestream.policies.default.state import IterationState, compiled, warm_up
from moestream.policies.planning import BandwidthAwarePlanner
from moestream.policies.trained import TrainablePredictor, TrainedPolicy
from moestream.predictors.configs import TrainConfig
from moestream.topology import ExpertKey, Topology
from moestream.trace.schema import Trace

KIND = "default"


class UntrainedPolicyError(MoestreamError):
    """default asked to run with no trained model."""

    def __init__(self):
        super().__init__(f"policy {KIND!r} has no trained model: pass --predictor-dir DIR (made by `moestream "
                         f"train-predictor --kind {KIND} --trace TRACE --out DIR`), or --train TRACE where the "
                         f"command has it")


class DefaultPredictor(TrainablePredictor):
    kind = KIND

    def __init__(self, topology: Topology, config: DefaultConfig, train: TrainConfig):
        super().__init__(topology, config, train)
        self.weights: DefaultWeights | None = None
        self.memory: np.ndarray | None = None  # [2V, L, E] uint8 the token memory (features.TokenMemory)
        self.reuse: np.ndarray | None = None  # [L, H, F] float32 the reuse model's weights (reuse.py)
        self.vocab: dict[str, int] = {}
        self.key_kind = ""  # "tokens", "token_ids" or "" (the training trace had no token keys)
        self.state: IterationState | None = None
        self._trace: TraceFeatures | None = None
        self._shape = (topology.num_layers, topology.top_k)

    @property
    def is_trained(self) -> bool:
        return self.weights is not None

    def fit(self, trace: "Trace") -> None:
        from moestream.policies.default.training import train_weights
        keys, self.key_kind = token_keys(trace)
        self.vocab = build_vocabulary(keys, self.config.min_token_count)
        tokens = self._indices(keys, trace.num_tokens)
        self.weights, self.memory, self.reuse, self.losses = train_weights(trace, tokens, len(self.vocab) + 1,
                                                                           self.config, self.train_config)
        self._ready()

    def tensors(self) -> dict[str, np.ndarray]:
        return self.weights.arrays() | {"memory": self.memory, "reuse": self.reuse}

    def write_tensors(self, path: Path) -> None:
        from safetensors.numpy import save_file
        save_file(self.tensors(), str(path))

    def read_tensors(self, path: Path) -> dict[str, np.ndarray]:
        return load_arrays(path)

    def meta(self) -> dict:
        return super().meta() | {"vocab": self.vocab, "key_kind": self.key_kind}

    def restore(self, tensors: dict[str, np.ndarray], meta: dict) -> None:
        self.config = DefaultConfig(**meta["config"])
        tensors = dict(tensors)
        self.vocab, self.key_kind = dict(meta["vocab"]), str(meta["key_kind"])
        L, E = self.topology.num_layers, self.topology.num_experts
        self.memory = _checked("token memory", tensors.pop("memory", None), (2 * len(self.vocab) + 2, L, E), np.uint8)
        self.reuse = _checked("reuse model", tensors.pop("reuse", None), (L, len(reuse.HORIZONS), reuse.NUM_INPUTS))
        self.weights = DefaultWeights(**tensors)
        self._ready()

    def score_rows(self, trace: "Trace", layer: int, horizon_layers: int) -> np.ndarray:
        """[N, E]: what predict() gives for each row's `layer`, horizon_layers positions earlier."""
        self.require_trained()
        if self._trace is None or self._trace.trace is not trace:
            keys, kind = token_keys(trace)
            tokens = self._indices(keys) if kind == self.key_kind and keys is not None else None
            config = self.config
            self._trace = TraceFeatures(trace, tokens, self.memory, config.window_tokens, config.recall_beta,
                                        config.cut_recall)
        cut = layer - horizon_layers
        tokens = self._trace.tokens  # zeros if the trace has no keys
        if cut < -1:  # predicted at the previous token, before this one was known
            tokens = np.where(self._trace.prev >= 0, 0, tokens)
        anchor, b = weight_index(layer, cut)
        x = self._trace.features(layer, cut if b != START else -1, tokens)[:, None]  # [N, 1, 7E]
        return sigmoid(logits(self.weights, x, tokens[:, None], ([anchor], [b])))[:, 0]

    def _indices(self, keys: list | None, count: int = 0) -> np.ndarray:
        """The keys' vocabulary indices; count zeros (unknown) if there are no keys."""
        if keys is None:
            return np.zeros(count, dtype=np.int64)
        return np.fromiter((self.vocab.get(str(k), 0) for k in keys), dtype=np.int64, count=len(keys))

    def require_trained(self) -> None:
        if self.weights is None:
            raise UntrainedPolicyError()

    def reset(self) -> None:
        self.state = None if self.weights is None else IterationState(self.topology, self.weights, self.memory,
                                                                      self.reuse, self.config)

    def _ready(self) -> None:
        """A new model: fresh online state, and the kernels compiled for it."""
        self._trace = None
        self.reset()
        warm_up(self.topology, self.weights, self.memory, self.reuse, self.config)
        warm_up_duel(self.topology, self.state)
        table = np.zeros((self.topology.num_layers, self.topology.num_experts))
        compiled().largest(table.ravel(), np.zeros(1, np.int64))
        compiled().refresh(table, self.state.next_use, 0, 1)

    def begin_iteration(self, ctx: IterationContext) -> None:
        self.require_trained()
        keys = ctx.tokens if self.key_kind == "tokens" else ctx.token_ids if self.key_kind == "token_ids" else None
        self.state.begin(ctx, None if keys is None else self._indices(list(keys)))

    def observe(self, event: RoutingEvent) -> None:
        if self.state is not None:
            self.state.observe(event)

    def end_sequence(self, seq_id: int) -> None:
        if self.state is not None:
            self.state.end_sequence(seq_id)

    def predict(self, layer_now: int, horizon_layers: int) -> list[Prediction]:
        state = self.state
        L, k = self._shape
        targets = range(layer_now + 1, min(layer_now + horizon_layers, 2 * L - 1) + 1)
        if state is None or not state.active or not targets:
            return []
        scores = state.scores_ahead(layer_now, len(targets))  # [n, E]
        top = scores.argpartition(-k, axis=1)[:, -k:].tolist()  # [n, k] (the method: np.argpartition's, sooner)
        predictions, new = [], tuple.__new__  # Prediction.of_layer's records, built here
        for target, experts, probs in zip(targets, top, scores.tolist()):
            layer, ahead = (target - L, 1) if target >= L else (target, 0)
            predictions += [new(Prediction, (layer, e, probs[e], ahead)) for e in experts]
        return predictions

    def expected_wait(self) -> np.ndarray:
        """[L, E]: the expected layers until each expert is next needed (the largest goes first)."""
        if self.state is None:
            return np.zeros((self.topology.num_layers, self.topology.num_experts))
        return self.state.expected_wait()


class DefaultEviction(EvictionPolicy):
    """Evicts the resident expert whose next use is expected furthest away: the residents' expected next uses
    as an [L, E] array (-inf elsewhere), synced in the rows changed since the last victim, so a victim is one
    argmax; if that one may not go, the next longest waits in one compiled pass, and only then every resident
    ranked. Equal waits go to the smaller key."""

    max_argmax = 8  # the longest waits tried before one ranking of every resident

    def __init__(self, predictor: DefaultPredictor):
        self.predictor = predictor
        L, E = predictor.topology.num_layers, predictor.topology.num_experts
        self._keys = [ExpertKey(layer, e) for layer in range(L) for e in range(E)]  # by flat index
        self._table = np.zeros((L, E))  # [L, E] the predictor's next uses (zeros before it has any)
        self._masked = np.full((L, E), -np.inf)  # [L, E] next use of residents, -inf elsewhere (residency)
        self._flat = self._masked.ravel()  # [L * E] the same memory by flat index (_masked changes in place)
        self._seen: tuple = (None, 0, 0)  # the state, its epoch and layer that _masked reflects
        self._largest = np.zeros(self.max_argmax, np.int64)  # scratch of _set_aside

    def wait(self, key: ExpertKey) -> float:
        """key's expected next use, as the eviction ranks residents (the larger, the later)."""
        self._sync()
        return float(self._table[key])

    def victim_waits(self, capacity: int, count: int) -> list[float]:
        """The waits the next count admissions would evict, largest first: +inf per free slot (pins unknown)."""
        self._sync()
        resident = self._flat[self._flat > -np.inf]
        free = min(count, max(0, capacity - resident.size))
        taken = min(count - free, resident.size)
        largest = -np.partition(-resident, taken - 1)[:taken] if taken else resident[:0]
        return [np.inf] * free + np.sort(largest)[::-1].tolist() + [-np.inf] * (count - free - taken)

    def on_insert(self, key: ExpertKey) -> None:
        self._masked[key] = self._table[key]

    def on_remove(self, key: ExpertKey) -> None:
        self._masked[key] = -np.inf

    def victim(self, candidates: Sequence[ExpertKey]) -> ExpertKey:
        self._sync()
        index = int(self._flat.argmax())
        key = self._keys[index]
        if self._flat[index] > -np.inf and key in candidates:  # the usual case: one argmax
            return key
        return self._set_aside(candidates)

    def _set_aside(self, candidates: Sequence[ExpertKey]) -> ExpertKey:
        """The longest-waiting candidate: first among the max_argmax longest waits, else every resident ranked."""
        count, keys = compiled().largest(self._flat, self._largest), self._keys
        for index in self._largest[:count].tolist():
            if keys[index] in candidates:
                return keys[index]
        return self._ranked(candidates)

    def _sync(self) -> None:
        state = self.predictor.state
        if state is None:
            return
        seen_state, epoch, layer = self._seen
        if seen_state is not state or epoch != state.epoch:
            first, stop = 0, len(self._masked)
        elif layer != state.layer_now:
            first, stop = layer + 1, state.layer_now + 3  # observe(c) changed rows c..c+2
        else:
            return
        self._table = state.next_use
        compiled().refresh(self._masked, self._table, first, stop)
        self._seen = (state, state.epoch, state.layer_now)

    def _ranked(self, candidates: Sequence[ExpertKey]) -> ExpertKey:
        wait, flat = self._table.ravel(), np.flatnonzero(self._flat > -np.inf)  # residents
        for index in flat[np.argsort(-wait[flat], kind="stable")].tolist():  # longest wait first
            if self._keys[index] in candidates:
                return self._keys[index]
        return min(candidates, key=lambda key: (-self._table[key], key))  # candidates this policy never saw


@POLICIES.register(KIND)
class Default(TrainedPolicy):
    """moestream's lean default: a sparse linear routing model for prefetch and Belady-like eviction."""

    config_class = DefaultConfig
    _device_eviction: DefaultEviction | None = None  # the device tier's, once made
    _duel: Duel | None = None  # the model against recency (duel.py), once made

    def make_predictor(self) -> DefaultPredictor:
        return DefaultPredictor(self.topology, self.config, self.train_config)

    def make_planner(self) -> PrefetchPlanner:
        planner = BandwidthAwarePlanner(self.config.min_prefetch_probability, self.config.idle_prefetch_probability,
                                        self._wait, self._victim_waits)
        return DuelPlanner(planner, self.duel) if self.config.duel_window_tokens else planner

    def make_eviction(self, tier: str) -> EvictionPolicy:
        eviction = DefaultEviction(self.predictor)
        if tier != "device":
            return eviction
        self._device_eviction = eviction  # the planner weighs each prefetch against its victim
        return DuelEviction(eviction, self.duel) if self.config.duel_window_tokens else eviction

    def observers(self) -> list[Observer]:
        return [self.predictor, self.duel] if self.config.duel_window_tokens else [self.predictor]

    @property
    def duel(self) -> Duel:
        if self._duel is None:
            self._duel = Duel(self.topology, self._next_use, self._ahead, self.config.duel_window_tokens)
        return self._duel

    def _ahead(self, layer: int) -> np.ndarray | None:
        state = self.predictor.state
        return None if state is None or not state.active else state.scores(layer, layer + 1)

    def _next_use(self) -> np.ndarray | None:
        state = self.predictor.state
        return None if state is None else state.next_use

    def _wait(self, key: ExpertKey) -> float:
        eviction = self._device_eviction
        return -np.inf if eviction is None else eviction.wait(key)

    def _victim_waits(self, capacity: int, count: int) -> list[float]:
        eviction = self._device_eviction  # none yet: no victim to weigh
        return [np.inf] * count if eviction is None else eviction.victim_waits(capacity, count)

    def prepare(self, trace: "Trace") -> None:
        self.predictor.require_trained()


def _checked(name: str, array: np.ndarray | None, shape: tuple, dtype=None) -> np.ndarray:
    """A saved array, if it has this version's shape (and dtype) (else ValueError)."""
    if array is None or array.shape != shape or (dtype is not None and array.dtype != dtype):
        found = "none" if array is None else (f"{array.dtype} " if dtype else "") + str(list(array.shape))
        raise ValueError(f"its {name} is {found}, this version reads {'uint8 ' if dtype else ''}{list(shape)}: it was "
                         f"saved by an older moestream; retrain it with `moestream train-predictor --kind {KIND}`")
    return array


# The token memory (11 MiB for DeepSeek-V2-Lite's vocabulary) loads as a copy-on-write map of the file: a run
# reads two rows a token, so only those pages take memory, reclaimable under a limit; the rest is read.
MAPPED = ("memory",)
NUMPY_DTYPES = {"U8": np.uint8, "I8": np.int8, "F16": np.float16, "F32": np.float32, "I32": np.int32, "I64": np.int64}


def load_arrays(path: Path) -> dict[str, np.ndarray]:
    """A trained model's weights.safetensors as numpy arrays, without torch."""
    from safetensors import safe_open
    with safe_open(str(path), framework="numpy") as weights:  # checks the header
        tensors = {name: weights.get_tensor(name) for name in weights.keys() if name not in MAPPED}
    with open(path, "rb") as handle:  # safetensors: an 8-byte header size, a JSON header, then the data
        size = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(size))
    for name in (n for n in MAPPED if n in header):
        info = header[name]
        tensors[name] = np.asarray(np.memmap(path, np.dtype(NUMPY_DTYPES[info["dtype"]]), "c",
                                             8 + size + info["data_offsets"][0], tuple(info["shape"])))
    return tensors
