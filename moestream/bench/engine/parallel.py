"""`moestream bench engine --expert-parallel N`: the engine on N ranks against one process.

Per budget B, three fresh cold runs of `moestream generate` over the demo prompts: one process at B, one
at B / N, and N torchrun ranks each holding B of its own experts. Figures: TPOT, and per rank the hit
rate, disk bytes and combine seconds per generated token. Where memory cgroups allow (isolation.py),
each process runs capped: floor + dense + B + slack (or --memory-cap MiB), each rank less the
(N - 1) / N of B it does not hold (rank_cgroup.py); each cgroup's peak is reported. Knows no engine
internals: it reads generate's --json.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from moestream.errors import MoestreamError
from moestream.parallel.ranks import free_port

MIB = 2**20
GENERATE_SLACK_MIB = 192  # the memory cap: floor + dense part + budget + this (generate's tokenizer, buffers, KV)


def measure_parallel(args, say) -> dict:
    """The runs' figures; say(line) tells, at once, why the runs go uncapped where they must."""
    from moestream.bench import comma_list, model_dir
    from moestream.checkpoint.demo import PROMPTS

    model = model_dir(args)
    budgets = comma_list(args.budgets, "--budgets", float)
    caps = memory_caps(args, Path(model))
    if not caps["applied"]:
        say(f"bench engine --expert-parallel: runs uncapped: {caps['reason']}")
    with tempfile.TemporaryDirectory() as scratch:
        prompts = Path(scratch) / "prompts.txt"
        prompts.write_text("\n".join(PROMPTS[: args.prompts]) + "\n")
        rows = []
        for budget in budgets:
            for label, ranks, run_budget in _runs(budget, args.expert_parallel):
                cap = run_cap_mib(caps, budget, run_budget / ranks)  # each process's share of the experts
                record = _generate(args, model, prompts, ranks, run_budget, Path(scratch) / "out.json", cap)
                rows.append({"budget": budget, "run": label, "ranks": ranks, "run_budget": run_budget,
                             "memory_cap_mib": cap} | record)
    return {"model": str(model), "world_size": args.expert_parallel, "placement": args.expert_parallel_placement,
            "replay_routing": args.replay_routing, "memory_cap": caps, "rows": rows}


def memory_caps(args, model: Path) -> dict:
    """Whether runs are capped (and why not), and what the caps are made of (MiB)."""
    from moestream.bench.engine.isolation import cap_method, cap_support
    from moestream.bench.engine.spec import dense_bytes
    from moestream.checkpoint.index import build_index

    reason = cap_support()
    if reason is not None:
        return {"applied": False, "reason": reason}
    topology = build_index(model).topology
    requested = args.memory_cap or "auto"
    return {"applied": True, "reason": cap_method(), "requested": requested,
            "experts_mib": topology.total_expert_bytes / MIB,
            "floor_mib": process_floor_mib(model) if requested == "auto" else None, "dense_mib": dense_bytes(model, topology) / MIB}


def run_cap_mib(caps: dict, budget: float, share: float) -> float | None:
    """The cap of a process holding share of the experts (one of N ranks at budget: budget / N): the one
    process's cap at budget less the expert bytes it does not hold."""
    if not caps["applied"]:
        return None
    full = (caps["floor_mib"] + caps["dense_mib"] + budget * caps["experts_mib"] + GENERATE_SLACK_MIB
            if caps["requested"] == "auto" else float(caps["requested"]))
    return full - (budget - share) * caps["experts_mib"]


def process_floor_mib(model: Path) -> float:
    """Peak RSS of a process that has imported what `moestream generate` imports, before it loads anything."""
    code = ("import sys; from pathlib import Path; import moestream.cli.generate; "
            "from moestream.bench.engine.child import import_model_code; "
            "from moestream.bench.engine.spec import peak_rss_mib; "
            "import_model_code(Path(sys.argv[1])); print(peak_rss_mib())")
    done = subprocess.run([sys.executable, "-c", code, str(model)], capture_output=True, text=True, check=True)
    return float(done.stdout.split()[-1])


def _runs(budget: float, world_size: int) -> list[tuple[str, int, float]]:
    return [(f"1 process at {budget:g}", 1, budget), (f"1 process at {budget / world_size:g}", 1, budget / world_size),
            (f"{world_size} ranks at {budget:g} in all", world_size, budget)]


def _command(args, model: Path, prompts: Path, ranks: int, budget: float, out: Path,
             cgroups: str | None = None) -> list[str]:
    """The run's command line (cgroups: the prefix of its processes' memory cgroups, isolation.rank_cgroups)."""
    moestream = ["-m", "moestream"]
    if cgroups is not None:
        moestream = ["-m", "moestream.bench.engine.rank_cgroup", cgroups, sys.executable, *moestream]
    launcher = [sys.executable, *moestream]
    if ranks > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                    "--master-port", str(free_port()), *moestream]
    command = launcher + ["generate", "--model", str(model), "--prompts-file", str(prompts), "--max-new-tokens",
                          str(args.max_new_tokens), "--expert-budget", f"{budget:g}", "--device", args.device,
                          "--json", str(out), "--expert-parallel-placement", args.expert_parallel_placement]
    for flag, value in (("--replay-routing", args.replay_routing), ("--expert-parallel-trace", args.expert_parallel_trace)):
        if value:
            command += [flag, str(value)]
    return command + ([] if args.direct_io else ["--buffered-io"]) + (["--native-gemv"] if args.native_gemv else [])


