"""The loader builds the model on meta and reads only dense tensors; experts never leave disk."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from moestream.checkpoint.index import build_index
from moestream.checkpoint.make_model import make_model
from moestream.checkpoint.spec import ModelSpec
from moestream.errors import CheckpointError
from moestream.runtime.loader import dense_modules, load_model
from tests.conftest import SAMPLE_FAMILIES
from tests.runtime.conftest import auto_class


@pytest.mark.parametrize("family", SAMPLE_FAMILIES)
def test_dense_part_equals_transformers_and_experts_stay_on_meta(checkpoint, family):
    index = build_index(checkpoint(family))
    model = load_model(index, "cpu")
    reference = auto_class(family).from_pretrained(index.path)
    ours = model.state_dict(keep_vars=True)
    theirs = reference.state_dict()
    assert set(ours) == set(theirs)
    for name, value in ours.items():
        if index.is_expert_key(name):
            assert value.is_meta, name
        else:
            torch.testing.assert_close(value, theirs[name], rtol=0, atol=0, msg=name)
    for name, buffer in reference.named_buffers():
        torch.testing.assert_close(model.get_buffer(name), buffer, rtol=0, atol=0)


def _is_attention(module) -> bool:
    return type(module).__name__.endswith("Attention")  # T5's layer wrappers too: the innermost is the attention


@pytest.mark.parametrize("family", SAMPLE_FAMILIES)
def test_dense_modules_find_every_attention_and_no_routed_experts(checkpoint, family):
    model = load_model(build_index(checkpoint(family)), "cpu")
    roles = dense_modules(model)
    attention = [m for m in model.modules() if _is_attention(m) and not any(map(_is_attention, m.children()))]
    assert [id(m) for m in roles["attention"]] == [id(m) for m in attention]
    everything = [m for modules in roles.values() for m in modules]
    assert not any(hasattr(m, "experts") for m in everything)  # a MoE block is never a dense role
    assert roles["head"] == [model.get_output_embeddings()]


def _rewrite(path, change) -> None:
    file = path / "model.safetensors"
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_a_missing_dense_tensor_is_named(checkpoint, tmp_path):
    path = shutil.copytree(checkpoint("mixtral"), tmp_path / "copy")
    _rewrite(path, lambda tensors: tensors.pop("model.norm.weight"))
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        load_model(build_index(path), "cpu")


def test_a_dense_tensor_of_the_wrong_shape_is_named(checkpoint, tmp_path):
    path = shutil.copytree(checkpoint("mixtral"), tmp_path / "copy")
    _rewrite(path, lambda tensors: tensors.update({"model.norm.weight": torch.ones(3)}))
    with pytest.raises(CheckpointError, match="model.norm.weight.*shape"):
        load_model(build_index(path), "cpu")


PEAK_SCRIPT = """
import json, sys, torch
from moestream.checkpoint.index import build_index
from moestream.runtime import Engine, EngineConfig
from moestream.runtime.loader import build_skeleton

def high_water_mark():
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(status["VmHWM"].split()[0]) * 1024

path, budget = sys.argv[1:3]
torch.set_num_threads(1)
build_skeleton(build_index(path))  # imports and the meta model: everything but the weights
baseline = high_water_mark()
with Engine(path, EngineConfig(expert_budget=budget)) as engine:
    engine.generate([[5, 6, 7, 8]], max_new_tokens=2)
print(json.dumps({"growth_bytes": high_water_mark() - baseline}))
"""


def _growth(path, budget: int) -> int:
    """How much the peak resident memory of a fresh process grows to load the model and generate."""
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(path), f"{budget}B"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["growth_bytes"]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmHWM from /proc")
def test_peak_memory_is_dense_part_plus_budget(tmp_path):
    """Experts of 200 MB with a budget of two experts: the engine's peak stays far below them."""
    spec = ModelSpec("mixtral", num_layers=2, num_experts=8, hidden_size=256, intermediate_size=4096)
    path = make_model(spec, tmp_path / "big")
    index = build_index(path)
    topology = index.topology
    budget = topology.top_k * topology.expert_bytes
    dense = sum(index.tensors[name].nbytes for name in index.dense_names())
    slack = 48 * 2**20  # activations, allocator and import noise
    assert topology.total_expert_bytes > 2 * (dense + budget + slack)
    assert _growth(path, budget) < dense + budget + slack


def _read_bytes() -> int | None:
    """Bytes this process has made the kernel fetch from storage, or None where /proc/self/io is absent."""
    try:
        with open("/proc/self/io") as io:
            return next(int(line.split()[1]) for line in io if line.startswith("read_bytes"))
    except (OSError, StopIteration):
        return None


def test_loading_the_dense_part_reads_no_expert_bytes(tiny_checkpoint):
    import os

    path = tiny_checkpoint("qwen3_moe", num_layers=2, hidden_size=256, intermediate_size=256)
    checkpoint = build_index(path)
    files = sorted(path.glob("*.safetensors"))
    if _read_bytes() is None or not hasattr(os, "posix_fadvise"):
        pytest.skip("needs /proc/self/io and posix_fadvise")
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    before = _read_bytes()
    load_model(checkpoint, "cpu")
    read = _read_bytes() - before
    if read == 0:
        pytest.skip("the page cache kept the checkpoint (this filesystem reports no reads)")
    total = sum(f.stat().st_size for f in files)
    dense = total - checkpoint.topology.total_expert_bytes
    assert read <= dense + 2 * 4096 * sum(len(names) for names in checkpoint.dense.values())
    assert read < dense + checkpoint.topology.expert_bytes


@pytest.mark.parametrize("family", ["deepseek_v2", "mixtral"])
def test_the_output_head_gets_its_input_with_standard_strides(checkpoint, family):
    """At prefill the head reads the hidden states' last row, a [B, 1, H] view whose batch stride is T * H:
    torch's CPU bf16 linear copies the whole weight for such a view (seconds at a real vocabulary)."""
    from moestream.runtime import Engine, EngineConfig

    seen = []
    with Engine(checkpoint(family), EngineConfig(expert_budget=1.0)) as engine:
        head = engine.model.get_output_embeddings()
        head.register_forward_pre_hook(lambda module, args: seen.append((args[0].shape, args[0].stride())))
        engine.generate([[5, 6, 7, 8, 9, 10]], max_new_tokens=2)
    assert len(seen) == 2  # the prefill and one decode step
    for shape, stride in seen:
        assert stride == torch.empty(shape).stride(), (shape, stride)


CLOSE_SCRIPT = """
import gc, json, sys
gc.disable()  # what close frees must not wait for the collector
from moestream.runtime import Engine, EngineConfig

def rss_bytes():
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(status["VmRSS"].split()[0]) * 1024

engine = Engine(sys.argv[1], EngineConfig(expert_budget=1.0))  # every expert preloaded: the slots are touched
engine.generate([[5, 6, 7]], max_new_tokens=2)
before = rss_bytes()
engine.close()
del engine
print(json.dumps({"freed_bytes": before - rss_bytes()}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmRSS from /proc")
def test_closing_an_engine_frees_its_expert_slots_without_the_garbage_collector(tmp_path):
    spec = ModelSpec("mixtral", num_layers=2, num_experts=8, hidden_size=256, intermediate_size=4096)
    path = make_model(spec, tmp_path / "big")
    experts = build_index(path).topology.total_expert_bytes  # 200 MB
    out = subprocess.run([sys.executable, "-c", CLOSE_SCRIPT, str(path)], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1])["freed_bytes"] > 0.9 * experts
