"""Contracts shared by the real engine and the simulator: predictors, eviction policies, planners.

Policy decides, mechanism acts: a predictor scores future experts, an eviction policy names a victim,
a planner turns predictions into prioritised transfer requests; none moves bytes or keeps time.

Call order for every iteration (one token per sequence in decode, a whole prompt in prefill), as
`moestream.policies.driver.PolicyDriver` makes it everywhere (simulator, evaluation, engine):
    begin_iteration(ctx)                          # every observer: predictor, evictions, others
    predict(layer_now=-1, horizon_layers=D)       # the plan before the first layer
    for each MoE layer l in order:
        observe(event_l)                          # the gate of layer l has routed
        (the mechanism serves layer l's experts: eviction hooks, victim())
        predict(layer_now=l, horizon_layers=D)    # then plan(predictions, view) and prefetch
    end_sequence(seq_id) when a sequence finishes.
plan() is called only with a non-empty prediction list. fit() and prepare() run before a replay,
never during one. Predictors must answer predict() without changing their state: the driver may
ask more often than a consumer uses the answer.

A top-level module, so that what speaks these types imports nothing of moestream.policies, whose import
fills the registries at the bottom.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, NamedTuple, Sequence

from moestream.events import IterationContext, RoutingEvent
from moestream.registry import Registry
from moestream.topology import ExpertKey, Topology

if TYPE_CHECKING:
    from moestream.trace.schema import Trace


class Prediction(NamedTuple):
    """One predicted need (an immutable record: predictors build a dozen per layer, so it is a tuple)."""

    layer: int  # MoE-layer index of the predicted need
    expert: int
    score: float  # in [0, 1]; calibrated predictors give the probability the expert is needed
    tokens_ahead: int = 0  # 0: the current iteration; 1: the next one, ...

    @property
    def key(self) -> ExpertKey:
        return ExpertKey(self.layer, self.expert)

    @classmethod
    def of_layer(cls, layer: int, experts: list[int], scores: list[float], tokens_ahead: int = 0) -> list["Prediction"]:
        """The predictions of one layer's experts, scores[e] each (built without the per-record
        Python __new__: a third of the time for the dozen a layer decision makes)."""
        new = tuple.__new__
        return [new(cls, (layer, e, scores[e], tokens_ahead)) for e in experts]


class Observer:
    """Receives the runtime's events; every hook defaults to doing nothing."""

    def begin_iteration(self, ctx: IterationContext) -> None:
        pass

    def observe(self, event: RoutingEvent) -> None:
        pass

    def end_sequence(self, seq_id: int) -> None:
        pass


class Predictor(Observer, ABC):
    """Scores which experts of which future (token, layer) will be needed."""

    needs_hidden: ClassVar[bool] = False  # wants RoutingEvent.hidden (the router's input)
    needs_embeddings: ClassVar[bool] = False  # wants IterationContext.embeddings

    def __init__(self, topology: Topology):
        self.topology = topology

    def fit(self, trace: "Trace") -> None:
        """Learn from a recorded trace (offline). Stateless predictors keep the default."""

    def reset(self) -> None:
        """Forget online state (current sequences), keeping what fit() learned."""

    @abstractmethod
    def predict(self, layer_now: int, horizon_layers: int) -> list[Prediction]:
        """Experts of layers layer_now+1 .. layer_now+horizon_layers, with scores.

        layer_now is the last layer whose routing was observed in this iteration (-1 before the
        first). Layers past the last MoE layer belong to the next iteration (tokens_ahead=1).
        """


class NullPredictor(Predictor):
    """For policies that only react: predicts nothing, so nothing is prefetched."""

    def predict(self, layer_now: int, horizon_layers: int) -> list[Prediction]:
        return []


class EvictionPolicy(Observer, ABC):
    """Hooks on the residency of one tier, and the choice of a victim."""

    def on_insert(self, key: ExpertKey) -> None:
        pass

    def on_access(self, key: ExpertKey) -> None:
        pass

    def on_remove(self, key: ExpertKey) -> None:
        pass

    @abstractmethod
    def victim(self, candidates: Sequence[ExpertKey]) -> ExpertKey:
        """One of candidates (resident and evictable), never empty."""


class TransferRequest(NamedTuple):
    key: ExpertKey
    priority: float  # larger goes first


@dataclass(frozen=True)
class LinkState:
    """The link that fills the tier, as `moestream.link_model.ModelledLink` models it (never from a clock)."""

    bytes_per_ms: float  # the link's bandwidth
    layer_ms: float  # one MoE layer's compute, its experts resident
    expert_bytes: int  # one expert's bytes
    backlog_bytes: float  # queued ahead of this plan's reads
    next_need_ms: float  # until the next layer needs its experts (the routed layer computes, behind its demand loads)

    @property
    def read_ms(self) -> float:
        """One expert's read."""
        return self.expert_bytes / self.bytes_per_ms

    @property
    def busy_ms(self) -> float:
        """Until the link has moved its backlog: when this plan's first read can start."""
        return self.backlog_bytes / self.bytes_per_ms

    def need_ms(self, layers_ahead: int) -> float:
        """Until the layer layers_ahead (>= 1) after the routed one needs its experts."""
        return self.next_need_ms + (layers_ahead - 1) * self.layer_ms


@dataclass(frozen=True)
class CacheView:
    """What a planner may know of the target tier when it plans."""

    resident: frozenset[ExpertKey]
    in_flight: frozenset[ExpertKey]
    capacity: int  # slots in the tier
    layer_now: int
    num_layers: int
    link: LinkState | None = None  # the link's model, where the mechanism keeps one (else the planner plans blind)


class PrefetchPlanner(ABC):
    """Turns predictions into prioritised transfer requests for one tier, which the mechanism admits by
    `moestream.transfer_core`'s rules (`admit_prefetches`; the view: `plan_view`). After a layer with no
    prediction the plan is empty (it still ends the last one); before an iteration's first layer, no
    prediction leaves the last plan standing. On-demand misses never go through a planner.
    """

    @abstractmethod
    def plan(self, predictions: Sequence[Prediction], view: CacheView) -> list[TransferRequest]:
        ...


class Policy:
    """A named design: a predictor, a planner and an eviction policy per tier; `offline` ones: simulator only."""

    offline: ClassVar[bool] = False
    registry_name: ClassVar[str] = ""
    trace_needs: ClassVar[tuple[str, ...]] = ()  # trace fields the design needs, e.g. ("gate_probs",)
    # the engine runs the predictor on a worker thread (moestream.runtime.background.offload_predictor)
    predicts_in_background: ClassVar[bool] = False
    predictor_class: ClassVar[type[Predictor]] = NullPredictor  # what make_predictor builds from the topology

    def __init__(self, topology: Topology):
        self.topology = topology
        self.predictor = self.make_predictor()
        self.planner = self.make_planner()

    def make_predictor(self) -> Predictor:
        return self.predictor_class(self.topology)

    def make_planner(self) -> PrefetchPlanner:
        return PLANNERS.create("score")

    def make_eviction(self, tier: str) -> EvictionPolicy:
        return EVICTIONS.create("lru")

    def observers(self) -> list[Observer]:
        return [self.predictor]

    def fit(self, trace: "Trace") -> None:
        self.predictor.fit(trace)

    def prepare(self, trace: "Trace") -> None:
        """Offline policies see the trace about to be replayed; online ones ignore it."""


POLICIES: Registry[Policy] = Registry("policy")
EVICTIONS: Registry[EvictionPolicy] = Registry("eviction policy")
PLANNERS: Registry[PrefetchPlanner] = Registry("prefetch planner")
