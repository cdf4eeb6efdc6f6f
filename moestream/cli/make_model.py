"""`moestream make-model [FAMILY] --out DIR`: write a random test checkpoint in the family's real format,
or one of a real model's shape (`--preset deepseek-v2-lite`, `--width-scale 0.5`), optionally in a
published quantized format (`--quant mxfp4|fp8|w4a16`)."""

from __future__ import annotations

from dataclasses import replace

from moestream.checkpoint.spec import PRESETS, QUANT_WIDTH_MULTIPLE, ModelSpec, quant_families
from moestream.checks import at_least
from moestream.errors import CheckpointError

HELP = {
    "num-layers": "decoder layers (each of encoder and decoder for switch_transformers)",
    "num-experts": "routed experts per MoE layer",
    "top-k": "experts per token (default: the family's fixed value, else 2)",
    "hidden-size": "model width, a multiple of 16",
    "intermediate-size": "width of one routed expert",
    "vocab-size": "tokenizer and embedding size",
    "seed": "random init seed",
    "max-shard-bytes": "split weights into safetensors shards of about this size (default: one file); a tensor "
                       "is never split",
}


def add_parser(commands) -> None:
    parser = commands.add_parser("make-model", help="write a randomly initialised MoE checkpoint (safetensors + "
                                                    "tokenizer + manifest)")
    parser.add_argument("family", nargs="?", help="transformers model_type (`moestream families` lists them; "
                                                  "or --preset)")
    parser.add_argument("--out", required=True, help="output directory (must be absent or empty)")
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="a real model's full shape (deepseek-v2-lite: 31 GB); flags below override its fields")
    parser.add_argument("--width-scale", type=float, metavar="F",
                        help="scale the hidden width (and attention widths) by F; experts keep their width "
                             "(0.5 on deepseek-v2-lite: 8.65 MB experts, 14.4 GB of them)")
    parser.add_argument("--workers", type=int, help="threads filling tensors (default: this machine's CPUs, "
                                                    "at most 16)")
    defaults = ModelSpec.__dataclass_fields__
    for flag, text in HELP.items():
        default = defaults[flag.replace("-", "_")].default
        shown = "" if default is None else f" (default: {default})"
        parser.add_argument(f"--{flag}", type=int, help=text + shown)
    parser.add_argument("--dtype", choices=("bf16", "fp32"),
                        help=f"the weights' type on disk (default: {defaults['dtype'].default})")
    parser.add_argument("--quant", choices=sorted(QUANT_WIDTH_MULTIPLE),
                        help="write the experts (and what else the format's published checkpoints quantize) in a "
                             "quantized format: " + "; ".join(f"{name} for {', '.join(families)}"
                                                              for name, families in quant_families().items()))
    parser.set_defaults(handler=run)


def spec_from_args(args) -> ModelSpec:
    """The preset (or the family's defaults), the flags given over it, then the width scale."""
    from moestream.checkpoint.spec import preset_spec, width_scaled

    if args.preset is None and args.family is None:
        raise CheckpointError("make-model needs a FAMILY or --preset")
    base = preset_spec(args.preset) if args.preset else ModelSpec(family=args.family)
    if args.family is not None and args.family != base.family:
        raise CheckpointError(f"--preset {args.preset} is a {base.family} model, not {args.family}")
    given = {flag.replace("-", "_"): getattr(args, flag.replace("-", "_")) for flag in (*HELP, "dtype", "quant")}
    spec = replace(base, **{name: value for name, value in given.items() if value is not None})
    return spec if args.width_scale is None else width_scaled(spec, args.width_scale)


def run(args) -> int:
    at_least(1, {"--workers": args.workers})
    spec = spec_from_args(args)
    from moestream.checkpoint.index import build_index  # heavy (torch, transformers): only when run
    from moestream.checkpoint.make_model import make_model

    out = make_model(spec, args.out, progress=True, workers=args.workers)
    topology = build_index(out).topology
    quantized = "" if spec.quant is None else f"{spec.quant} "
    print(f"wrote {quantized}{spec.family} checkpoint to {out}: {topology.num_layers} MoE layers x "
          f"{topology.num_experts} experts (top-{topology.top_k}), {topology.expert_bytes} bytes per expert, "
          f"{topology.total_expert_bytes / 2**20:.1f} MiB of routed experts, with its integrity manifest")
    return 0
