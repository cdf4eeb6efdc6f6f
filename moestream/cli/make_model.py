"""`moestream make-model FAMILY --out DIR`: write a random test checkpoint in the family's real format."""

from __future__ import annotations

from moestream.checkpoint.spec import ModelSpec
from moestream.families import FAMILIES


HELP = {
    "num-layers": "decoder layers (each of encoder and decoder for switch_transformers)",
    "num-experts": "routed experts per MoE layer",
    "top-k": "experts per token (default: the family's fixed value, else 2)",
    "hidden-size": "model width, a multiple of 16",
    "intermediate-size": "width of one routed expert",
    "vocab-size": "tokenizer and embedding size",
    "seed": "random init seed",
    "max-shard-bytes": "split weights into safetensors shards of about this size (default: one file); transformers "
                       "keeps each of its tensors whole, and a layer's experts are one tensor in memory, so a shard "
                       "holds at least one layer's experts",
}


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "make-model", help="write a randomly initialised MoE checkpoint (safetensors + tokenizer)"
    )
    parser.add_argument("family", help=f"transformers model_type: {', '.join(FAMILIES.names())}")
    parser.add_argument("--out", required=True, help="output directory (must be absent or empty)")
    defaults = ModelSpec.__dataclass_fields__
    for flag, text in HELP.items():
        default = defaults[flag.replace("-", "_")].default
        shown = "" if default is None else f" (default: {default})"
        parser.add_argument(f"--{flag}", type=int, default=default, help=text + shown)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default=defaults["dtype"].default,
                        help="the weights' type on disk")
    parser.set_defaults(handler=run)


def run(args) -> int:
    spec = ModelSpec(
        family=args.family,
        num_layers=args.num_layers,
        num_experts=args.num_experts,
        top_k=args.top_k,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        vocab_size=args.vocab_size,
        seed=args.seed,
        dtype=args.dtype,
        max_shard_bytes=args.max_shard_bytes,
    )
    from moestream.checkpoint.index import build_index  # heavy (torch, transformers): only when run
    from moestream.checkpoint.make_model import make_model

    out = make_model(spec, args.out, progress=True)
    topology = build_index(out).topology
    print(
        f"wrote {spec.family} checkpoint to {out}: {topology.num_layers} MoE layers x {topology.num_experts} experts "
        f"(top-{topology.top_k}), {topology.expert_bytes} bytes per expert, "
        f"{topology.total_expert_bytes / 2**20:.1f} MiB of routed experts"
    )
    return 0
