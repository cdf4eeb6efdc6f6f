"""The contract every family runs: for each model type transformers declares experts for, a small random
checkpoint in its published layout loads in plain transformers without a missing key, the derived
layout's slot views are the model's expert parameters, the dense part is transformers' own, and the
engine's greedy tokens at a 25% expert budget, sync and async, are transformers' tokens (also with a host
tier whose experts the default rule may compute on the host). A family that
cannot work is refused in one line with its reason."""

import pytest
import torch
import transformers

from moestream.checkpoint.index import build_index
from moestream.errors import CheckpointError
from moestream.families import FAMILIES, adapter_for, derive, supported
from moestream.runtime import Engine, EngineConfig
from moestream.runtime.loader import load_model
from moestream.topology import ExpertKey
from tests.quant.slots import read_slot
from tests.runtime.conftest import PROMPTS, reference_generate

SUPPORTED = supported()
REFUSED = [name for name in FAMILIES.names() if name not in SUPPORTED]
NEW_TOKENS = 5


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """family -> (checkpoint, plain transformers model loaded from it), built once per family."""
    made = {}

    def get(family):
        if family not in made:
            path = tiny_checkpoint(family, num_layers=3)
            auto_class = getattr(transformers, FAMILIES.get(family).auto_class)
            model, info = auto_class.from_pretrained(path, output_loading_info=True)
            made[family] = path, model.eval(), info
        return made[family]

    return get


@pytest.mark.parametrize("family", SUPPORTED)
def test_the_checkpoint_loads_in_transformers_and_its_layout_is_the_models(reference, family):
    path, model, info = reference(family)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    index = build_index(path)
    adapter = index.adapter
    experts = {name: module for name, module in model.named_modules() if name in {b.experts_path for b in index.blocks}}
    assert len(experts) == len(index.blocks) >= 1
    assert index.topology.num_experts == 8 and index.topology.top_k == adapter.top_k(model.config)
    for block in (index.blocks[0], index.blocks[-1]):
        for expert in (0, 7):
            views = index.experts.views(read_slot(index, ExpertKey(block.moe_index, expert)))
            module = experts[block.experts_path]
            if adapter.uses_experts_registry:
                assert set(views) == {name for name, _ in module.named_parameters(recurse=False)}
            for param, view in views.items():
                assert torch.equal(view, adapter.expert_tensor(module, expert, param)), (block, expert, param)


@pytest.mark.parametrize("family", SUPPORTED)
def test_the_dense_part_is_transformers_own(reference, family):
    path, model, _ = reference(family)
    index = build_index(path)
    loaded = load_model(index, "cpu")
    ours, theirs = loaded.state_dict(keep_vars=True), model.state_dict()
    assert set(ours) == set(theirs)
    towers = tuple(f"{path}." for path in derive.towers(loaded))
    for name, value in ours.items():
        if index.is_expert_key(name) or (towers and name.startswith(towers)):  # never read
            assert value.is_meta, name
        else:
            torch.testing.assert_close(value, theirs[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
@pytest.mark.parametrize("family", SUPPORTED)
def test_greedy_tokens_at_a_quarter_budget_are_transformers_tokens(reference, family, sync):
    path, model, _ = reference(family)
    with Engine(path, EngineConfig(expert_budget="0.25", direct_io=False, sync=sync)) as engine:
        prompts = [engine.encode(p) for p in PROMPTS]
        result = engine.generate(prompts, max_new_tokens=NEW_TOKENS)
        pad_id = engine.pad_id
    assert result.metrics.expert_misses > 0
    assert result.token_ids == reference_generate(model, prompts, NEW_TOKENS, pad_id)


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
@pytest.mark.parametrize("family", SUPPORTED)
def test_tokens_with_host_compute_by_the_default_rule_are_transformers_tokens(reference, family, sync):
    path, model, _ = reference(family)
    config = EngineConfig(expert_budget="0.25", host_budget="0.5", direct_io=False, sync=sync, host_compute="default")
    with Engine(path, config) as engine:
        prompts = [engine.encode(p) for p in PROMPTS]
        result = engine.generate(prompts, max_new_tokens=NEW_TOKENS)
        pad_id = engine.pad_id
    assert result.token_ids == reference_generate(model, prompts, NEW_TOKENS, pad_id)


@pytest.mark.parametrize("family", REFUSED)
def test_a_family_that_cannot_work_says_why_in_one_line(family):
    config = type("Config", (), {"model_type": family})()
    with pytest.raises(CheckpointError, match=f"model type '{family}' is not supported: .+") as error:
        adapter_for(config)
    assert "\n" not in str(error.value)


def test_most_model_types_with_experts_are_supported():
    from moestream.families.catalog import experts_model_types

    declared = experts_model_types()
    assert len([name for name in declared if name in SUPPORTED]) >= 55
    assert set(declared) <= set(FAMILIES.names())
