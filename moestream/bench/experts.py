"""`moestream bench experts`: a routed expert MLP's effective bandwidth against the machine's read bandwidth.

Read bandwidth: a large float32 tensor summed on one torch thread (best of the repeats). Expert MLP:
DeepSeek-V2-style gated experts at the demo, half and full shapes; one MoE layer's top_k experts run
through each LAYER_KERNELS path in alternation, on slots of a pool larger than the last-level cache, so
weights come from memory as at decode. Effective bandwidth: an expert's bytes over its share of the median
call. Process CPU time by default (--clock wall: elapsed). --native-gemv: single-row cases without oneDNN, as the
engine's `native_gemv` decode steps. Prints a table (and --json); asserts nothing.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from moestream.bench import comma_list, write_figures
from moestream.config import EngineConfig
from moestream.settings import add_arguments
from moestream.threads import torch_threads

READ_MIB = 256  # the reduced tensor: well past the last-level cache
POOL_MIB = 320  # slots the calls rotate through
TOP_K = 6  # experts per layer call (DeepSeek-V2-Lite's top-k)
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
SHAPES = {"demo": (256, 448), "half": (1024, 1408), "full": (2048, 1408)}  # name -> (hidden, expert width)
DTYPES = ("bf16", "fp32")
OLD, NEW = "per-expert", "stream"  # the former path, the CPU default
KERNELS = (OLD, NEW, "grouped")  # grouped: torch's grouped GEMM over the evenly spaced slots of the pool


def add_parser(kinds) -> None:
    parser = kinds.add_parser("experts", help="routed expert MLP bandwidth against the machine's read bandwidth")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help=f"of {', '.join(DTYPES)}")
    parser.add_argument("--tokens", default="1,4", help="rows per expert, comma-separated")
    parser.add_argument("--repeats", type=int, default=15, help="layer calls timed per path and case")
    parser.add_argument("--pool-mib", type=int, default=POOL_MIB, help="slots the calls rotate through, in MiB "
                        "(keep it past the last-level cache)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu", help="cpu: the process's CPU time (what "
                        "other processes on a shared machine take is not counted); wall: elapsed time")
    add_arguments(parser, EngineConfig, only=("native_gemv",))  # single-row cases as the engine's one-row steps
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.set_defaults(handler=run)


def run(args) -> int:
    figures = measure(_cases(args), args.repeats, args.pool_mib, args.clock, args.native_gemv)
    print(table(figures))
    write_figures(figures, args.json)
    return 0


def _cases(args) -> list[tuple[str, str, int]]:
    """(shape, dtype, tokens) of every case; MoestreamError naming the flag on bad input."""
    from moestream.checks import at_least

    shapes = comma_list(args.shapes, "--shapes", known=SHAPES)
    dtypes = comma_list(args.dtypes, "--dtypes", known=DTYPES)
    tokens = comma_list(args.tokens, "--tokens", int)
    at_least(1, {"--tokens": min(tokens), "--repeats": args.repeats, "--pool-mib": args.pool_mib})
    return [(shape, dtype, n) for shape in shapes for dtype in dtypes for n in tokens]


def measure(cases: list[tuple[str, str, int]], repeats: int, pool_mib: int = POOL_MIB, clock: str = "cpu",
            native_gemv: bool = False) -> dict:
    """The read bandwidth and every case's figures, on one torch thread, timed by `clock` (a CLOCKS name)."""
    from moestream.runtime.onednn import native_single_row

    rows = []
    with torch_threads(1):
        read = read_bandwidth(repeats, CLOCKS[clock])
        for shape, dtype, tokens in cases:
            with native_single_row(native_gemv, tokens, "cpu"):
                rows.append(case_figures(shape, dtype, tokens, repeats, pool_mib, CLOCKS[clock]))
    for row in rows:
        row["read_fraction"] = {k: bw / read for k, bw in row["bytes_per_s"].items()}
    return {"threads": 1, "clock": clock, "native_gemv": native_gemv, "read_bytes_per_s": read, "top_k": TOP_K,
            "cases": rows}


