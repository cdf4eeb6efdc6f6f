"""default's online state: its predictions equal the whole-trace path's, for every variant."""

import dataclasses

import numpy as np
import pytest

from moestream.bench.tools.prediction import evaluate_predictor
from moestream.policies.default.model import DefaultConfig
from moestream.predictors.configs import TrainConfig
from tests.policies.default.common import fitted_policy
from tests.policies.online import OnlineOnly


@pytest.mark.parametrize("horizon", [1, 2, 3, 5])
def test_online_predictions_equal_whole_trace_scoring(policy, traces, horizon):
    test = traces[1]
    scored = evaluate_predictor(policy.predictor, test, horizon)
    policy.predictor.reset()
    online = evaluate_predictor(OnlineOnly(policy.predictor), test, horizon)
    np.testing.assert_array_equal(scored.hits, online.hits)
    np.testing.assert_array_equal(scored.predicted, online.predicted)


@pytest.mark.parametrize("overrides", [{"cut_recall": False}, {"hidden_units": 8},
                                       {"hidden_units": 8, "cut_recall": False}])
def test_every_variant_predicts_online_what_it_scores(traces, overrides):
    config = dataclasses.replace(DefaultConfig(), **overrides)
    policy = fitted_policy(traces[0], config=config, train=TrainConfig(num_epochs=3, batch_size=64))
    assert set(policy.predictor.tensors()) >= ({"out", "out_bias"} if config.hidden_units else set())
    for horizon in (1, 3):
        scored = evaluate_predictor(policy.predictor, traces[1], horizon)
        policy.predictor.reset()
        online = evaluate_predictor(OnlineOnly(policy.predictor), traces[1], horizon)
        np.testing.assert_array_equal(scored.hits, online.hits)
        np.testing.assert_array_equal(scored.predicted, online.predicted)


@pytest.mark.parametrize("keyed", [True, False])  # False: the trace names no tokens, every row reads memory row 0
def test_online_probabilities_equal_whole_trace_scoring_row_by_row(traces, keyed):
    from moestream.events import IterationContext, RoutingEvent
    from moestream.policies.default.model import START

    policy = fitted_policy(traces[0], config=DefaultConfig(min_token_count=6), train=TrainConfig(num_epochs=3, batch_size=64))
    test, predictor, L = traces[1], policy.predictor, traces[1].topology.num_layers
    test = test if keyed else dataclasses.replace(test, tokens=None, token_ids=None)
    start = [predictor.score_rows(test, layer, layer + 1) for layer in range(L)]  # [L][N, E]
    ahead = {(c, d): predictor.score_rows(test, c + d, d) for d in (1, 2) for c in range(L - d)}
    following = [predictor.score_rows(test, c, L) for c in range(L)]  # seen from the previous token's layer c
    predictor.reset()
    for seq, first, end in test.sequence_bounds():
        for row in range(first, end):
            keys = {"tokens": (test.tokens[row],), "token_ids": test.token_ids[[row]]} if keyed else {}
            predictor.begin_iteration(IterationContext(step=row, seq_ids=np.array([seq]), positions=test.positions[[row]],
                                                       is_prefill=False, **keys))
            state = predictor.state
            np.testing.assert_allclose(state.start, np.stack([s[row] for s in start]), atol=1e-6)
            for c in range(L):
                predictor.observe(RoutingEvent(c, test.experts[[row], c].astype(np.int64), np.array([seq]), np.array([0])))
                for d in (1, 2):
                    if c + d < L:
                        np.testing.assert_allclose(state.fresh[d - 1], ahead[(c, d)][row], atol=1e-6)
                if row + 1 < end and c < L - 1:
                    np.testing.assert_allclose(state.fresh[START], following[c][row + 1], atol=1e-6)
        predictor.end_sequence(seq)


def test_a_prefill_s_unknown_token_reads_what_followed_the_row_before_it(policy):
    from moestream.events import IterationContext

    state, V = policy.predictor.state, len(policy.predictor.vocab) + 1
    tokens = np.array([2, 0, 3, 0])  # rows 1 and 3: outside the vocabulary
    ctx = IterationContext(step=0, seq_ids=np.array([7, 7, 7, 8]), positions=np.array([0, 1, 2, 0]), is_prefill=True)
    state.begin(ctx, tokens)
    own, following = state._memory_index(ctx, tokens)
    assert own.tolist() == [2, V + 2, 3, 0]  # sequence 8 has no token before it
    assert following.tolist() == (V + tokens).tolist()
    state.begin(ctx, None)  # no keys: every row reads row 0
    assert [r.tolist() for r in state._memory_index(ctx, np.zeros(4, np.int64))] == [[0] * 4, [0] * 4]
    policy.predictor.reset()


