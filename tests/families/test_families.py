"""The derivation itself: the catalog of model types, layouts read from transformers' conversion
mapping (per expert, fused, transposed, refused), dense renames, counts, and the one-line refusals."""

import pytest
import torch
import transformers

from moestream.checkpoint.make_model import make_config
from moestream.checkpoint.spec import ModelSpec
from moestream.errors import CheckpointError
from moestream.families import FAMILIES, adapter_for, derive
from moestream.families.catalog import experts_model_types, generating_class
from moestream.families.tiny import Sizes, layer_list, shrink


def layout(family: str, **spec):
    config = make_config(ModelSpec(family, **spec))
    return config, adapter_for(config)


def test_the_catalog_is_every_model_type_with_an_experts_implementation():
    types = experts_model_types()
    assert len(types) >= 60 and list(types) == sorted(types)
    assert {"mixtral", "deepseek_v3", "qwen3_next", "gpt_oss"} <= set(types)
    assert "llama" not in types and "switch_transformers" not in types  # dense; a ModuleDict of experts
    assert set(types) | {"switch_transformers"} == set(FAMILIES.names())


def test_a_multimodal_release_is_run_by_the_class_built_on_its_own_config():
    assert generating_class("mixtral") == "AutoModelForCausalLM"
    assert generating_class("qwen3_vl_moe") == "AutoModelForImageTextToText"
    assert generating_class("qwen3_5_moe") == "AutoModelForImageTextToText"  # its causal LM takes the text config
    assert generating_class("openai_privacy_filter") is None  # token classification only


def test_per_expert_layouts_read_transformers_renames():
    config, adapter = layout("mixtral")
    (gate_up, down) = adapter.expert_parts(config)
    assert (gate_up.param, gate_up.disk) == ("gate_up_proj", ("experts.{expert}.w1.weight", "experts.{expert}.w3.weight"))
    assert (down.param, down.disk, down.fused_on_disk) == ("down_proj", ("experts.{expert}.w2.weight",), False)
    assert adapter.blocks(config)[1].disk_prefix == "model.layers.1.block_sparse_moe"
    assert adapter.blocks(config)[1].experts_path == "model.layers.1.mlp.experts"


def test_fused_and_transposed_layouts_are_told_by_their_values():
    config, adapter = layout("gpt_oss")
    assert all(p.fused_on_disk and not p.may_transpose for p in adapter.expert_parts(config))
    config, adapter = layout("qwen3_vl_moe")
    gate_up = adapter.expert_parts(config)[0]
    assert gate_up.fused_on_disk and gate_up.may_transpose and gate_up.shape == (128, 64)


def test_an_interleaved_layout_is_refused_with_its_reason():
    config = transformers.AutoConfig.for_model("inkling2", **shrink("inkling2", Sizes(3, 8, 2, 64, 64, 512)))
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(config)
    path = derive.experts_modules(model)[0][0]
    with pytest.raises(CheckpointError, match=r"stored as .*w13_weight in another layout \(interleaved"):
        derive.disk_part(model, path, "gate_up_proj")
    assert FAMILIES.get("inkling2").reason().startswith("its releases interleave")


def test_dense_names_are_renamed_as_transformers_loads_them():
    for family, disk, key in (("mixtral", "model.layers.3.block_sparse_moe.gate.weight", "model.layers.3.mlp.gate.weight"),
                              ("qwen2_moe", "model.layers.0.mlp.gate.weight", "model.layers.0.mlp.gate.weight")):
        config = make_config(ModelSpec(family, num_layers=4))
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        assert derive.DenseConversion(model).rename(disk) == (key, None)


@pytest.mark.parametrize("family, moe_layers, shared", [("deepseek_v2", [1, 2, 3], 2), ("qwen2_moe", [0, 1, 2, 3], 1),
                                                        ("mixtral", [0, 1, 2, 3], 0), ("jamba", [0, 2], 0)])
def test_counts_come_from_the_model_and_its_config(family, moe_layers, shared):
    config, adapter = layout(family, num_layers=4, num_experts=8)
    topology = adapter.topology(config, expert_bytes=1)
    assert list(topology.moe_layer_ids) == moe_layers
    assert (topology.num_experts, topology.top_k, topology.num_shared_experts) == (8, 2, shared)


def test_a_small_config_keeps_every_kind_of_layer():
    assert layer_list(["linear"] * 3 + ["full"], 3) == ["linear", "linear", "full"]
    assert layer_list(["a", "b", "a", "b"], 3) == ["a", "b", "a"]


def test_an_unknown_model_type_names_it_and_the_transformers_version():
    with pytest.raises(CheckpointError, match=f"'llama' has no MoE experts in transformers {transformers.__version__}"):
        adapter_for(transformers.AutoConfig.for_model("llama"))


def test_a_config_without_moe_layers_is_refused():
    with pytest.raises(CheckpointError, match="no MoE layer"):
        make_config(ModelSpec("deepseek_v2", num_layers=1))


def test_a_multimodal_models_towers_are_what_text_generation_never_runs():
    config = make_config(ModelSpec("qwen3_vl_moe"))
    model = derive.meta_model(config, FAMILIES.get("qwen3_vl_moe").auto_class)
    assert derive.towers(model) == ("model.visual",)
    config = make_config(ModelSpec("mixtral"))
    assert derive.towers(derive.meta_model(config, "AutoModelForCausalLM")) == ()
