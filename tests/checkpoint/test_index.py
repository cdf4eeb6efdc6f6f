"""The expert index ties disk bytes to memory: slot views of the indexed segments equal the fused
expert parameters of the plain transformers model, for every family, single-file and sharded."""

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from moestream.checkpoint.index import build_index
from moestream.checkpoint.layout import ExpertLocation
from moestream.errors import CheckpointError
from moestream.families.derive import DenseConversion
from moestream.topology import ExpertKey
from tests.conftest import SAMPLE_FAMILIES

ALL_FAMILIES = SAMPLE_FAMILIES
SMALL_SHARD_BYTES = 200_000


def read_slot(location: ExpertLocation) -> torch.Tensor:
    data = bytearray()
    for segment in location.segments:
        with open(segment.file, "rb") as handle:
            handle.seek(segment.offset)
            data += handle.read(segment.nbytes)
    return torch.frombuffer(data, dtype=torch.uint8)  # [expert_bytes]


def load_plain(path, index):
    model, info = getattr(transformers, index.adapter.auto_class).from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info
    return model


def sample_keys(topology) -> list[ExpertKey]:
    last_layer, last_expert = topology.num_layers - 1, topology.num_experts - 1
    return sorted({ExpertKey(0, 0), ExpertKey(0, last_expert), ExpertKey(last_layer, 3), ExpertKey(last_layer // 2, 5)})


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_slot_views_equal_the_models_expert_parameters(tiny_checkpoint, family):
    path = tiny_checkpoint(family)
    index = build_index(path)
    model = load_plain(path, index)
    for key in sample_keys(index.topology):
        location = index.experts.locations[key]
        assert location.nbytes == index.topology.expert_bytes
        slot = read_slot(location)
        views = index.experts.views(slot)
        experts = model.get_submodule(index.blocks[key.layer].experts_path)
        assert set(views) == {p.param for p in index.adapter.expert_parts(index.config)}
        for param, view in views.items():
            assert torch.equal(view, index.adapter.expert_tensor(experts, key.expert, param)), (key, param)
            assert view.is_contiguous()
            start = view.data_ptr() - slot.data_ptr()  # a view of the slot's own bytes, not a copy
            assert 0 <= start and start + view.numel() * view.element_size() <= slot.numel()


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_dense_tensors_are_the_rest_of_the_model(tiny_checkpoint, family):
    path = tiny_checkpoint(family)
    index = build_index(path)
    model = load_plain(path, index)
    state = model.state_dict()
    conversion = DenseConversion(model)
    dense_keys = {conversion.rename(name)[0] for name in index.dense_names()}
    assert dense_keys <= set(state)
    expert_prefixes = tuple(f"{b.experts_path}." for b in index.blocks)
    assert not any(key.startswith(expert_prefixes) for key in dense_keys)
    dense_storage = {state[key].data_ptr() for key in dense_keys}
    for key, tensor in state.items():  # anything not dense is an expert weight or tied to a dense one
        assert key in dense_keys or key.startswith(expert_prefixes) or tensor.data_ptr() in dense_storage, key
    assert len(index.experts.locations) == index.topology.total_experts


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_sharded_checkpoint_indexes_the_same_bytes(tiny_checkpoint, family):
    single = build_index(tiny_checkpoint(family))
    sharded = build_index(tiny_checkpoint(family, max_shard_bytes=SMALL_SHARD_BYTES))
    assert (sharded.path / "model.safetensors.index.json").is_file()
    assert len({s.file for loc in sharded.experts.locations.values() for s in loc.segments}) > 1
    assert sharded.topology == single.topology
    assert sharded.experts.layout == single.experts.layout
    assert sorted(sharded.dense_names()) == sorted(single.dense_names())
    for key in sample_keys(single.topology):
        assert torch.equal(read_slot(sharded.experts.locations[key]), read_slot(single.experts.locations[key]))


def test_adjacent_segments_are_merged(tiny_checkpoint):
    index = build_index(tiny_checkpoint("gpt_oss"))
    for location in index.experts.locations.values():
        ends = [(s.file, s.offset + s.nbytes) for s in location.segments]
        starts = [(s.file, s.offset) for s in location.segments[1:]]
        assert not set(ends[:-1]) & set(starts)


def test_bf16_checkpoint_views_in_bf16(tiny_checkpoint):
    path = tiny_checkpoint("mixtral", dtype="bf16")
    index = build_index(path)
    assert {p.dtype for p in index.experts.layout} == {torch.bfloat16}
    assert index.topology.expert_bytes == 2 * 3 * 64 * 64


@pytest.fixture
def copy_of(tiny_checkpoint, tmp_path):
    def copy(family="mixtral", **fields):
        destination = tmp_path / "copy"
        shutil.copytree(tiny_checkpoint(family, **fields), destination)
        return destination

    return copy


def rewrite(file, change):
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        build_index(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="no config.json"):
        build_index(tmp_path)


def test_unsupported_family_names_it(copy_of):
    path = copy_of()
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="model type 'llama' has no MoE experts in transformers"):
        build_index(path)


def test_config_that_is_not_json(copy_of):
    path = copy_of()
    (path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config.json is not valid JSON \(line 1 column 2: "):
        build_index(path)
    (path / "config.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(CheckpointError, match=r"config.json is not valid JSON \(not UTF-8 text\)"):
        build_index(path)


def test_config_that_is_json_but_not_an_object(copy_of):
    path = copy_of()
    (path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="config.json is not a JSON object"):
        build_index(path)


def test_missing_expert_tensor_is_named(copy_of):
    path = copy_of()
    name = "model.layers.2.block_sparse_moe.experts.5.w3.weight"
    rewrite(path / "model.safetensors", lambda tensors: tensors.pop(name))
    with pytest.raises(CheckpointError, match=f"missing expert tensor {name}"):
        build_index(path)


def test_expert_dtype_inconsistency_is_named(copy_of):
    path = copy_of()
    name = "model.layers.1.block_sparse_moe.experts.4.w2.weight"
    rewrite(path / "model.safetensors", lambda tensors: tensors.update({name: tensors[name].half()}))
    with pytest.raises(CheckpointError, match="expert 4 of model.layers.1.block_sparse_moe .*float16"):
        build_index(path)


def test_expert_shape_inconsistency_is_named(copy_of):
    path = copy_of()
    name = "model.layers.3.block_sparse_moe.experts.7.w1.weight"
    rewrite(path / "model.safetensors", lambda tensors: tensors.update({name: tensors[name][:-1].clone()}))
    with pytest.raises(CheckpointError, match="expert 7 of model.layers.3.block_sparse_moe"):
        build_index(path)


def test_gate_and_up_that_cannot_be_concatenated(copy_of):
    path = copy_of()
    name = "model.layers.0.block_sparse_moe.experts.0.w3.weight"
    rewrite(path / "model.safetensors", lambda tensors: tensors.update({name: tensors[name][:, :-1].clone()}))
    with pytest.raises(CheckpointError, match="gate_up_proj for expert 0 .* cannot be concatenated"):
        build_index(path)


def test_fused_tensor_with_the_wrong_expert_count(copy_of):
    path = copy_of("gpt_oss")
    name = "model.layers.0.mlp.experts.down_proj_bias"
    rewrite(path / "model.safetensors", lambda tensors: tensors.update({name: tensors[name][:-1].clone()}))
    with pytest.raises(CheckpointError, match=f"tensor {name} has shape"):
        build_index(path)
