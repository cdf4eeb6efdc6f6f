"""A MoE layer's routed experts in one call: bit-identical to transformers for every family, kernel,
dtype and token count, whatever order the experts arrive in."""

import dataclasses

import pytest
import torch

from moestream.checkpoint.index import build_index
from moestream.families import FAMILIES
from moestream.runtime import Engine, EngineConfig
from moestream.runtime.layer_experts import LAYER_KERNELS, LayerRows, aligned, grouped_ready, stacked
from tests.conftest import SAMPLE_FAMILIES
from tests.runtime.conftest import auto_class

REGISTRY_FAMILIES = [name for name in SAMPLE_FAMILIES if FAMILIES.get(name).uses_experts_registry]
SWAP_FAMILIES = [name for name in SAMPLE_FAMILIES if not FAMILIES.get(name).uses_experts_registry]
KERNELS = LAYER_KERNELS.names()


def _min_engine(path) -> Engine:
    topology = build_index(path).topology
    return Engine(path, EngineConfig(expert_budget=topology.top_k * topology.expert_bytes, direct_io=False))


def _routing(num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    index = torch.rand(num_tokens, num_experts, generator=generator).topk(top_k, dim=-1).indices  # [T, K]
    return index, torch.rand(num_tokens, top_k, generator=generator).to(dtype)  # [T, K]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("family", REGISTRY_FAMILIES)
def test_registry_experts_equal_transformers_for_every_kernel(checkpoint, family, dtype):
    """Groups of experts stream through the smallest device tier; fp32 slots start wherever their file
    offsets put them (the single-row products must not depend on it)."""
    path = checkpoint(family, dtype=dtype)
    reference = auto_class(family).from_pretrained(path)
    with _min_engine(path) as engine:
        block = engine.checkpoint.blocks[-1]
        theirs = reference.get_submodule(block.experts_path)
        topology = engine.checkpoint.topology
        for kernel in KERNELS:
            engine.experts.kernel = kernel
            for num_tokens in (1, 5, 16):
                index, weights = _routing(num_tokens, topology.num_experts, topology.top_k, theirs.down_proj.dtype,
                                          seed=num_tokens)
                hidden = torch.randn(num_tokens, reference.config.hidden_size).to(theirs.down_proj.dtype)
                with torch.no_grad():
                    ours = engine.model.get_submodule(block.experts_path)(hidden, index, weights)
                    expected = theirs(hidden, index, weights)
                assert torch.equal(ours, expected), (kernel, num_tokens)


@pytest.mark.parametrize("family", SWAP_FAMILIES)
def test_swapped_experts_equal_transformers_for_every_kernel(checkpoint, family):
    path = checkpoint(family)
    reference = auto_class(family).from_pretrained(path)
    with _min_engine(path) as engine:
        block = engine.checkpoint.blocks[0]
        num_experts = engine.checkpoint.topology.num_experts
        hidden = torch.randn(6, reference.config.d_model, generator=torch.Generator().manual_seed(2))
        selected = torch.nn.functional.one_hot(torch.tensor([0, 3, 3, 1, 5, 2]) % num_experts, num_experts)
        selected = selected.unsqueeze(1)  # [N, 1, E]
        selected[2] = 0  # dropped
        weights = torch.rand(6, 1, generator=torch.Generator().manual_seed(3))
        for kernel in KERNELS:
            engine.experts.kernel = kernel
            with torch.no_grad():
                ours = engine.model.get_submodule(block.experts_path)(hidden, selected, weights)
                expected = reference.get_submodule(block.experts_path)(hidden, selected, weights)
            assert torch.equal(ours, expected), kernel


class LinearMath:
    """A stand-in `ExpertMath`: up and down are one weight each, the activation a ReLU."""

    def up(self, hidden, weights):
        return hidden @ weights["up"]

    def act(self, up):
        return up.relu()

    def down(self, inner, weights):
        return inner @ weights["down"]

    def post(self, out):
        return out


def _layer(num_tokens=3, top_k=2, hidden=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    states = torch.randn(num_tokens, hidden, generator=generator)  # [T, H]
    scale = torch.rand(num_tokens * top_k, 1, generator=generator)  # [S, 1]
    order = torch.tensor([0, 3, 4, 1, 2, 5])  # rows sorted by expert: expert 0 [0, 2), 1 [2, 3), 2 [3, 6)
    rows = LayerRows(LinearMath(), states[order // top_k], scale[order], order, num_tokens * top_k, torch.float32)
    experts = [{"up": torch.randn(hidden, 4, generator=generator), "down": torch.randn(4, hidden, generator=generator)}
               for _ in range(3)]
    return rows, experts, [(0, 2), (2, 3), (3, 6)]


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_result_does_not_depend_on_the_order_experts_arrive_in(kernel):
    rows, experts, spans = _layer()
    results = []
    for arrival in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
        layer = LAYER_KERNELS.create(kernel, rows)
        for i in arrival:
            layer.add(experts[i], *spans[i])
        layer.flush()
        results.append(layer.result())
    assert all(torch.equal(result, results[0]) for result in results)
    start, end = spans[2]
    expected = (rows.inputs[start:end] @ experts[2]["up"]).relu() @ experts[2]["down"] * rows.scale[start:end]
    assert torch.equal(results[0][rows.order[start:end]], expected)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_layer_without_used_rows_gives_zeros(kernel):
    rows, _, _ = _layer()
    empty = LayerRows(rows.math, rows.inputs[:0], rows.scale[:0], rows.order[:0], 6, torch.float32)
    layer = LAYER_KERNELS.create(kernel, empty)
    layer.flush()
    assert torch.equal(layer.result(), torch.zeros(6, 8))


def test_misaligned_fp32_weights_are_computed_from_an_aligned_copy():
    buffer = torch.randn(65)  # [65] float32, 64-byte aligned
    weights = {"w": buffer[1:].view(8, 8), "b": buffer[:64].view(8, 8)}
    fixed = aligned(weights)
    assert fixed["w"].data_ptr() % 16 == 0 and torch.equal(fixed["w"], weights["w"])
    assert fixed["b"] is weights["b"]
    half = torch.zeros(65, dtype=torch.bfloat16)[1:].view(8, 8)
    assert aligned({"w": half})["w"] is half  # bf16 products do not depend on alignment


def test_evenly_spaced_views_stack_into_one_strided_view():
    pool = torch.arange(8 * 64, dtype=torch.float32).view(8, 64)  # 8 slots of 64 elements
    views = [pool[i, 16:32].view(4, 4) for i in (5, 1, 3)]
    stack = stacked(views)
    assert stack.shape == (3, 4, 4)  # slots 1, 3, 5: group g at slot 1 + 2g
    assert all(torch.equal(stack[g], pool[1 + 2 * g, 16:32].view(4, 4)) for g in range(3))
    assert stacked([pool[0, :16].view(4, 4), pool[0, 1:17].view(4, 4), pool[7, 1:17].view(4, 4)]) is None  # 1 apart
    assert stacked([pool[0, :16].view(4, 4), torch.zeros(4, 4)]) is None  # another storage


def test_a_layer_s_few_experts_among_many_slots_still_stack():
    pool = torch.zeros(400, 64)  # a pool of 400 slots, a layer's 3 experts far apart in it
    views = [pool[i, :16].view(4, 4) for i in (3, 250, 397)]
    stack = stacked(views)
    assert stack is not None and stack.shape == (395, 4, 4) and stack.data_ptr() == views[0].data_ptr()


def test_the_grouped_kernel_streams_experts_whose_math_has_no_grouped_form():
    rows, experts, spans = _layer()
    grouped, stream = LAYER_KERNELS.create("grouped", rows), LAYER_KERNELS.create("stream", rows)
    for weights, span in zip(experts, spans):
        grouped.add(weights, *span)
        stream.add(weights, *span)
    grouped.flush()
    assert torch.equal(grouped.result(), stream.result())


class GroupedOnlyMath(LinearMath):
    """Computes only through grouped products: one expert at a time would fail."""

    def up(self, hidden, weights):
        raise AssertionError("computed expert by expert")

    down = up

    def up_grouped(self, x, stacked, offs, groups):
        return torch.nn.functional.grouped_mm(x, stacked["up"], offs=offs)

    def down_grouped(self, x, stacked, offs, groups):
        return torch.nn.functional.grouped_mm(x, stacked["down"], offs=offs)


@pytest.mark.skipif(not grouped_ready(torch.device("cpu")), reason="torch has no grouped GEMM on the CPU")
def test_the_grouped_kernel_runs_experts_of_evenly_spaced_slots_as_one_grouped_product():
    rows, experts, spans = _layer()
    pool = torch.zeros(8, 128)  # [slots, floats]: every slot holds one expert's up [8, 4] then down [4, 8]
    placed = []
    for slot, weights in zip((6, 0, 2), experts):
        pool[slot, :32], pool[slot, 32:64] = weights["up"].reshape(-1), weights["down"].reshape(-1)
        placed.append({"up": pool[slot, :32].view(8, 4), "down": pool[slot, 32:64].view(4, 8)})
    expected = LAYER_KERNELS.create("stream", rows)
    grouped = LAYER_KERNELS.create("grouped", dataclasses.replace(rows, math=GroupedOnlyMath()))
    for weights, copy, span in zip(experts, placed, spans):
        expected.add(weights, *span)
        grouped.add(copy, *span)
    grouped.flush()
    assert torch.equal(grouped.result(), expected.result())


@pytest.mark.skipif(not grouped_ready(torch.device("cpu")), reason="torch has no grouped GEMM on the CPU")
@pytest.mark.parametrize("family", ["deepseek_v2", "gpt_oss"])  # gpt_oss: biases, [in, out] weights, its own gate
def test_grouped_products_of_a_transformers_experts_module_equal_its_per_expert_products(family):
    from moestream.checkpoint.make_model import make_config
    from moestream.checkpoint.spec import ModelSpec
    from moestream.runtime.expert_math import FusedExpertMath

    config = make_config(ModelSpec(family, num_layers=2))
    model = auto_class(family).from_config(config)
    adapter = FAMILIES.create(family)
    module = model.get_submodule(adapter.blocks(config)[-1].experts_path)
    with torch.no_grad():
        for param in module.parameters():
            param.normal_(0, 0.05, generator=torch.Generator().manual_seed(4))
    rows, _, spans = _layer(hidden=config.hidden_size)
    rows = dataclasses.replace(rows, math=FusedExpertMath(module))
    stream, grouped = LAYER_KERNELS.create("stream", rows), LAYER_KERNELS.create("grouped", rows)
    for expert, span in zip((5, 1, 3), spans):  # slices [e] of the module's fused parameters: evenly spaced
        weights = {part.param: adapter.expert_tensor(module, expert, part.param) for part in adapter.expert_parts(config)}
        stream.add(weights, *span)
        grouped.add(weights, *span)
    grouped.flush()
    with torch.no_grad():
        assert torch.equal(grouped.result(), stream.result())
