"""One device-to-host read per MoE layer and one per step (the logits, with the finite flags): every
read goes through HostReads, which counts them, and no engine module reads a device tensor otherwise."""

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

import moestream.runtime
from moestream.contracts import Observer
from moestream.runtime import Engine, EngineConfig
from moestream.runtime.host_reads import HostReads

READS = {"cpu", "tolist", "item", "numpy"}  # methods that read a device tensor on the host


def _reads_outside_host_reads(path: Path) -> list[str]:
    """`x.cpu()`, `.tolist()`, `.item()`, `.numpy()` and `bool(x)` calls in a module: where a device tensor
    would be read without HostReads."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in READS or isinstance(func, ast.Name) and func.id == "bool":
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_engine_module_reads_a_device_tensor_but_through_host_reads():
    runtime = Path(moestream.runtime.__file__).parent
    modules = [path for path in sorted(runtime.glob("*.py")) if path.name != "host_reads.py"]
    assert len(modules) > 10
    assert [read for path in modules for read in _reads_outside_host_reads(path)] == []


def test_the_source_check_finds_a_read(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f(x):\n    return bool(x.isfinite().all()), x.cpu(), x.tolist()\n")
    assert len(_reads_outside_host_reads(module)) == 3


def test_a_read_is_counted_once_whatever_it_carries():
    reads = HostReads()
    ids, weights = reads.read(torch.tensor([[1, 2]]), torch.ones(1, 2, dtype=torch.bfloat16))
    assert reads.count == 1 and ids.tolist() == [[1, 2]] and weights.dtype == np.float32


class Reader(Observer):
    def observe(self, event):
        self.last = event


@pytest.mark.parametrize("sync", [False, True])
def test_a_decode_step_reads_once_per_moe_layer_and_once_for_its_logits(tiny_checkpoint, sync):
    path = tiny_checkpoint("qwen2_moe", num_layers=3)
    with Engine(path, EngineConfig(expert_budget="1.0", direct_io=False, sync=sync)) as engine:  # all resident
        engine.add_observer(Reader())  # routing events wanted: the offloaded path, every lookup a hit
        engine.generate(["The experts are"], max_new_tokens=2)
        layers, steps = engine.checkpoint.topology.num_layers, 4
        before = engine.reads.count
        engine.generate(["The experts are"], max_new_tokens=steps)
        assert engine.reads.count - before == steps * (layers + 1)  # the prefill and 3 decode steps
        assert engine.store.stats().misses == 0 and engine.store.stats().hits > 0


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral", "deepseek_v2"])
def test_all_resident_and_unobserved_a_step_reads_only_its_logits_and_keeps_transformers_tokens(tiny_checkpoint, family):
    from tests.runtime.conftest import reference_generate

    path = tiny_checkpoint(family, num_layers=3)
    with Engine(path, EngineConfig(expert_budget="1.0", direct_io=False)) as engine:
        prompts = [engine.encode("The experts are")]
        engine.generate(prompts, max_new_tokens=2)
        before = engine.reads.count
        result = engine.generate(prompts, max_new_tokens=4)
        assert engine.reads.count - before == 4  # transformers' experts forward over the pool: no layer reads
        assert engine.experts.resident_weights(0) is not None
        model = transformers_model(path)
    assert result.token_ids == reference_generate(model, prompts, 4, engine.pad_id)


def transformers_model(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


def test_shared_experts_run_once_per_block_before_its_routing_is_read(tiny_checkpoint):
    from moestream.runtime.experts import LaunchedFirst

    path = tiny_checkpoint("deepseek_v2", num_layers=3)  # its blocks call the shared experts after the routed
    with Engine(path, EngineConfig(expert_budget="0.5", direct_io=False)) as engine:
        engine.add_observer(Reader())
        first = [m for m in engine.model.modules() if isinstance(m, LaunchedFirst)]
        assert len(first) == engine.checkpoint.topology.num_layers
        seen = []
        for module in first:
            module.shared.register_forward_hook(lambda *args: seen.append(engine.reads.count))
        before = engine.reads.count
        engine.generate(["The experts are"], max_new_tokens=1)  # one forward pass
    layers = len(first)
    assert seen == [before + layer for layer in range(layers)]  # each before its layer's read, once


def test_shared_experts_launched_first_compute_anew_for_other_calls_and_keep_nothing_after_the_block():
    from moestream.runtime.experts import launch_shared_first

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.shared_experts = torch.nn.Linear(4, 4)

        def forward(self, x, fail=False):
            if fail:
                raise RuntimeError("a layer failed")
            return self.shared_experts(x.view(-1, 4)) + self.shared_experts(x.flip(0).contiguous())

    block, x = Block(), torch.randn(3, 4)
    expected = block.shared_experts(x) + block.shared_experts(x.flip(0))
    launch_shared_first(block)
    assert torch.equal(block(x), expected)  # the first call took the launched result, the second computed
    with pytest.raises(RuntimeError):
        block(x, fail=True)
    assert block.shared_experts._early is None  # nothing kept after a block that raised
    assert torch.equal(block.shared_experts(x), block.shared_experts.shared(x))  # no launch: computed
