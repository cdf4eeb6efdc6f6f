"""The runners call models through transformers' current cache API: no deprecation warning, same tokens."""

import warnings

import pytest

from moestream.runtime import Engine, EngineConfig

PROMPTS = ["The cat sat on", "Experts"]


@pytest.mark.parametrize("family", ["qwen2_moe", "switch_transformers"])
def test_generation_raises_no_deprecation_warning(checkpoint, family):
    with Engine(checkpoint(family), EngineConfig(expert_budget="0.5", direct_io=False)) as engine:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = engine.generate(PROMPTS, max_new_tokens=4)
    deprecations = [w for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))]
    assert deprecations == [] and all(len(ids) > 0 for ids in result.token_ids)


def test_on_tokens_sees_each_step_of_each_prompt(checkpoint):
    steps = []
    with Engine(checkpoint("mixtral"), EngineConfig(direct_io=False)) as engine:
        result = engine.generate(PROMPTS, max_new_tokens=5, on_tokens=steps.append)
    for row, ids in enumerate(result.token_ids):
        assert [step[row] for step in steps if step[row] is not None] == ids
    assert len(steps) == max(len(ids) for ids in result.token_ids)
