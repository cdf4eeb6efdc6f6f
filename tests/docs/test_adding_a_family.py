"""The worked example of docs/adding-a-family.md is real: without its declaration the small Jamba
model fails; read from the page and registered, the engine's tokens are transformers' tokens."""

from pathlib import Path

import pytest
import transformers

from moestream.checkpoint.make_model import make_model
from moestream.checkpoint.spec import ModelSpec
from moestream.families import FAMILIES, FamilyAdapter
from moestream.runtime import Engine, EngineConfig
from tests.docs.pages import DOCS, python_example
from tests.runtime.conftest import PROMPTS, reference_generate

PAGE = DOCS / "adding-a-family.md"


def example_source() -> str:
    return python_example(PAGE)


@pytest.fixture
def without_jamba(monkeypatch):
    """The registry as if Jamba had no file: a plain derived adapter."""
    classes = dict(FAMILIES._classes)
    classes["jamba"] = type("DerivedJamba", (FamilyAdapter,), {"model_type": "jamba"})
    monkeypatch.setattr(FAMILIES, "_classes", classes)


def tokens_equal(path) -> bool:
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with Engine(path, EngineConfig(expert_budget="0.25", direct_io=False)) as engine:
        prompts = [engine.encode(p) for p in PROMPTS]
        ours = engine.generate(prompts, max_new_tokens=4).token_ids
        pad_id = engine.pad_id
    return ours == reference_generate(model, prompts, 4, pad_id)


def test_the_example_is_the_family_file():
    source = (Path(__file__).resolve().parents[2] / "moestream" / "families" / "jamba.py").read_text()
    assert example_source().strip() == source.strip()


def test_without_the_declaration_the_small_model_has_no_attention_layer(without_jamba, tmp_path):
    path = make_model(ModelSpec("jamba", num_layers=3), tmp_path / "jamba")
    config = transformers.AutoConfig.from_pretrained(path)
    assert "attention" not in config.layers_block_type
    with pytest.raises(ValueError, match="Attention layers"):
        tokens_equal(path)


def test_with_the_declaration_the_tokens_are_transformers_tokens(without_jamba, monkeypatch, tmp_path):
    monkeypatch.setattr(FAMILIES, "_classes", {k: v for k, v in FAMILIES._classes.items() if k != "jamba"})
    namespace = {"__name__": "adding_a_family_example"}
    exec(compile(example_source(), str(PAGE), "exec"), namespace)
    assert FAMILIES.get("jamba") is namespace["JambaAdapter"]
    path = make_model(ModelSpec("jamba", num_layers=3), tmp_path / "jamba")
    assert "attention" in transformers.AutoConfig.from_pretrained(path).layers_block_type
    assert tokens_equal(path)
