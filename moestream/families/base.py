"""What a model family is to moestream: where its MoE blocks live, how an expert is laid out in a slot and on disk,
and its counts, by default all derived from transformers (`derive.py`). A family file declares only what cannot be
derived (a router's fixed top-k, tensors a test model fills with noise, a small test config's fields, the quantized
formats its releases come in, or why it cannot work); the engine and the store know no family by name.

Slot layout: an expert's slot is the concatenation, in `parts` order, of the per-expert slices of the experts
module's fused parameters (e.g. gate_up_proj[e] then down_proj[e]), each in the checkpoint's dtype. On disk, a part
is filled by the listed tensors in order (e.g. w1 then w3 fill gate_up_proj[e]), each a contiguous byte range of a
safetensors file, or slice [e] of a tensor fused over experts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from moestream.errors import CheckpointError
from moestream.families import catalog, tiny
from moestream.registry import Registry
from moestream.topology import Topology

TOP_K_FIELDS = ("num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk", "top_k_experts", "top_k")
SHARED_FIELDS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
SHARED_NAMES = ("shared_experts", "shared_expert", "shared_mlp")  # a block's shared experts, as transformers names them


class OfClass:
    """A class attribute computed from the class it is read on (or an instance's), when first read."""

    def __init__(self, compute):
        self.compute = compute

    def __get__(self, instance, owner) -> str:
        return self.compute(owner)


@dataclass(frozen=True)
class ExpertPart:
    param: str  # fused parameter of the experts module in memory, e.g. "gate_up_proj"
    disk: tuple[str, ...]  # disk tensor names, relative to the block prefix, with {expert}
    fused_on_disk: bool = False  # the disk tensor is [E, ...] for all experts; take [expert]
    may_transpose: bool = False  # fused on disk, perhaps with each expert's last two dimensions swapped
    shape: tuple[int, ...] = ()  # one expert's slice in memory (what a transposed disk tensor is told by)


@dataclass(frozen=True)
class MoEBlock:
    moe_index: int  # 0..L-1
    layer_id: int  # decoder-layer index (for encoder-decoder models, a running block index)
    disk_prefix: str  # e.g. "model.layers.3.block_sparse_moe"
    experts_path: str  # module path of the experts module in the model, e.g. "model.layers.3.mlp.experts"


@dataclass(frozen=True)
class Layout:
    """What is derived from one config: the MoE blocks, the expert parts, the counts."""

    blocks: tuple[MoEBlock, ...]
    parts: tuple[ExpertPart, ...]
    num_experts: int
    num_shared_experts: int


class FamilyAdapter:
    """A family as transformers declares it; family files set class attributes, override what is not derived."""

    model_type: ClassVar[str] = OfClass(lambda cls: cls.registry_name)  # the name it is registered under in FAMILIES
    # a name in transformers (a family file may set one): the auto class that generates text for the model type,
    # looked up when first read (the import stays light)
    auto_class: ClassVar[str] = OfClass(lambda cls: catalog.generating_class(cls.model_type) or "AutoModelForCausalLM")
    uses_experts_registry: ClassVar[bool] = True  # False: the engine swaps the experts module
    fixed_top_k: ClassVar[int | None] = None  # the family's router only supports this top-k
    noise_init: ClassVar[tuple[str, ...]] = ()  # name suffixes of tensors a test model fills with noise
    tiny_fields: ClassVar[dict] = {}  # text-config fields of a small test model the generic shrink misses
    quant_formats: ClassVar[tuple[str, ...]] = ()  # published quantized formats `make-model --quant` writes
    refused: ClassVar[str | None] = None  # why the family cannot work, in one line (None: it works)

    @classmethod
    def reason(cls) -> str | None:
        """Why the family cannot work (None: it works)."""
        if cls.refused is None and catalog.generating_class(cls.model_type) is None and cls.uses_experts_registry:
            return "transformers has no text-generating model class for it"
        return cls.refused

    def __init__(self):
        self._derived: tuple[object, Layout] | None = None  # (config, its layout), derived once

    def layout(self, config) -> Layout:
        if self._derived is None or self._derived[0] is not config:
            self._derived = (config, self._derive(config))
        return self._derived[1]

    def _derive(self, config) -> Layout:
        from moestream.families import derive  # torch: imported when a layout is first derived

        model = derive.meta_model(config, self.auto_class)
        modules = derive.experts_of_text(model)
        if not modules:
            raise CheckpointError(f"a {self.model_type} model of this config has no MoE layer")
        blocks, parts = [], None
        for index, (path, module) in enumerate(modules):
            disk = [derive.disk_part(model, path, name) for name, _ in module.named_parameters(recurse=False)]
            prefix = derive.block_prefix([name for part in disk for name in part.names], path)
            found = tuple(ExpertPart(p.param, derive.relative(p.names, prefix), p.fused, p.transposed,
                                     tuple(getattr(module, p.param).shape[1:])) for p in disk)
            if parts is not None and found != parts:
                raise CheckpointError(f"{self.model_type}: the experts of {path} are stored unlike the first "
                                      f"block's ({found} against {parts})")
            parts = found
            blocks.append(MoEBlock(index, derive.layer_number(path), prefix, path))
        first = modules[0][1]
        num_experts = int(next(first.parameters()).shape[0])
        block = model.get_submodule(modules[0][0].rpartition(".")[0])
        return Layout(tuple(blocks), parts, num_experts, self._shared(config, block))

    def _shared(self, config, block) -> int:
        if all(getattr(block, name, None) is None for name in SHARED_NAMES):
            return 0
        text = config.get_text_config()
        declared = next((getattr(text, f) for f in SHARED_FIELDS if getattr(text, f, None)), None)
        return int(declared) if declared else 1

    def init_values(self, name: str, shape: tuple[int, ...], dtype):
        """A test model's values for a tensor transformers sets on load whatever the checkpoint holds (None: random)."""
        return None

    def expert_parts(self, config) -> tuple[ExpertPart, ...]:
        return self.layout(config).parts

    def expert_tensor(self, experts_module, expert: int, param: str):
        """The in-memory tensor of `param` for one expert (what a slot view of `param` must equal)."""
        return getattr(experts_module, param)[expert]

    def num_experts(self, config) -> int:
        return self.layout(config).num_experts

    def top_k(self, config) -> int:
        if self.fixed_top_k is not None:
            return self.fixed_top_k
        text = config.get_text_config()
        for field in TOP_K_FIELDS:
            if isinstance(getattr(text, field, None), int):
                return int(getattr(text, field))
        raise CheckpointError(f"the {self.model_type} config declares no top-k ({', '.join(TOP_K_FIELDS)})")

    def num_shared_experts(self, config) -> int:
        return self.layout(config).num_shared_experts

    def moe_layer_ids(self, config) -> list[int]:
        return [block.layer_id for block in self.blocks(config)]

    def blocks(self, config) -> list[MoEBlock]:
        return list(self.layout(config).blocks)

    def topology(self, config, expert_bytes: int) -> Topology:
        return Topology(moe_layer_ids=tuple(self.moe_layer_ids(config)), num_experts=self.num_experts(config),
                        top_k=self.top_k(config), expert_bytes=expert_bytes,
                        num_shared_experts=self.num_shared_experts(config))

    def tiny_config_kwargs(self, sizes: tiny.Sizes) -> dict:
        """Config fields of a small model for `moestream make-model`: the family's defaults shrunk."""
        return tiny.shrink(self.model_type, sizes, self.tiny_fields)


FAMILIES: Registry[FamilyAdapter] = Registry("model family")