def _generate(args, model: Path, prompts: Path, ranks: int, budget: float, out: Path, cap_mib: float | None) -> dict:
    """One run's figures from generate's --json (every prompt's record), and each process's cgroup peak."""
    from moestream.bench.engine.isolation import RunFailed, call, cgroup_peak_mib, rank_cgroups
    from moestream.bench.engine.spec import shards
    from moestream.bench.tools.bandwidth import drop_page_cache

    drop_page_cache(shards(model))
    env = os.environ | {"OMP_NUM_THREADS": str(args.threads)}
    limits = [] if cap_mib is None else [int(cap_mib * MIB)] * ranks
    try:
        with rank_cgroups(limits) as (prefix, paths):
            call(_command(args, model, prompts, ranks, budget, out, prefix if limits else None), env)
            peaks = [cgroup_peak_mib(path) for path in paths]
    except (RunFailed, OSError) as error:  # OSError: a cgroup that could not be made or removed
        capped = f" under a {cap_mib:.0f} MiB cap each" if cap_mib else ""
        raise MoestreamError(f"bench engine --expert-parallel: a run of {ranks} rank(s) at {budget:g}{capped} "
                             f"failed: {error}") from None
    return summary(json.loads(out.read_text())) | {"cgroup_peak_mib": peaks}


def summary(records: list[dict]) -> dict:
    """TPOT (median over prompts) and per rank: hit rate, disk bytes and combine seconds per generated token."""
    tokens = max(sum(len(r["token_ids"]) for r in records), 1)
    reports = [r["expert_parallel"] for r in records if r.get("expert_parallel")] or [  # one process: one "rank"
        {"ranks": [{"hits": r["expert_hits"], "misses": r["expert_misses"], "bytes_read": r["bytes_read"],
                    "combine_s": 0.0}]} for r in records]
    return {"tpot_ms": statistics.median(r["tpot_ms"] for r in records),
            "per_rank": [{"hit_rate": r["hit_rate"], "disk_bytes_per_token": r["bytes_read"].get("disk", 0) / tokens,
                          "combine_ms_per_token": r["combine_s"] * 1e3 / tokens}
                         for r in summed_report(reports)["ranks"]]}


def summed_report(reports: list[dict]) -> dict:
    """Every rank's figures (moestream.parallel.launch.expert_parallel_report) summed over generations."""
    ranks = []
    for per_rank in zip(*(report["ranks"] for report in reports)):
        hits, misses = sum(r["hits"] for r in per_rank), sum(r["misses"] for r in per_rank)
        read = {tier: sum(r["bytes_read"].get(tier, 0) for r in per_rank) for tier in per_rank[0]["bytes_read"]}
        ranks.append(per_rank[0] | {"hits": hits, "misses": misses, "bytes_read": read,
                                    "hit_rate": hits / max(hits + misses, 1),
                                    "combine_s": sum(r["combine_s"] for r in per_rank)})
    return reports[0] | {"ranks": ranks}


def print_parallel(document: dict) -> None:
    from moestream.budget import format_bytes

    print(f"checkpoint {document['model']}: expert parallelism, placement {document['placement']}"
          + (f", replayed routing from {document['replay_routing']}" if document["replay_routing"] else ""))
    print(cap_line(document["memory_cap"]))
    print(f"{'budget':>7}  {'run':<28} {'TPOT ms':>8} {'cap MiB':>8}  per rank: hit rate, disk bytes/token, "
          "combine ms/token, cgroup peak MiB")
    for row in document["rows"]:
        peaks = row.get("cgroup_peak_mib") or [None] * len(row["per_rank"])
        ranks = "; ".join(f"{100 * r['hit_rate']:.1f}%, {format_bytes(r['disk_bytes_per_token'])}, "
                          f"{r['combine_ms_per_token']:.2f}, {'-' if peak is None else f'{peak:.0f}'}"
                          for r, peak in zip(row["per_rank"], peaks))
        cap = "-" if row.get("memory_cap_mib") is None else f"{row['memory_cap_mib']:.0f}"
        print(f"{row['budget']:>7g}  {row['run']:<28} {row['tpot_ms']:>8.1f} {cap:>8}  {ranks}")


def cap_line(caps: dict) -> str:
    if not caps["applied"]:
        return f"memory caps NOT applied ({caps['reason']}): every run uncapped"
    made = (f"floor {caps['floor_mib']:.0f} + dense {caps['dense_mib']:.0f} + B + {GENERATE_SLACK_MIB} MiB"
            if caps["requested"] == "auto" else f"{caps['requested']} MiB")
    return (f"memory caps ({caps['reason']}): one process at B: {made}; one at B/N and each of the N ranks: "
            "the same less (1 - 1/N) B")
