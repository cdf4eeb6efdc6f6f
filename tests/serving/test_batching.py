"""Continuous batching: sequences that join a running batch mid-way get exactly the tokens they get
alone; admission respects max_num_seqs and the KV budget (exact per token from the start, for every
family); sequences that leave end their policy state."""

import pytest

from moestream.config import BatchingConfig
from moestream.contracts import Observer
from moestream.runtime import Engine, EngineConfig
from moestream.runtime.scheduling.scheduler import KvBudgetError, StaticBatches
from moestream.serving.batching import Batcher
from moestream.serving.generation import Request
from moestream.serving.sampling import SamplingParams
from tests.conftest import SAMPLE_FAMILIES

PROMPTS = [[5, 9, 2, 7], [11, 3], [8, 8, 1, 4, 6, 2, 9], [4], [13, 2, 2]]
MAX_TOKENS = [6, 9, 4, 7, 5]


class Ends(Observer):
    def __init__(self):
        self.ended = []

    def end_sequence(self, seq_id):
        self.ended.append(seq_id)


def _request(prompt, max_tokens, seed=None, temperature=0.0):
    return Request(prompt, SamplingParams(max_tokens=max_tokens, seed=seed, temperature=temperature), lambda e: None)


def _drive(batcher, requests, joins):
    """Steps the batcher until all are done; request i is admitted before step joins[i].
    Returns each request's engine sequence."""
    seqs, step = {}, 0
    while len(seqs) < len(requests) or batcher.requests:
        for row, request in enumerate(requests):
            if joins[row] <= step and row not in seqs:
                seqs[row] = batcher.admit(request)
        batcher.step()
        step += 1
    return [seqs[row] for row in range(len(requests))]


def _engine(path):
    return Engine(path, EngineConfig(expert_budget="0.5", direct_io=False))


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral", "deepseek_v2", "gpt_oss"])
def test_sequences_joining_mid_way_get_their_tokens_alone(tiny_checkpoint, family):
    path = tiny_checkpoint(family, num_layers=2)
    with _engine(path) as engine:
        alone = [engine.generate([p], max_new_tokens=n).token_ids[0] for p, n in zip(PROMPTS, MAX_TOKENS)]
        batcher = Batcher(engine, BatchingConfig(max_batch_size=3, max_num_seqs=4),
                                    lambda request, delta, new: None)
        seqs = _drive(batcher, [_request(p, n) for p, n in zip(PROMPTS, MAX_TOKENS)], joins=[0, 0, 2, 3, 5])
        batcher.close()
    assert [s.output_ids for s in seqs] == alone


def test_seeded_sampling_does_not_depend_on_company(serving_checkpoint):
    with _engine(serving_checkpoint) as engine:
        def tokens(joins, company):
            batcher = Batcher(engine, BatchingConfig(max_batch_size=4), lambda r, d, n: None)
            first = _request(PROMPTS[0], 8, seed=3, temperature=1.0)
            others = [_request(p, 5, seed=9, temperature=1.0) for p in PROMPTS[1:1 + company]]
            seqs = _drive(batcher, [first, *others], joins)
            batcher.close()
            return seqs[0].output_ids
        assert tokens([0], 0) == tokens([0, 1, 2], 2)


def test_admission_respects_max_num_seqs_and_the_kv_budget(serving_checkpoint):
    """The budget holds from a fresh batcher's first request on: no prefill needs to have run."""
    with _engine(serving_checkpoint) as engine:
        first, second, third = (_request(p, 4) for p in PROMPTS[:3])
        batcher = Batcher(engine, BatchingConfig(max_batch_size=2, kv_budget_bytes=10**9),
                                    lambda r, d, n: None)
        admission = batcher.scheduler.admission
        need = [admission.need_bytes(len(r.prompt_ids) + r.params.max_tokens) for r in (first, second, third)]
        assert need[0] == (len(PROMPTS[0]) + 4) * admission.bytes_per_token > 0
        batcher.admit(first)
        assert batcher.scheduler.reserved_bytes == need[0] and batcher.can_admit(second)
        batcher.admit(second)
        assert not batcher.can_admit(third)  # both sequences' places taken
        tight = Batcher(engine, BatchingConfig(max_batch_size=4, kv_budget_bytes=need[0] + need[1] - 1),
                                  lambda r, d, n: None)
        assert tight.can_admit(first) and tight.fits(second)
        tight.admit(first)
        assert not tight.can_admit(second)  # a place is free, the bytes are not
        small = Batcher(engine, BatchingConfig(kv_budget_bytes=need[2] - 1), lambda r, d, n: None)
        assert not small.fits(third)
        with pytest.raises(KvBudgetError):
            small.admit(third)
        for each in (batcher, tight, small):
            each.close()


