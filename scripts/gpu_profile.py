"""Where an all-resident decode step waits, for scripts/gpu-check.sh: the device-to-host reads the engine
counts (`Engine.reads`, one per MoE layer and one per step), the host's synchronisations and device-to-host
copies torch.profiler sees per decode step, the top Python functions of the steps (cProfile), and the
pinned host -> device bandwidth of one expert. Prints one line per figure (and --json writes them).

    python scripts/gpu_profile.py --model DIR [--device cuda] [--steps 32] [--warmup 3] [--replay-routing TRACE]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

from moestream.runtime import Engine, EngineConfig

PROMPT = "Mixture-of-experts models route every token to"
SYNCS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=32, help="decode steps profiled")
    parser.add_argument("--warmup", type=int, default=3, help="decode steps run first, not profiled")
    parser.add_argument("--replay-routing", help="a trace whose routing the engine follows")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    config = EngineConfig(device=args.device, expert_budget="1.0", replay_routing=args.replay_routing)
    figures = {"device": args.device, "steps": args.steps}
    with Engine(args.model, config) as engine:
        layers = engine.checkpoint.topology.num_layers
        figures |= {"moe_layers": layers, "h2d_gbps_one_expert": h2d_gbps(engine)}
        engine.generate([PROMPT], max_new_tokens=args.warmup + 1)
        figures |= profile_steps(engine, args.steps)
    for name, value in figures.items():
        print(f"{name}: {value:.3f}" if isinstance(value, float) else f"{name}: {value}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


def profile_steps(engine: Engine, steps: int) -> dict:
    """Per decode step: the engine's counted reads, the profiler's host syncs and D2H copies, and the top
    functions (the prefill is profiled too and counted apart)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if engine.config.device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    before, python = engine.reads.count, cProfile.Profile()
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        python.enable()
        result = engine.generate([PROMPT], max_new_tokens=steps + 1)
        python.disable()
    seconds = time.perf_counter() - start
    passes = steps + 1  # the prefill and the decode steps
    names = [event.name for event in prof.events()]
    syncs = sum(name in SYNCS for name in names)
    d2h = sum("DtoH" in name or "Device -> Pageable" in name or "Device -> Pinned" in name for name in names)
    top = io.StringIO()
    pstats.Stats(python, stream=top).sort_stats("tottime").print_stats(15)
    print(top.getvalue(), file=sys.stderr)
    return {"counted_reads_per_pass": (engine.reads.count - before) / passes,
            "profiler_syncs_per_pass": syncs / passes, "profiler_d2h_copies_per_pass": d2h / passes,
            "tpot_ms": result.metrics.tpot_ms, "wall_ms_per_pass": seconds * 1e3 / passes}


def h2d_gbps(engine: Engine) -> float:
    """One expert's bytes copied from pinned host memory to the device, best of 5 (GB/s; a memcpy on the CPU)."""
    nbytes = engine.checkpoint.topology.expert_bytes
    cuda = engine.config.device.startswith("cuda")
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=engine.config.device)
    best = float("inf")
    for _ in range(6):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


if __name__ == "__main__":
    sys.exit(main())
