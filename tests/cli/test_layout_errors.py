"""A checkpoint whose tensors do not match the layout derived from transformers: the first missing or
unexpected tensor named in one line, exit 2 (as a checkpoint downloaded without moestream's manifest)."""

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from moestream.cli import main
from tests.cli.test_generate import PROMPT, _error_line, model_dir  # noqa: F401 (a fixture)


def _rewrite_holding(path, name: str, change) -> None:
    """Rewrites the shard that holds `name` and the index to match, as a checkpoint downloaded without
    moestream's manifest would be."""
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shard = index["weight_map"][name]
    tensors = load_file(path / shard)
    change(tensors)
    save_file(tensors, path / shard, metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard} | dict.fromkeys(tensors, shard)
    index_file.write_text(json.dumps(index))
    (path / "moestream-manifest.json").unlink()


def _missing_expert(path):
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    _rewrite_holding(path, name, lambda tensors: tensors.pop(name))
    return f"missing expert tensor {name}"


def _unexpected(path):
    name = "model.layers.1.mlp.gate.weight"
    _rewrite_holding(path, name, lambda tensors: tensors.update({"model.layers.1.mlp.extra.weight": tensors[name].clone()}))
    return "unexpected tensor model.layers.1.mlp.extra.weight"


@pytest.mark.parametrize("damage", [_missing_expert, _unexpected])
def test_a_tensor_off_the_derived_layout_is_one_error_line(model_dir, tmp_path, capsys, damage):  # noqa: F811
    path = shutil.copytree(model_dir, tmp_path / "damaged")
    named = damage(path)
    assert main(["generate", "--model", str(path), "--prompt", PROMPT]) == 2
    assert named in _error_line(capsys)
