"""`moestream families`: every model type transformers declares MoE experts for, with how its experts
lie on disk, one expert's bytes at the published shape, and the quantized formats it loads; the model
types moestream cannot run, each with its reason."""

from __future__ import annotations


def add_parser(commands) -> None:
    parser = commands.add_parser("families", help="list the model types moestream loads (and those it cannot, "
                                                  "with why)")
    parser.set_defaults(handler=run)


def table(rows) -> list[str]:
    """The listing's lines: supported model types, then the others with their reasons."""
    supported = [r for r in rows if r.reason is None]
    width = max(len(r.model_type) for r in rows)
    lines = [f"{len(supported)} model types load (transformers' MoE families); expert bytes at the published "
             "shape, bf16:"]
    for r in supported:
        size = "?" if r.expert_bytes is None else f"{r.expert_bytes / 2**20:.1f} MiB"
        formats = ", ".join(r.loads) or "none"
        published = f"; releases: {', '.join(r.published)}" if r.published else ""
        lines.append(f"  {r.model_type:<{width}}  {size:>11}  {r.layout or '?'}  "
                     f"[quantized: {formats}{published}]")
    refused = [r for r in rows if r.reason is not None]
    if refused:
        lines.append(f"{len(refused)} cannot run:")
        lines += [f"  {r.model_type:<{width}}  {r.reason}" for r in refused]
    return lines


def run(args) -> int:
    import transformers

    from moestream.families.listing import rows

    transformers.logging.set_verbosity_error()  # configs fixed up at published shapes say so: not news here
    print("\n".join(table(rows())))
    return 0