def read_bandwidth(repeats: int, clock=time.process_time) -> float:
    """Bytes per second of summing a large float32 tensor, the best of the repeats."""
    import torch

    x = torch.ones(READ_MIB * 2**20 // 4)  # [N] float32
    x.sum()
    best = min(_seconds(x.sum, clock) for _ in range(max(repeats, 3)))
    return x.nbytes / best


def _seconds(fn, clock=time.process_time) -> float:
    began = clock()
    fn()
    return clock() - began


class ExpertPool:
    """Preallocated slots of one expert each (gate_up_proj [2I, H] then down_proj [H, I]), filled with
    small random weights; `take` hands out the next slots' typed views, round robin."""

    def __init__(self, hidden: int, width: int, dtype, pool_mib: int = POOL_MIB):
        import torch

        self.shape = (hidden, width)
        self.expert_bytes = 3 * hidden * width * dtype.itemsize
        stride = -(-self.expert_bytes // 4096) * 4096  # every slot starts page-aligned
        count = max(2 * TOP_K, pool_mib * 2**20 // stride)
        self.data = torch.empty(count, stride, dtype=torch.uint8)  # [slots, stride]
        self.data.view(dtype).uniform_(-0.05, 0.05)
        self.dtype = dtype
        self.next = 0

    def take(self, count: int) -> list[dict]:
        picked = [(self.next + i) % self.data.shape[0] for i in range(count)]
        self.next = (picked[-1] + 1) % self.data.shape[0]
        return [self.views(i) for i in picked]

    def views(self, i: int) -> dict:
        hidden, width = self.shape
        slot = self.data[i, : self.expert_bytes].view(self.dtype)  # [3 * H * I]
        return {"gate_up_proj": slot[: 2 * width * hidden].view(2 * width, hidden),
                "down_proj": slot[2 * width * hidden:].view(hidden, width)}


def expert_math(hidden: int, width: int):
    """A DeepSeek-V2 experts module's math (SiLU-gated), the module built without weights."""
    import torch
    from transformers import AutoConfig
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Experts

    from moestream.runtime.expert_math import FusedExpertMath

    config = AutoConfig.for_model("deepseek_v2", hidden_size=hidden, moe_intermediate_size=width, n_routed_experts=1)
    with torch.device("meta"):
        return FusedExpertMath(DeepseekV2Experts(config))


def layer_rows(math, hidden: int, tokens: int, dtype):
    """`tokens` tokens each routed to the same TOP_K experts: expert j's rows are [j * tokens, (j + 1) * tokens)."""
    import torch

    from moestream.runtime.layer_experts import LayerRows

    generator = torch.Generator().manual_seed(0)
    states = torch.randn(tokens, hidden, generator=generator).to(dtype)  # [T, H]
    weights = torch.rand(tokens, TOP_K, generator=generator).to(dtype)  # [T, K]
    order = torch.tensor([t * TOP_K + j for j in range(TOP_K) for t in range(tokens)])  # [R] sorted by expert
    return LayerRows(math, states[order // TOP_K], weights.reshape(-1)[order, None], order, tokens * TOP_K, dtype)


def layer_call(kernel: str, rows, experts: list[dict], tokens: int):
    """One MoE layer's routed experts through a LAYER_KERNELS kernel -> [S, H]."""
    from moestream.runtime.layer_experts import LAYER_KERNELS

    layer = LAYER_KERNELS.create(kernel, rows)
    for j, weights in enumerate(experts):
        layer.add(weights, j * tokens, (j + 1) * tokens)
    layer.flush()
    return layer.result()


def case_figures(shape: str, dtype_name: str, tokens: int, repeats: int, pool_mib: int = POOL_MIB,
                 clock=time.process_time) -> dict:
    """Median seconds and effective bandwidth per expert of each kernel, in alternation, for one case."""
    import torch

    hidden, width = SHAPES[shape]
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    pool = ExpertPool(hidden, width, dtype, pool_mib)
    rows = layer_rows(expert_math(hidden, width), hidden, tokens, dtype)
    times: dict[str, list[float]] = {kernel: [] for kernel in KERNELS}
    for _ in range(repeats + 1):  # the first round warms up
        for kernel in KERNELS:
            experts = pool.take(TOP_K)
            times[kernel].append(_seconds(lambda: layer_call(kernel, rows, experts, tokens), clock))
    per_expert = {kernel: statistics.median(t[1:]) / TOP_K for kernel, t in times.items()}
    return {"shape": shape, "hidden": hidden, "width": width, "dtype": dtype_name, "tokens": tokens,
            "expert_bytes": pool.expert_bytes, "seconds_per_expert": per_expert,
            "bytes_per_s": {kernel: pool.expert_bytes / s for kernel, s in per_expert.items()}}


def table(figures: dict) -> str:
    """The figures as a text table, one line per case: per kernel, ms per expert, GB/s and the share of
    the read bandwidth; then the new path's speedup over the old."""
    kernels = list(figures["cases"][0]["seconds_per_expert"]) if figures["cases"] else list(KERNELS)
    head = " | ".join(f"{kernel + ' ms':>14} {'GB/s':>6} {'read':>5}" for kernel in kernels)
    lines = [f"read bandwidth: {figures['read_bytes_per_s'] / 1e9:.1f} GB/s (sum of a {READ_MIB} MiB float32 "
             f"tensor, {figures['threads']} thread); a layer call = {figures['top_k']} experts x tokens rows; "
             f"times: {figures['clock']} clock, median",
             f"{'shape':<6} {'H':>5} {'I':>5} {'dtype':<5} {'tokens':>6} {'MB':>6} | {head} | {NEW} vs {OLD}"]
    for case in figures["cases"]:
        s, bw, frac = case["seconds_per_expert"], case["bytes_per_s"], case["read_fraction"]
        cells = " | ".join(f"{s[k] * 1e3:>14.3f} {bw[k] / 1e9:>6.2f} {frac[k]:>5.0%}" for k in kernels)
        lines.append(f"{case['shape']:<6} {case['hidden']:>5} {case['width']:>5} {case['dtype']:<5} "
                     f"{case['tokens']:>6} {case['expert_bytes'] / 1e6:>6.2f} | {cells} | {s[OLD] / s[NEW]:>6.2f}x")
    return "\n".join(lines)
