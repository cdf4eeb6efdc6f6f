"""`moestream quantize --model DIR --format int8|int4 [--group-size G] [--layout L] --out DIR2`: a copy whose
routed experts are quantized (compressed-tensors layouts, or GPTQ's; the dense part as it is), written
atomically with its manifest, then its error against the source on the demo's prompts."""

from __future__ import annotations

import math
from pathlib import Path

from moestream.budget import format_bytes
from moestream.checks import at_least, require_checkpoint_dir
from moestream.errors import MoestreamError
from moestream.progress import progress_bar

BITS = {"int4": 4, "int8": 8}
INT4_GROUP = 128  # inputs per scale of int4 experts by default (fewer where the width is not a multiple)


def add_parser(commands) -> None:
    parser = commands.add_parser("quantize", help="write a copy of a checkpoint with int8 or int4 routed experts")
    parser.add_argument("--model", required=True, type=Path, help="checkpoint directory to quantize")
    parser.add_argument("--format", required=True, choices=sorted(BITS), help="bits per expert weight")
    parser.add_argument("--group-size", type=int, help=f"inputs per scale (default: int4 {INT4_GROUP} or the largest "
                                                       "power of two dividing the experts' widths, int8 one per row)")
    parser.add_argument("--layout", default="compressed-tensors", choices=("compressed-tensors", "gptq"),
                        help="how the integers are packed: compressed-tensors (default) or gptq, packed along the "
                             "inputs, which --quant-kernel packed-cpu computes from")
    parser.add_argument("--out", required=True, type=Path, help="output directory (must be absent or empty)")
    parser.add_argument("--workers", type=int, default=2, help="threads quantizing tensors")
    parser.add_argument("--no-error", action="store_true",
                        help="skip measuring the error against the source (which loads the whole model in memory)")
    parser.add_argument("--error-tokens", type=int, default=16, help="tokens generated per prompt to measure the error")
    parser.set_defaults(handler=run)


def _scheme(args, checkpoint):
    from moestream.checkpoint.quantize import expert_weights
    from moestream.quant.encode import IntScheme

    bits = BITS[args.format]
    at_least(1, {"--group-size": args.group_size})
    scheme = IntScheme(bits, args.group_size, args.layout)
    if args.group_size is None and bits < 8:
        widths = {checkpoint.tensors[name].shape[-1] for name in expert_weights(checkpoint, IntScheme(bits, None))}
        scheme = IntScheme(bits, math.gcd(INT4_GROUP, *widths), args.layout)
    expert_weights(checkpoint, scheme)  # every input error before the progress bar
    return scheme


def run(args) -> int:
    require_checkpoint_dir(args.model)
    if args.workers < 1 or args.error_tokens < 1:
        raise MoestreamError("--workers and --error-tokens must be >= 1")
    from moestream.checkpoint.index import build_index
    from moestream.checkpoint.quantize import check_out, quantize_checkpoint

    check_out(args.out)
    source = build_index(args.model)
    scheme = _scheme(args, source)
    with progress_bar(desc=f"quantize {args.format}", unit="B", unit_scale=True) as bar:
        quantize_checkpoint(args.model, args.out, scheme, args.workers, bar.update)
    dense, packed = source.topology.expert_bytes, build_index(args.out).topology.expert_bytes
    group = f"group {scheme.group_size}" if scheme.group_size else "one scale per row"
    print(f"wrote {args.out}: {args.format} experts ({group}), {format_bytes(packed)} per expert, "
          f"{dense / packed:.2f}x fewer bytes than {format_bytes(dense)}")
    if not args.no_error:
        from moestream.checkpoint.demo import PROMPTS
        from moestream.eval.quant_error import measure_error

        error = measure_error(args.model, args.out, PROMPTS, args.error_tokens)
        print(f"error against {args.model} over {len(PROMPTS)} prompts, {error.positions} next-token distributions: "
              f"top-1 agreement {100 * error.top1_agreement:.1f}%, mean KL {error.mean_kl:.3g} nats, "
              f"max abs logit error {error.max_abs_logit_error:.4f}")
    return 0
