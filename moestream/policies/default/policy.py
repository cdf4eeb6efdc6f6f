"""`default`: moestream's own policy. Calibrated probabilities from a learned routing model drive
both prefetch and eviction.

- Prediction (`model.py`): at the start of an iteration, one MLP predicts every layer's experts
  from the token context (token string or id, position, the previous token's routing, the
  sequence's expert affinity); as layers route, the token's own routing so far refines the
  predictions for the next layers, together with a recall of what other tokens that routed alike
  did next: the sequence's earlier tokens, its earlier occurrences of the same token
  (`recall.py`) and the training prompts' occurrences of it (`memory.py`). Where the
  trace or engine gives router inputs (hidden states), ProMoE's path from the latest one joins
  in. Scores are probabilities (trained with cross-entropy). Layers of the next token come from
  the sequence reuse model (`reuse.py`).
- Prefetch (IdleAwarePlanner): predicted experts with probability > min_prefetch_probability that
  are not resident, in order of probability / layers until needed; while nothing is moving to the
  tier the bar drops to idle_prefetch_probability: a link with nothing to move is cheap to use.
- Eviction (DefaultEviction): evicts the expert with the longest expected time to its next use,
  in layers: for an expert of a layer still ahead in this iteration, (layers until it) +
  (1 - p) x L / q, with p its predicted probability now and q the reuse probability for the next
  token; for one of a layer already passed, (layers until the next token reaches it) +
  L x (1 / q - 1). That is Belady's rule with the future replaced by calibrated expectations.
Settings were chosen by cross-validation on the dev trace (docs/default-policy.md).
Knows the policy contract, not the mechanism, time or bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from moestream.events import IterationContext, RoutingEvent
from moestream.policies.contracts import POLICIES, EvictionPolicy, Prediction, PrefetchPlanner
from moestream.policies.default.model import ModelConfig, RoutingWeights, build_vocabulary, token_keys
from moestream.policies.default.reuse import ReuseModel, popularity_logit
from moestream.policies.default.state import IterationState, TraceScores
from moestream.policies.planning import IdleAwarePlanner
from moestream.policies.scored_eviction import ScoredEviction
from moestream.policies.trained import TrainablePredictor, TrainedPolicy
from moestream.predictors.configs import ConfigError, TrainConfig
from moestream.topology import Topology

if TYPE_CHECKING:
    import torch

    from moestream.trace.schema import Trace

@dataclass(frozen=True)
class DefaultConfig(ModelConfig):
    """The routing model's settings (ModelConfig) and the policy's own."""

    reuse_tokens: int = 1500  # (token, next token) pairs the reuse model learns from
    reuse_l2: float = 1e-4
    num_candidates: int = 0  # predictions per layer; 0 means 2 x top_k
    min_prefetch_probability: float = 0.5
    idle_prefetch_probability: float = 0.1  # the bar when nothing is moving to the tier
    UNIT_FIELDS: ClassVar[tuple[str, ...]] = ModelConfig.UNIT_FIELDS + ("min_prefetch_probability",
                                                                     "idle_prefetch_probability")

    def __post_init__(self):
        super().__post_init__()
        if self.reuse_tokens < 1 or self.num_candidates < 0 or self.reuse_l2 < 0:
            raise ConfigError("need reuse_tokens >= 1, num_candidates >= 0 and reuse_l2 >= 0")

    def model(self) -> ModelConfig:
        return ModelConfig(**{f.name: getattr(self, f.name) for f in fields(ModelConfig)})


class DefaultPredictor(TrainablePredictor):
    kind = "default"

    def __init__(self, topology: Topology, config: DefaultConfig, train: TrainConfig):
        super().__init__(topology, config, train)
        self.weights: RoutingWeights | None = None
        self.reuse = ReuseModel(np.zeros((topology.num_layers, topology.num_experts), dtype=np.float32))
        self.vocab: dict = {}
        self.key_kind = ""  # "tokens", "token_ids" or "" (no token keys in the training trace)
        self.state: IterationState | None = None
        self._scores: TraceScores | None = None

    @property
    def is_trained(self) -> bool:
        return self.weights is not None

    @property
    def needs_hidden(self) -> bool:
        """Router inputs are read when the model was trained with them."""
        return self.weights is not None and self.weights.uses_hidden

    @property
    def num_candidates(self) -> int:
        return self.config.num_candidates or 2 * self.topology.top_k

    # -- offline ---------------------------------------------------------------------------
    def fit(self, trace: "Trace") -> None:
        from moestream.policies.default.training import train_network

        keys, self.key_kind = token_keys(trace)
        self.vocab = build_vocabulary(keys, self.config.min_token_count)
        self.weights, self.losses = train_network(trace, self.config.model(), self.train_config, self.vocab)
        self.reuse = ReuseModel(popularity_logit(trace))
        self.reuse.fit(trace, self.config.reuse_tokens, self.config.reuse_l2, self.train_config.seed)
        self.reset()

    def tensors(self) -> dict[str, "torch.Tensor"]:
        import torch

        arrays = self.weights.arrays() | {"reuse_pop_logit": self.reuse.pop_logit, "reuse_weights": self.reuse.weights}
        return {name: torch.from_numpy(np.ascontiguousarray(value)) for name, value in arrays.items()}

    def meta(self) -> dict:
        return super().meta() | {"vocab": self.vocab, "key_kind": self.key_kind}

    def restore(self, tensors: dict[str, "torch.Tensor"], meta: dict) -> None:
        arrays = {name: tensor.numpy() for name, tensor in tensors.items()}
        self.config = DefaultConfig(**meta["config"])
        self.weights = RoutingWeights(arrays)
        self.reuse = ReuseModel(arrays["reuse_pop_logit"], arrays["reuse_weights"])
        self.vocab, self.key_kind = dict(meta["vocab"]), str(meta["key_kind"])
        self.reset()

    def score_rows(self, trace: "Trace", layer: int, horizon_layers: int) -> np.ndarray:
        """[N, E]: what predict() gives for each row's `layer`, horizon_layers positions earlier."""
        self._require_trained()
        if self._scores is None or not self._scores.holds(trace):
            self._scores = TraceScores(trace, self.weights, self.reuse, self.vocab, self.key_kind)
        return self._scores.scores(layer, horizon_layers)

    # -- online ----------------------------------------------------------------------------
    def reset(self) -> None:
        self.state = None if self.weights is None else IterationState(self.topology, self.weights, self.reuse)

    def begin_iteration(self, ctx: IterationContext) -> None:
        if self.state is not None:
            self.state.begin(ctx, self._token_indices(ctx))

    def observe(self, event: RoutingEvent) -> None:
        if self.state is not None:
            self.state.observe(event)

    def end_sequence(self, seq_id: int) -> None:
        if self.state is not None:
            self.state.end_sequence(seq_id)

    def predict(self, layer_now: int, horizon_layers: int) -> list[Prediction]:
        state = self.state
        if state is None or not state.active:
            return []
        num_layers, predictions = self.topology.num_layers, []
        targets = np.arange(layer_now + 1, min(layer_now + horizon_layers, 2 * num_layers - 1) + 1)
        now = targets[targets < num_layers]
        if len(now):
            for layer, scores in zip(now.tolist(), state.refine(layer_now, now)):
                predictions += self._top(scores, layer, 0)
        for layer in (targets[targets >= num_layers] - num_layers).tolist():
            predictions += self._top(state.next_token(layer), layer, 1)
        return predictions

    def _top(self, scores: np.ndarray, layer: int, tokens_ahead: int) -> list[Prediction]:
        order = np.argsort(-scores, kind="stable")[: self.num_candidates]
        return [Prediction(layer, int(e), float(scores[e]), tokens_ahead) for e in order.tolist()]

    def _token_indices(self, ctx: IterationContext) -> np.ndarray:
        keys = ctx.tokens if self.key_kind == "tokens" else ctx.token_ids if self.key_kind == "token_ids" else None
        if keys is None:
            return np.zeros(ctx.num_tokens, dtype=np.int64)
        return np.fromiter((self.vocab.get(str(k), 0) for k in keys), dtype=np.int64, count=ctx.num_tokens)

    def _require_trained(self) -> None:
        if self.weights is None:
            from moestream.policies.baselines.row_scores import NotFittedError

            raise NotFittedError("the default policy must be fitted before scoring a trace")

    def retention(self) -> np.ndarray:
        """[L, E]: minus the expected layers until each expert is next needed (higher: keep)."""
        if self.state is None:
            return np.zeros((self.topology.num_layers, self.topology.num_experts))
        return self.state.retention()


class DefaultEviction(ScoredEviction):
    """Evicts the expert whose next use is expected furthest away (see the module docstring)."""

    def __init__(self, predictor: DefaultPredictor):
        super().__init__()
        self.predictor = predictor

    def score_matrix(self) -> np.ndarray:
        return self.predictor.retention()


@POLICIES.register("default")
class Default(TrainedPolicy):
    """moestream's own design: learned calibrated prediction for prefetch and Belady-like eviction."""

    config_class = DefaultConfig

    def make_predictor(self) -> DefaultPredictor:
        return DefaultPredictor(self.topology, self.config, self.train_config)

    def make_planner(self) -> PrefetchPlanner:
        return IdleAwarePlanner(self.config.min_prefetch_probability, self.config.idle_prefetch_probability)

    def make_eviction(self, tier: str) -> EvictionPolicy:
        return DefaultEviction(self.predictor)