@pytest.mark.parametrize("family", SAMPLE_FAMILIES)
def test_the_kv_bytes_per_token_are_exact_before_the_first_prefill(tiny_checkpoint, family):
    with _engine(tiny_checkpoint(family, num_layers=2)) as engine:
        if not engine.runner_class.per_sequence_cache:
            pytest.skip(f"{family} is served by static batches: no KV budget")
        batcher = Batcher(engine, BatchingConfig(), lambda r, d, n: None)
        before = batcher.scheduler.admission.bytes_per_token
        seq = batcher.admit(_request(PROMPTS[2], 3))
        batcher.step()  # the prompt's prefill
        lengths, held = batcher.scheduler.cached_lengths(), batcher.scheduler.cached_bytes()
        batcher.close()
    assert lengths == {seq.seq_id: len(PROMPTS[2])}
    assert before > 0 and before * len(PROMPTS[2]) == held


def test_leaving_sequences_end_their_state_and_free_their_cache(serving_checkpoint):
    ends = Ends()
    with _engine(serving_checkpoint) as engine:
        deltas = []
        batcher = Batcher(engine, BatchingConfig(max_batch_size=4), lambda r, d, n: deltas.append((r, d)))
        engine.add_observer(ends)  # after the batcher's start-up prefill, which ends its own sequence
        short, cancelled = _request(PROMPTS[0], 2), _request(PROMPTS[1], 50)
        ids = [batcher.admit(short).seq_id, batcher.admit(cancelled).seq_id]
        for _ in range(4):
            batcher.step()
        cancelled.cancel()
        while batcher.step():
            pass
        scheduler = batcher.scheduler
        assert batcher.requests == [] and scheduler.reserved_bytes == 0 and scheduler.cached_lengths() == {}
        assert sorted(ends.ended) == sorted(ids)
        reasons = [d.finish_reason for r, d in deltas if d.finished]
        assert sorted(reasons) == ["abort", "length"]
        assert batcher.paths.paths == {}
        batcher.close()


def test_an_encoder_decoder_model_is_batched_statically_without_a_kv_budget(tiny_checkpoint):
    with _engine(tiny_checkpoint("switch_transformers", num_layers=2)) as engine:
        batcher = Batcher(engine, BatchingConfig(kv_budget_bytes=1), lambda r, d, n: None)
        assert isinstance(batcher.scheduler.rule, StaticBatches) and batcher.paths is None
        assert batcher.scheduler.admission.bytes_per_token == 0 and batcher.fits(_request(PROMPTS[0], 500))
        batcher.close()


def test_expertflow_regrouping_keeps_every_sequence_s_tokens(serving_checkpoint):
    with _engine(serving_checkpoint) as engine:
        alone = [engine.generate([p], max_new_tokens=n).token_ids[0] for p, n in zip(PROMPTS, MAX_TOKENS)]
        batcher = Batcher(engine, BatchingConfig(max_batch_size=2, max_num_seqs=5, token_scheduler="expertflow"),
                                    lambda r, d, n: None)
        seqs = _drive(batcher, [_request(p, n) for p, n in zip(PROMPTS, MAX_TOKENS)], joins=[0, 0, 1, 1, 4])
        batcher.close()
    assert [s.output_ids for s in seqs] == alone


def test_a_batch_is_merged_once_while_its_sequences_decode_together(serving_checkpoint, monkeypatch):
    from moestream.runtime import kv

    merges, splits = [], []
    merge, split = kv.merge, kv.split
    monkeypatch.setattr(kv, "merge", lambda caches: merges.append(len(caches)) or merge(caches))
    monkeypatch.setattr(kv, "split", lambda cache, lengths: splits.append(len(lengths)) or split(cache, lengths))
    with _engine(serving_checkpoint) as engine:
        batcher = Batcher(engine, BatchingConfig(max_batch_size=4), lambda r, d, n: None)
        splits.clear()  # the start-up prefill that measured the KV bytes per token
        requests = [_request(PROMPTS[0], 6), _request(PROMPTS[1], 3)]
        seqs = _drive(batcher, requests, [0, 0])
        batcher.close()
        alone = [_drive(Batcher(engine, BatchingConfig(), lambda r, d, n: None), [r], [0])[0]
                 for r in [_request(PROMPTS[0], 6), _request(PROMPTS[1], 3)]]
    # one prefill of both; two decodes of both (merged once); the short one leaves (split of two),
    # three decodes of the long one alone (merged once), which leaves (split of one)
    assert merges[:2] == [2, 1] and splits[:3] == [2, 2, 1]
    assert [s.output_ids for s in seqs] == [s.output_ids for s in alone]


