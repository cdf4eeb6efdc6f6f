"""The offline API: greedy equals the engine's argmax, seeds repeat, stop strings end and are trimmed,
outputs under routing replay say so; prompts beyond max_num_seqs or the KV budget run continuously
through the server's scheduler, with the tokens they get alone."""

import subprocess
import sys

import pytest

from moestream import LLM, SamplingParams
from moestream.contracts import Observer
from moestream.errors import MoestreamError
from moestream.runtime import Engine, EngineConfig
from moestream.runtime.scheduling.scheduler import KvBudgetError

PROMPTS = ["The cat sat on", "def add(a, b):"]


@pytest.fixture(scope="module")
def llm(serving_checkpoint):
    with LLM(serving_checkpoint, expert_budget="0.5", direct_io=False) as llm:
        yield llm


def test_greedy_equals_the_engine_without_sampler(llm, serving_checkpoint):
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=6))
    with Engine(serving_checkpoint, EngineConfig(expert_budget="0.5", direct_io=False)) as engine:
        expected = engine.generate(PROMPTS, max_new_tokens=6)
    assert [o.token_ids for o in outputs] == expected.token_ids
    assert [o.text for o in outputs] == expected.texts
    assert all(o.finish_reason in ("stop", "length") for o in outputs)
    assert all(o.finish_reason == "length" for o in outputs if len(o.token_ids) == 6)


def test_seeded_sampling_repeats_and_differs_from_greedy(llm):
    params = SamplingParams(max_tokens=8, temperature=1.5, seed=11)
    first = llm.generate(PROMPTS[:1], params)[0]
    assert llm.generate(PROMPTS[:1], params)[0].token_ids == first.token_ids
    others = {tuple(llm.generate(PROMPTS[:1], SamplingParams(max_tokens=8, temperature=1.5, seed=s))[0].token_ids)
              for s in range(4)}
    assert len(others) > 1


def test_a_sequence_samples_the_same_alone_and_in_a_batch(llm):
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=4)
    alone = llm.generate(PROMPTS[:1], params)[0]
    batched = llm.generate(PROMPTS, [params, SamplingParams(max_tokens=3)])[0]
    assert alone.token_ids[:1] == batched.token_ids[:1]  # prefill logits of a padded batch agree


def test_stop_string_ends_and_is_trimmed(llm):
    full = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=12))[0]
    if len(full.text) < 4:
        pytest.skip("the random model ended too early to pick a stop string")
    stop = full.text[2:4]
    out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=12, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.find(stop)]
    assert len(out.token_ids) < len(full.token_ids) or full.finish_reason == "stop"


def test_ignore_eos_generates_max_tokens_past_the_end_of_sequence(llm):
    eos = llm.engine.model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos)
    sampled = [SamplingParams(max_tokens=200, temperature=1.0, seed=seed) for seed in range(8)]
    ended = next((o, p) for o, p in zip(llm.generate(PROMPTS[:1] * 8, sampled), sampled) if o.finish_reason == "stop")
    (out, params) = ended
    assert out.token_ids[-1] in eos and len(out.token_ids) < 200
    past = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=200, temperature=1.0, seed=params.seed,
                                                     ignore_eos=True))[0]
    assert past.finish_reason == "length" and len(past.token_ids) == 200
    assert past.token_ids[:len(out.token_ids)] == out.token_ids  # the same draws, then more


def test_the_context_length_holds_offline_too(llm, caplog):
    context = llm.engine.context_len
    with pytest.raises(MoestreamError, match=f"the prompt has {context} tokens; this model's context is {context}"):
        llm.generate([[5] * context], SamplingParams(max_tokens=1))
    out = llm.generate([[5] * (context - 3)], SamplingParams(max_tokens=10**8, ignore_eos=True))[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"
    assert "max new tokens capped at 3" in caplog.text


def test_params_must_match_the_prompts(llm):
    with pytest.raises(MoestreamError):
        llm.generate(PROMPTS, [SamplingParams()])


def test_import_moestream_stays_light():
    code = "import sys, moestream; assert 'torch' not in sys.modules; moestream.SamplingParams"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_outputs_under_routing_replay_are_labelled(llm, serving_checkpoint, replay_trace):
    assert not any(o.replayed for o in llm.generate(PROMPTS, SamplingParams(max_tokens=2)))
    with LLM(serving_checkpoint, expert_budget="0.5", direct_io=False, replay_routing=str(replay_trace)) as replayed:
        assert all(o.replayed for o in replayed.generate(PROMPTS, SamplingParams(max_tokens=2)))


class Steps(Observer):
    """The sequences of each step, in order, and whether it was a prefill."""

    def __init__(self):
        self.steps = []

    def begin_iteration(self, ctx):
        self.steps.append((ctx.is_prefill, set(ctx.seq_ids.tolist())))


def test_more_prompts_than_sequences_run_continuously_with_their_tokens_alone(serving_checkpoint):
    """Five prompts, two sequences at most: a prompt is admitted and prefilled when another ends, while
    the other still decodes; each gets the tokens it gets alone."""
    prompts = [[5, 9, 2, 7], [11, 3], [8, 8, 1, 4, 6, 2, 9], [4], [13, 2, 2]]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (6, 2, 4, 7, 3)]
    steps = Steps()
    with LLM(serving_checkpoint, expert_budget="0.5", direct_io=False, max_batch_size=2, max_num_seqs=2) as llm:
        alone = [llm.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
        llm.engine.add_observer(steps)
        together = [o.token_ids for o in llm.generate(prompts, params)]
    assert together == alone
    assert max(len(seqs) for _, seqs in steps.steps) <= 2
    prefills = [index for index, (is_prefill, _) in enumerate(steps.steps) if is_prefill]
    assert len(prefills) > 1 and prefills[0] == 0  # later prompts prefilled mid-way ...
    decoding = steps.steps[prefills[1] - 1][1]
    assert len(decoding) == 2 and not decoding <= steps.steps[prefills[1] + 1][1]  # ... after one of two ended
    assert any(decoding & seqs for _, seqs in steps.steps[prefills[1] + 1:])  # while the other went on


def test_the_kv_budget_queues_prompts_and_refuses_one_that_never_fits(serving_checkpoint):
    """A budget of one sequence runs them one at a time, with their tokens; a prompt over the whole
    budget is refused before anything runs, as the server refuses it."""
    prompts = [[5, 9, 2, 7], [11, 3], [4]]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with LLM(serving_checkpoint, expert_budget="0.5", direct_io=False) as llm:
        alone = [llm.generate([p], params)[0].token_ids for p in prompts]
        per_token = llm.scheduler.admission.bytes_per_token
    steps = Steps()
    with LLM(serving_checkpoint, expert_budget="0.5", direct_io=False, kv_budget_bytes=8 * per_token) as llm:
        llm.engine.add_observer(steps)
        assert [o.token_ids for o in llm.generate(prompts, params)] == alone
        assert max(len(seqs) for _, seqs in steps.steps) == 1  # 4 + 4 positions each: one at a time
        with pytest.raises(KvBudgetError, match="over the budget"):
            llm.generate([[4], [5] * 5], params)
        assert llm.scheduler.seqs == [] and llm.scheduler.queued == []
