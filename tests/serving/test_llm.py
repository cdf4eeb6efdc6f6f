"""The offline API: greedy equals the engine's argmax, seeds repeat, stop strings end and are trimmed,
outputs under routing replay say so."""

import sys
import subprocess

import pytest

from moestream import LLM, SamplingParams
from moestream.errors import MoestreamError
from moestream.runtime import Engine, EngineConfig

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
