"""Quantized test checkpoints and their reference: a GPTQ-layout copy of a dense checkpoint (round to
nearest, asymmetric, written here from GPTQ's documented layout), and the transformers model of the
dense checkpoint with every routed expert replaced by the reference dequantization of a quantized copy."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from moestream.checkpoint.index import build_index
from moestream.families import FAMILIES
from moestream.families.derive import DenseConversion
from moestream.runtime import Engine, EngineConfig
from tests.quant import reference
from tests.quant.test_compressed_tensors import packing_pack
from tests.runtime.conftest import PROMPTS

GPTQ_GROUP = 32


def read_all(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, framework="pt") as handle:
            tensors |= {name: handle.get_tensor(name) for name in handle.keys()}
    return tensors


def expert_linears(config: dict) -> list[str]:
    """Disk names (without ".weight") of every routed expert linear of a per-expert family."""
    adapter = FAMILIES.create(config["model_type"])
    model_config = transformers.AutoConfig.for_model(**config)
    return [f"{b.disk_prefix}.{t.format(expert=e)}"[: -len(".weight")] for b in adapter.blocks(model_config)
            for e in range(adapter.num_experts(model_config))
            for p in adapter.expert_parts(model_config) for t in p.disk]


def gptq_tensors(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Round-to-nearest asymmetric 4-bit GPTQ tensors of one [O, I] weight."""
    rows, cols = weight.shape
    w = weight.float().T.reshape(cols // GPTQ_GROUP, GPTQ_GROUP, rows)  # [g, G, O]
    low, high = w.amin(1), w.amax(1)  # [g, O]
    scale = ((high - low) / 15).clamp(min=1e-8).half()
    zero = (-low / scale.float()).round().clamp(0, 15)
    q = (w / scale.float().unsqueeze(1) + zero.unsqueeze(1)).round().clamp(0, 15).reshape(cols, rows)
    return {"qweight": packing_pack(q.int(), 4, 0), "qzeros": packing_pack((zero.int() - 1) & 15, 4, 1),
            "scales": scale, "g_idx": torch.arange(cols, dtype=torch.int32) // GPTQ_GROUP}


def attention_linears(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Stems of the attention projections (q_proj, o_proj): dense tensors a GPTQ checkpoint also quantizes."""
    return [name[: -len(".weight")] for name in tensors if name.endswith(("self_attn.q_proj.weight",
                                                                           "self_attn.o_proj.weight"))]


def write_gptq(source: Path, out: Path, attention: bool = False) -> Path:
    """A GPTQ copy of `source` (experts, and with `attention` q_proj/o_proj, quantized; the rest as it is)
    in one shard, no manifest."""
    out.mkdir(parents=True)
    config = json.loads((source / "config.json").read_text())
    tensors = read_all(source)
    for stem in expert_linears(config) + (attention_linears(tensors) if attention else []):
        tensors |= {f"{stem}.{k}": v.contiguous() for k, v in gptq_tensors(tensors.pop(f"{stem}.weight")).items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    quant = {"quant_method": "gptq", "bits": 4, "group_size": GPTQ_GROUP, "desc_act": False, "sym": False,
             "checkpoint_format": "gptq"}
    (out / "config.json").write_text(json.dumps(config | {"quantization_config": quant}))
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, out / name)
    return out


def dequantized(quantized: Path, stem: str, dtype: torch.dtype, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The reference dequantization of one expert linear of a quantized checkpoint."""
    method = json.loads((quantized / "config.json").read_text())["quantization_config"]
    if method["quant_method"] == "gptq":
        return reference.gptq(*(tensors[f"{stem}.{k}"] for k in ("qweight", "qzeros", "scales", "g_idx")), 4, dtype)
    bits = method["config_groups"]["group_0"]["weights"]["num_bits"]
    packed = method["format"] == "pack-quantized"
    q = tensors[f"{stem}.weight_packed" if packed else f"{stem}.weight"]
    return reference.compressed_tensors(q, tensors[f"{stem}.weight_scale"], tensors.get(f"{stem}.weight_zero_point"),
                                        bits, packed, dtype)


def reference_model(source: Path, quantized: Path) -> torch.nn.Module:
    """transformers' model of the dense checkpoint, every routed expert set to its reference dequantization."""
    config = json.loads((source / "config.json").read_text())
    adapter = FAMILIES.create(config["model_type"])
    model = getattr(transformers, adapter.auto_class).from_pretrained(source).eval()
    tensors = read_all(quantized)
    dtype = next(model.parameters()).dtype
    conversion = DenseConversion(model)
    with torch.no_grad():
        for name in tensors:
            if name.endswith(".qweight") and ".experts." not in name:  # a quantized dense linear
                stem = name[: -len(".qweight")]
                key, _ = conversion.rename(f"{stem}.weight")
                model.get_parameter(key).copy_(dequantized(quantized, stem, dtype, tensors))
    for block in adapter.blocks(model.config):
        module = model.get_submodule(block.experts_path)
        for expert in range(adapter.num_experts(model.config)):
            for part in adapter.expert_parts(model.config):
                stems = [f"{block.disk_prefix}.{t.format(expert=expert)}"[: -len(".weight")] for t in part.disk]
                weight = torch.cat([dequantized(quantized, s, dtype, tensors) for s in stems])
                with torch.no_grad():
                    adapter.expert_tensor(module, expert, part.param).copy_(weight)
    return model


def generate_tokens(path, budget: str, sync: bool, new_tokens: int):
    """(prompt ids, result, pad id) of greedy generation from the checkpoint at path, its expert budget the
    smallest that computes a layer ("min") or a ratio."""
    if budget == "min":
        topology = build_index(path).topology
        budget = f"{topology.top_k * topology.expert_bytes}B"
    with Engine(path, EngineConfig(expert_budget=budget, direct_io=False, sync=sync)) as engine:
        prompts = [engine.encode(p) for p in PROMPTS]
        return prompts, engine.generate(prompts, max_new_tokens=new_tokens), engine.pad_id
