"""`make_model` writes real-format checkpoints of every family that plain transformers loads, with
each family's routing specifics, varied routing, non-degenerate greedy output, atomic writes, its
integrity manifest, and real models' shapes (presets, width scale) planned without building them."""

import hashlib
import os

import pytest
import torch
import transformers
from transformers import AutoTokenizer

from moestream.checkpoint import writer
from moestream.checkpoint.index import build_index
from moestream.checkpoint.make_model import disk_tensors, make_config, make_model, meta_model
from moestream.checkpoint.manifest import load_manifest
from moestream.checkpoint.spec import ModelSpec, deepseek_v2_lite_spec, demo_spec, width_scaled
from moestream.checkpoint.verify import verify
from moestream.errors import CheckpointError
from moestream.families import FAMILIES
from tests.conftest import SAMPLE_FAMILIES

ALL_FAMILIES = SAMPLE_FAMILIES
PROMPT = "The lighthouse keeper climbed the stairs. def f(x): return x + 1"


def load(path):
    family = transformers.AutoConfig.from_pretrained(path).model_type
    auto_class = getattr(transformers, FAMILIES.get(family).auto_class)
    model, info = auto_class.from_pretrained(path, output_loading_info=True)
    return model.eval(), info


def routed_counts(model, tokenizer, text: str, max_new_tokens: int) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Tokens per expert in every experts module during greedy generation, and the new tokens."""
    counts: dict[str, torch.Tensor] = {}

    def record(name):
        def hook(module, args):
            chosen = args[1]  # [T, K] indices, or Switch's one-hot [T, 1, E] mask
            if chosen.dim() == 3:
                chosen = torch.nonzero(chosen.reshape(-1, chosen.shape[-1]))[:, 1]
            counts[name] = counts.get(name, 0) + torch.bincount(chosen.reshape(-1), minlength=module.num_experts)
        return hook

    handles = [m.register_forward_pre_hook(record(n)) for n, m in model.named_modules() if n.endswith("mlp.experts")]
    inputs = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)
    for handle in handles:
        handle.remove()
    new = output[0, 1:] if model.config.is_encoder_decoder else output[0, inputs["input_ids"].shape[1]:]
    return counts, new.tolist()


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_plain_transformers_loads_it_without_missing_keys(tiny_checkpoint, family):
    path = tiny_checkpoint(family)
    model, info = load(path)
    assert not any(info.values()), info
    assert model.config.model_type == family
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.decode(tokenizer(PROMPT)["input_ids"], skip_special_tokens=True) == PROMPT
    assert len(tokenizer) == model.config.vocab_size == 512


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_routing_is_varied_and_greedy_output_is_not_one_token(tiny_checkpoint, family):
    path = tiny_checkpoint(family)
    model, _ = load(path)
    counts, new_tokens = routed_counts(model, AutoTokenizer.from_pretrained(path), PROMPT, max_new_tokens=16)
    adapter = FAMILIES.create(family)
    assert len(counts) == len(adapter.blocks(model.config))
    for name, per_expert in counts.items():
        assert (per_expert > 0).sum() >= adapter.num_experts(model.config) // 2, (name, per_expert)
    assert len(set(new_tokens)) > 2, new_tokens


def test_family_specifics_are_exercised(tiny_checkpoint):
    qwen2, _ = load(tiny_checkpoint("qwen2_moe"))
    assert qwen2.model.layers[0].mlp.shared_expert_gate.weight.abs().sum() > 0
    v2, _ = load(tiny_checkpoint("deepseek_v2"))
    assert not hasattr(v2.model.layers[0].mlp, "experts") and v2.config.n_shared_experts == 2
    assert v2.config.topk_method == "group_limited_greedy" and v2.config.topk_group < v2.config.n_group
    v3, _ = load(tiny_checkpoint("deepseek_v3"))
    bias = v3.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.abs().min() > 0 and len(set(bias.tolist())) == len(bias)
    assert v3.config.n_group > 1 and v3.config.topk_group < v3.config.n_group and v3.config.routed_scaling_factor != 1
    gpt, _ = load(tiny_checkpoint("gpt_oss"))
    assert gpt.model.layers[0].mlp.experts.gate_up_proj_bias.abs().min() > 0
    assert gpt.model.layers[0].mlp.router.bias.abs().min() > 0
    switch, _ = load(tiny_checkpoint("switch_transformers"))
    assert switch.config.is_encoder_decoder and switch.config.expert_capacity >= 1024
    assert [b.is_sparse for b in switch.encoder.block] == [False, True, False, True]


def test_switch_still_runs_when_tokens_are_dropped(tiny_checkpoint):
    path = tiny_checkpoint("switch_transformers", config_overrides={"expert_capacity": 1})
    model, info = load(path)
    assert not any(info.values())
    counts, new_tokens = routed_counts(model, AutoTokenizer.from_pretrained(path), PROMPT, max_new_tokens=4)
    encoder_counts = [c for name, c in counts.items() if name.startswith("encoder")]
    assert all(int(c.max()) <= 1 for c in encoder_counts)  # capacity 1: at most one token per expert
    assert len(new_tokens) == 4


def file_digests(path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    spec = ModelSpec("olmoe", num_layers=2, hidden_size=32, intermediate_size=32)
    first = file_digests(make_model(spec, tmp_path / "a"))
    assert first == file_digests(make_model(spec, tmp_path / "b"))
    other = file_digests(make_model(ModelSpec("olmoe", num_layers=2, hidden_size=32, intermediate_size=32, seed=1),
                                    tmp_path / "c"))
    assert other["model.safetensors"] != first["model.safetensors"]
    assert other["tokenizer.json"] == first["tokenizer.json"]


def test_refuses_a_non_empty_output_but_fills_an_empty_one(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    spec = ModelSpec("mixtral", num_layers=1, hidden_size=16, intermediate_size=8)
    with pytest.raises(CheckpointError, match="already exists and is not an empty directory"):
        make_model(spec, tmp_path / "full")
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    (tmp_path / "empty").mkdir()
    assert (make_model(spec, tmp_path / "empty") / "config.json").is_file()


def test_an_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
    real_write = writer.write_shard

    def interrupting(*args, **kwargs):
        real_write(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(writer, "write_shard", interrupting)
    with pytest.raises(KeyboardInterrupt):
        make_model(ModelSpec("mixtral", num_layers=1, hidden_size=16, intermediate_size=8), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "fields, problem",
    [
        (dict(family="llama"), "model type 'llama' has no MoE experts in transformers"),
        (dict(family="mixtral", top_k=9), "top-k 9 must be between 1 and num_experts"),
        (dict(family="switch_transformers", top_k=2), "exactly 1 expert"),
        (dict(family="phimoe", top_k=3), "exactly 2 expert"),
        (dict(family="mixtral", hidden_size=40), "multiple of 16"),
        (dict(family="mixtral", vocab_size=100), "too small"),
        (dict(family="mixtral", dtype="fp8"), "dtype 'fp8'"),
        (dict(family="mixtral", num_experts=0), ">= 1"),
        (dict(family="mixtral", max_shard_bytes=0), "max shard bytes"),
    ],
)
def test_bad_specs_are_refused(fields, problem):
    with pytest.raises(CheckpointError, match=problem):
        ModelSpec(**fields)


def test_a_deepseek_model_needs_a_moe_layer(tmp_path):
    with pytest.raises(CheckpointError, match="has no MoE layer"):
        make_model(ModelSpec("deepseek_v2", num_layers=1), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_demo_spec_has_deepseek_v2_lite_topology_and_over_a_gib_of_experts():
    spec = demo_spec()
    config = make_config(spec)
    topology = spec.adapter().topology(config, expert_bytes=3 * config.hidden_size * config.moe_intermediate_size * 2)
    assert (config.model_type, config.num_hidden_layers) == ("deepseek_v2", 27)
    assert topology.moe_layer_ids == tuple(range(1, 27))
    assert (topology.num_experts, topology.top_k, topology.num_shared_experts) == (64, 6, 2)
    assert topology.total_expert_bytes >= 2**30
    assert spec.dtype == "bf16" and spec.max_shard_bytes < topology.total_expert_bytes
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    experts = model.get_submodule(spec.adapter().blocks(config)[0].experts_path)
    per_expert = sum(p[0].numel() * p.element_size() for p in experts.parameters())
    assert per_expert == topology.expert_bytes


@pytest.mark.parametrize("umask, directory, files", [(0o022, 0o755, 0o644), (0o027, 0o750, 0o640)])
def test_what_it_writes_has_the_permissions_of_a_plain_write(tmp_path, umask, directory, files):
    """Not the 0700 and 0600 of temporary files: a service account can read a checkpoint (umask 022)."""
    before = os.umask(umask)
    try:
        out = make_model(ModelSpec("mixtral", num_layers=1, hidden_size=16, intermediate_size=8), tmp_path / "m")
    finally:
        os.umask(before)
    assert out.stat().st_mode & 0o777 == directory
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == {p.name: files for p in out.iterdir()}


def _planned(spec):
    """(config, tensors) make-model would write for spec, nothing written."""
    config = make_config(spec)
    return config, [tensor for unit in disk_tensors(meta_model(spec, config)) for tensor in unit]


def test_the_deepseek_v2_lite_preset_has_its_real_shape():
    config, tensors = _planned(deepseek_v2_lite_spec())
    assert (config.num_hidden_layers, config.first_k_dense_replace, config.n_routed_experts) == (27, 1, 64)
    assert (config.num_experts_per_tok, config.n_shared_experts, config.hidden_size) == (6, 2, 2048)
    assert (config.moe_intermediate_size, config.intermediate_size, config.kv_lora_rank) == (1408, 10944, 512)
    assert (config.num_attention_heads, config.vocab_size, config.topk_method) == (16, 102400, "greedy")
    experts = [t for t in tensors if ".mlp.experts." in t.name]
    assert len(experts) == 26 * 64 * 3 and {t.dtype for t in experts} == {torch.bfloat16}
    assert sum(t.nbytes for t in experts) == 26 * 64 * 17_301_504  # 3 x 2048 x 1408 x 2 bytes each
    assert 31.0e9 < sum(t.nbytes for t in tensors) < 31.5e9


def test_half_width_halves_the_hidden_width_and_keeps_expert_width():
    config, tensors = _planned(width_scaled(deepseek_v2_lite_spec(), 0.5))
    assert (config.hidden_size, config.num_attention_heads, config.kv_lora_rank) == (1024, 8, 256)
    assert config.moe_intermediate_size == 1408
    experts = sum(t.nbytes for t in tensors if ".mlp.experts." in t.name)
    assert experts == 26 * 64 * 8_650_752 and 14.3e9 < experts < 14.5e9
    with pytest.raises(CheckpointError, match="width scale"):
        width_scaled(deepseek_v2_lite_spec(), 0.0)


def test_bytes_do_not_depend_on_the_number_of_workers(tmp_path):
    spec = ModelSpec("qwen2_moe", num_layers=2, max_shard_bytes=100_000)
    assert file_digests(make_model(spec, tmp_path / "a", workers=1)) == \
        file_digests(make_model(spec, tmp_path / "b", workers=4))


def test_the_checkpoint_comes_with_its_integrity_manifest(tiny_checkpoint):
    path = tiny_checkpoint("qwen2_moe", num_layers=2, max_shard_bytes=300_000)
    manifest = load_manifest(build_index(path))
    assert manifest is not None and len(manifest.digests) == build_index(path).topology.total_experts
    assert not verify(path).manifest_written  # the shards match the digests recorded when they were written


def test_a_tokenizer_smaller_than_the_embedding(tmp_path):
    spec = ModelSpec("deepseek_v2", num_layers=2, vocab_size=4096, tokenizer_vocab_size=512)
    path = make_model(spec, tmp_path / "m")
    model, info = load(path)
    assert not any(info.values()) and model.config.vocab_size == 4096
    assert len(AutoTokenizer.from_pretrained(path)) == 512
    with pytest.raises(CheckpointError, match="tokenizer vocab size 8192"):
        ModelSpec("deepseek_v2", vocab_size=4096, tokenizer_vocab_size=8192)
