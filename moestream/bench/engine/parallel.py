"""`moestream bench engine --expert-parallel N`: the engine on N ranks against one process.

For each budget B (a ratio of every routed expert's bytes), three runs of `moestream generate` over the
demo prompts, each a fresh process (or N) with the checkpoint dropped from the page cache: one process
at B (the same total memory), one process at B / N (what one of the N small machines does alone), and
N ranks started by torchrun (torch.distributed.run, gloo), each with its tiers sized B of the experts
it owns, i.e. B / N of the model: the whole holds what the one process at B holds. Figures: TPOT, and
per rank the expert hit rate, bytes read from disk per generated token and seconds in the combine per
generated token (the whole run, prefill included). The per-rank memory is held by each rank's budget,
not by a cgroup. Knows no engine internals: it reads generate's --json.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from moestream.errors import MoestreamError


def measure_parallel(args) -> dict:
    from moestream.cli.demo import PROMPTS, demo_checkpoint

    model = args.model or demo_checkpoint(args.small)
    budgets = [float(b) for b in args.budgets.split(",")]
    with tempfile.TemporaryDirectory() as scratch:
        prompts = Path(scratch) / "prompts.txt"
        prompts.write_text("\n".join(PROMPTS[: args.prompts]) + "\n")
        rows = []
        for budget in budgets:
            for label, ranks, run_budget in _runs(budget, args.expert_parallel):
                record = _generate(args, model, prompts, ranks, run_budget, Path(scratch) / "out.json")
                rows.append({"budget": budget, "run": label, "ranks": ranks, "run_budget": run_budget} | record)
    return {"model": str(model), "world_size": args.expert_parallel, "placement": args.expert_parallel_placement,
            "replay_routing": args.replay_routing, "rows": rows}


def _runs(budget: float, world_size: int) -> list[tuple[str, int, float]]:
    return [(f"1 process at {budget:g}", 1, budget), (f"1 process at {budget / world_size:g}", 1, budget / world_size),
            (f"{world_size} ranks at {budget:g} in all", world_size, budget)]


def _command(args, model: Path, prompts: Path, ranks: int, budget: float, out: Path) -> list[str]:
    launcher = [sys.executable, "-m", "moestream"]
    if ranks > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                    "--master-port", str(_free_port()), "-m", "moestream"]
    command = launcher + ["generate", "--model", str(model), "--prompts-file", str(prompts), "--max-new-tokens",
                          str(args.max_new_tokens), "--expert-budget", f"{budget:g}", "--device", args.device,
                          "--json", str(out), "--expert-parallel-placement", args.expert_parallel_placement]
    for flag, value in (("--replay-routing", args.replay_routing), ("--expert-parallel-trace", args.expert_parallel_trace)):
        if value:
            command += [flag, str(value)]
    return command + ([] if args.direct_io else ["--buffered-io"])


def _generate(args, model: Path, prompts: Path, ranks: int, budget: float, out: Path) -> dict:
    """One run's figures from generate's --json (every prompt's record)."""
    from moestream.store.bandwidth import drop_page_cache

    drop_page_cache(sorted(Path(model).glob("*.safetensors")))
    env = os.environ | {"OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(_command(args, model, prompts, ranks, budget, out), env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise MoestreamError(f"bench engine --expert-parallel: a run of {ranks} rank(s) at {budget:g} failed: "
                             f"{done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
    return summary(json.loads(out.read_text()))


def summary(records: list[dict]) -> dict:
    """TPOT (mean over prompts) and per rank: hit rate, disk bytes and combine seconds per generated token."""
    tokens = sum(len(r["token_ids"]) for r in records)
    tpot = sum(r["tpot_ms"] for r in records) / len(records)
    parallel = [r["expert_parallel"] for r in records if r.get("expert_parallel")]
    if not parallel:  # one process: one "rank"
        hits, misses = sum(r["expert_hits"] for r in records), sum(r["expert_misses"] for r in records)
        disk = sum(r["bytes_read"].get("disk", 0) for r in records)
        return {"tpot_ms": tpot, "per_rank": [_rank(hits, misses, disk, 0.0, tokens)]}
    per_rank = zip(*(p["ranks"] for p in parallel))  # each rank's records, one a prompt
    return {"tpot_ms": tpot, "per_rank": [_rank(sum(r["hits"] for r in rank), sum(r["misses"] for r in rank),
                                                sum(r["bytes_read"].get("disk", 0) for r in rank),
                                                sum(r["combine_s"] for r in rank), tokens) for rank in per_rank]}


def _rank(hits: int, misses: int, disk: int, combine_s: float, tokens: int) -> dict:
    return {"hit_rate": hits / (hits + misses) if hits + misses else 0.0, "disk_bytes_per_token": disk / max(tokens, 1),
            "combine_ms_per_token": combine_s * 1e3 / max(tokens, 1)}


def print_parallel(document: dict) -> None:
    from moestream.budget import format_bytes

    print(f"checkpoint {document['model']}: expert parallelism, placement {document['placement']}"
          + (f", replayed routing from {document['replay_routing']}" if document["replay_routing"] else ""))
    print(f"{'budget':>7}  {'run':<28} {'TPOT ms':>8}  per rank: hit rate, disk bytes/token, combine ms/token")
    for row in document["rows"]:
        ranks = "; ".join(f"{100 * r['hit_rate']:.1f}%, {format_bytes(r['disk_bytes_per_token'])}, "
                          f"{r['combine_ms_per_token']:.2f}" for r in row["per_rank"])
        print(f"{row['budget']:>7g}  {row['run']:<28} {row['tpot_ms']:>8.1f}  {ranks}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