def test_a_prefill_delay_lets_running_sequences_decode_until_it_is_due(serving_checkpoint):
    """A prompt arriving while a sequence decodes waits max_prefill_delay_ms, then prefills with the
    ones that came meanwhile; once nothing decodes it prefills at once. Tokens are those it gets alone."""
    now = [0.0]
    config = BatchingConfig(max_batch_size=4, max_prefill_delay_ms=1000.0)
    with _engine(serving_checkpoint) as engine:
        batcher = Batcher(engine, config, lambda r, d, n: None, clock=lambda: now[0])
        first, late, later = (_request(p, m) for p, m in ((PROMPTS[0], 8), (PROMPTS[1], 3), (PROMPTS[2], 3)))
        first.arrived, late.arrived, later.arrived = 0.0, 0.0, 0.5
        seqs = {id(first): batcher.admit(first)}
        assert batcher.step().is_prefill  # nothing decodes: no wait
        seqs |= {id(late): batcher.admit(late), id(later): batcher.admit(later)}
        now[0] = 0.9
        for _ in range(2):  # 0.9 s < 1 s: the running sequence decodes, even after a decode
            batch = batcher.step()
            assert not batch.is_prefill and batch.seqs == [seqs[id(first)]]
        now[0] = 1.0
        batch = batcher.step()
        assert batch.is_prefill and batch.seqs == [seqs[id(late)], seqs[id(later)]]  # one prefill for both
        while batcher.requests:
            batcher.step()
        alone = [_drive(Batcher(engine, BatchingConfig(), lambda r, d, n: None), [_request(p, m)], [0])[0]
                 for p, m in ((PROMPTS[0], 8), (PROMPTS[1], 3), (PROMPTS[2], 3))]
    assert [seqs[id(r)].output_ids for r in (first, late, later)] == [s.output_ids for s in alone]


def test_the_kv_probe_at_start_takes_no_replayed_rows(serving_checkpoint, replay_trace):
    config = EngineConfig(expert_budget="0.5", direct_io=False, replay_routing=str(replay_trace))
    with Engine(serving_checkpoint, config) as engine:
        batcher = Batcher(engine, BatchingConfig(), lambda request, delta, new: None)
        assert batcher.scheduler.admission.bytes_per_token > 0
        assert engine.replay.cursor == 0 and engine.replay.rows_used == 0  # served requests start at row 0
        batcher.close()


def test_a_finished_sequence_s_kv_cache_is_held_no_more(serving_checkpoint):
    """Two sequences decode over one merged cache; when one ends, no cache held keeps its positions,
    and once both end nothing is held."""
    with _engine(serving_checkpoint) as engine:
        batcher = Batcher(engine, BatchingConfig(max_batch_size=4), lambda r, d, n: None)
        short, long = batcher.admit(_request(PROMPTS[0], 3)), batcher.admit(_request(PROMPTS[1], 6))
        while not short.finished:
            batcher.step()
            running = [s for s in (short, long) if not s.finished]
            cached = {s.seq_id: len(s.prompt_ids) + len(s.output_ids) - 1 for s in running}
            assert batcher.scheduler.cached_lengths() == cached
        assert len(short.output_ids) == 3 and short.seq_id not in batcher.scheduler.cached_lengths()
        while batcher.step():
            pass
        assert batcher.scheduler.cached_lengths() == {} and len(long.output_ids) == 6
        batcher.close()


@pytest.mark.parametrize("family", ["qwen3_next", "minimax", "nemotron_h"])  # linear attention, Mamba: states
def test_models_with_recurrent_state_are_served_by_static_batches(tiny_checkpoint, family):
    path = tiny_checkpoint(family, num_layers=3)
    with _engine(path) as engine:
        assert not engine.per_sequence_cache
        alone = [engine.generate([p], max_new_tokens=n).token_ids[0] for p, n in zip(PROMPTS[:3], MAX_TOKENS)]
        batcher = Batcher(engine, BatchingConfig(max_batch_size=2), lambda request, delta, new: None)
        assert isinstance(batcher.scheduler.rule, StaticBatches) and batcher.scheduler.admission.bytes_per_token == 0
        seqs = _drive(batcher, [_request(p, n) for p, n in zip(PROMPTS[:3], MAX_TOKENS)], joins=[0, 0, 1])
        batcher.close()
    assert [s.output_ids for s in seqs] == alone


def test_a_model_whose_past_is_keys_and_values_is_served_by_continuous_batches(tiny_checkpoint):
    with _engine(tiny_checkpoint("mixtral", num_layers=2)) as engine:
        assert engine.per_sequence_cache