@pytest.mark.parametrize("overrides", [{}, {"cut_recall": False}, {"hidden_units": 8}])
def test_a_batch_s_probabilities_are_the_union_of_its_rows_alone(traces, overrides):
    import copy

    config = dataclasses.replace(DefaultConfig(), **overrides)
    policy = fitted_policy(traces[0], config=config, train=TrainConfig(num_epochs=3, batch_size=64))
    test, predictor, L = traces[1], policy.predictor, traces[1].topology.num_layers
    bounds = [(seq, first) for seq, first, _ in test.sequence_bounds()][:3]
    for i, (seq, first) in enumerate(bounds):  # sequence i has i tokens behind it (its own recall and share steps)
        for row in range(first, first + i):
            _replay(predictor, test, np.array([row]), np.array([seq]), L)
    rows, seqs = np.array([first + i for i, (_, first) in enumerate(bounds)]), np.array([seq for seq, _ in bounds])
    alone = [copy.deepcopy(predictor) for _ in rows]
    batch = _replay(predictor, test, rows, seqs, L)
    single = [_replay(p, test, rows[[i]], seqs[[i]], L) for i, p in enumerate(alone)]
    for name in ("start", "fresh"):  # [L, E] from the token's start; [L, 3, E] after each layer
        union = 1.0 - np.prod([1.0 - s[name] for s in single], axis=0)
        np.testing.assert_allclose(batch[name], union, atol=1e-6)


def _replay(predictor, trace, rows, seqs, num_layers, experts=None, is_prefill=False) -> dict:
    """One iteration of the trace's rows ([T]; experts [T, L, K] instead of the trace's routing)."""
    from moestream.events import IterationContext, RoutingEvent

    experts = trace.experts[rows].astype(np.int64) if experts is None else experts

    predictor.begin_iteration(IterationContext(step=0, seq_ids=seqs, positions=trace.positions[rows], is_prefill=is_prefill,
                                               token_ids=trace.token_ids[rows], tokens=tuple(trace.tokens[r] for r in rows)))
    start, fresh = predictor.state.start.copy(), []
    for c in range(num_layers):
        predictor.observe(RoutingEvent(c, experts[:, c], seqs, np.arange(len(rows))))
        fresh.append(predictor.state.fresh.copy())
    return {"start": start, "fresh": np.stack(fresh)}


def test_last_rows_are_where_each_sequence_s_rows_end():
    from moestream.policies.default.state import last_rows

    assert last_rows(np.array([7, 7, 7, 8])).tolist() == [2, 3]
    assert last_rows(np.array([4, 5, 6])).tolist() == [0, 1, 2]  # a decode: every row is its sequence's last
    assert last_rows(np.array([], dtype=np.int64)).tolist() == []


def test_a_prefill_predicts_the_next_token_from_its_last_row_alone(policy, traces):
    """The next iteration follows only the prompt's last token: routing the earlier rows differently
    changes the prefill's own layers ahead, not the next token's probabilities."""
    test, predictor, L = traces[1], policy.predictor, traces[1].topology.num_layers
    seq, first, _ = next(iter(test.sequence_bounds()))
    rows, seqs = np.arange(first, first + 3), np.full(3, seq)
    experts = test.experts[rows].astype(np.int64)  # [3, L, K]
    shifted = experts.copy()
    shifted[:2] = (experts[:2] + 1) % test.topology.num_experts  # the first two rows routed elsewhere
    runs = []
    for routing in (experts, shifted):
        predictor.reset()
        runs.append(_replay(predictor, test, rows, seqs, L, routing, is_prefill=True)
                    | {"next": predictor.state.next.copy()})
    np.testing.assert_array_equal(runs[0]["next"], runs[1]["next"])
    assert not np.array_equal(runs[0]["fresh"][:, :2], runs[1]["fresh"][:, :2])
    predictor.reset()


@pytest.mark.parametrize("seq_ids", [[7, 7, 7], [7, 7, 7, 8, 8]])
def test_a_prefill_starts_the_next_token_from_each_sequence_s_last_row(policy, seq_ids):
    """Before any layer: another first token changes the prefill's start (its row, and the unknown
    token after it, which reads what followed it) but not the next token's, read from the last rows."""
    from moestream.events import IterationContext

    predictor, begun = policy.predictor, []
    for token in ("t0", "t1"):
        tokens = (token, "unknown-token") + ("t2",) * (len(seq_ids) - 2)  # rows 2 on (each last row): known
        predictor.reset()
        predictor.begin_iteration(IterationContext(step=0, seq_ids=np.array(seq_ids), positions=np.zeros(len(seq_ids)),
                                                   is_prefill=True, tokens=tokens))
        begun.append((predictor.state.start.copy(), predictor.state.next.copy()))
    assert not np.array_equal(begun[0][0], begun[1][0])
    np.testing.assert_array_equal(begun[0][1], begun[1][1])
    predictor.reset()


def test_an_event_whose_rows_are_not_the_iteration_s_is_refused(policy):
    """An encoder-decoder model routes its decoder's rows apart from its prompt's: one row per token
    does not hold, and the kernels would read past the event's rows."""
    from moestream.events import IterationContext, RoutingEvent
    from moestream.policies.default.state import RowsMismatchError

    predictor, seqs = policy.predictor, np.zeros(3, np.int64)
    predictor.begin_iteration(IterationContext(0, seqs, np.arange(3), True))
    with pytest.raises(RowsMismatchError, match="layer 0 routed 1 rows in an iteration of 3"):
        predictor.observe(RoutingEvent(0, np.array([[0, 1]]), seqs[:1], np.zeros(1, np.int64)))
    predictor.reset()
