"""Each family adapter's declarations agree with the transformers model built from its config."""

import pytest
import torch
import transformers

from moestream.checkpoint.make_model import make_config
from moestream.checkpoint.spec import ModelSpec
from moestream.errors import CheckpointError
from moestream.families import FAMILIES, adapter_for

ALL_FAMILIES = FAMILIES.names()


def meta_model(spec: ModelSpec):
    config = make_config(spec)
    with torch.device("meta"):
        model = getattr(transformers, spec.adapter().auto_class).from_config(config)
    return config, model


def experts_modules(model) -> dict[str, torch.nn.Module]:
    return {name: module for name, module in model.named_modules() if name.endswith("mlp.experts")}


def shared_expert_count(model, block_path: str, experts) -> int:
    block = model.get_submodule(block_path)
    if hasattr(block, "shared_experts"):  # DeepSeek: one MLP as wide as n_shared experts
        return block.shared_experts.gate_proj.out_features // experts.intermediate_dim
    return int(hasattr(block, "shared_expert"))


def test_every_family_is_registered_under_its_model_type():
    assert ALL_FAMILIES == sorted(["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3",
                                   "phimoe", "gpt_oss", "switch_transformers"])
    for name in ALL_FAMILIES:
        assert FAMILIES.get(name).model_type == name


def test_adapter_for_rejects_an_unsupported_family_listing_the_supported_ones():
    config = transformers.AutoConfig.for_model("llama")
    with pytest.raises(CheckpointError, match="unsupported model family 'llama'") as error:
        adapter_for(config)
    assert all(name in str(error.value) for name in ALL_FAMILIES)


@pytest.mark.parametrize("family", ALL_FAMILIES)
@pytest.mark.parametrize("num_layers", [2, 5])
def test_topology_and_blocks_match_the_model(family, num_layers):
    spec = ModelSpec(family, num_layers=num_layers, num_experts=8)
    config, model = meta_model(spec)
    adapter = adapter_for(config)
    found = experts_modules(model)
    blocks = adapter.blocks(config)
    assert sorted(b.experts_path for b in blocks) == sorted(found)
    assert [b.moe_index for b in blocks] == list(range(len(blocks)))
    topology = adapter.topology(config, expert_bytes=1)
    assert topology.moe_layer_ids == tuple(b.layer_id for b in blocks)
    assert len(set(topology.moe_layer_ids)) == len(blocks)
    for block in blocks:
        experts = found[block.experts_path]
        assert topology.num_experts == experts.num_experts == spec.num_experts
        block_path = block.experts_path.rsplit(".", 1)[0]
        if adapter.uses_experts_registry:
            assert topology.num_shared_experts == shared_expert_count(model, block_path, experts)
    assert topology.top_k == spec.resolved_top_k


def test_decoder_layer_ids_skip_dense_layers():
    config, _ = meta_model(ModelSpec("deepseek_v2", num_layers=4))
    assert adapter_for(config).moe_layer_ids(config) == [1, 2, 3]
    config, _ = meta_model(ModelSpec("switch_transformers", num_layers=4))
    assert adapter_for(config).moe_layer_ids(config) == [1, 3, 5, 7]  # encoder blocks 0-3, decoder 4-7


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_slot_parts_cover_every_expert_parameter(family):
    config, model = meta_model(ModelSpec(family))
    adapter = adapter_for(config)
    experts = model.get_submodule(adapter.blocks(config)[0].experts_path)
    params = {p.param for p in adapter.parts}
    per_expert = {name for name, _ in experts.named_parameters()}
    if adapter.uses_experts_registry:
        assert per_expert == params
    else:
        assert per_expert == {f"expert_{e}.{p}.weight" for e in range(len(experts)) for p in params}
    shapes = {p: tuple(adapter.expert_tensor(experts, 1, p).shape) for p in params}
    assert all(len(shape) >= 1 for shape in shapes.values())


def test_model_key_applies_renames_in_order():
    phimoe = FAMILIES.create("phimoe")
    assert phimoe.model_key("model.layers.3.block_sparse_moe.gate.weight") == "model.layers.3.mlp.router.weight"
    assert FAMILIES.create("mixtral").model_key("model.layers.3.block_sparse_moe.gate.weight") == (
        "model.layers.3.mlp.gate.weight")
    assert FAMILIES.create("qwen2_moe").model_key("model.layers.0.mlp.gate.weight") == "model.layers.0.mlp.gate.weight"
