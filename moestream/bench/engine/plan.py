"""The runs of `bench engine` and the figures around them: disk bandwidth, the all-resident run, the
calibrated cost model, each budget's physical limit, and one row per run in the issue's JSON schema.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from pathlib import Path

from moestream.bench import budget_list, check_run_flags, checkpoint_summary, model_dir, split_names
from moestream.bench.engine.isolation import MIB, RunFailed, cap_method, cap_support, run_isolated
from moestream.bench.engine.spec import RunSpec, dense_bytes
from moestream.errors import MoestreamError

HF = "hf-accelerate"
PLAIN = "transformers"  # plain transformers, all resident (baselines.py)
CAP_SLACK_MIB = 64  # the memory cap: floor + dense part + budget + this
ROW_FIGURES = ("tpot_ms", "ttft_ms", "hit_rate", "stall_ms_per_token", "overlap", "bytes_per_token", "peak_rss_mib",
               "steady_tpot_ms", "host_bytes_per_token")
ROW_EXTRAS = ("routed_expert_ms", "memory_cap_mib", "cgroup_peak_mib", "device_slots", "host_slots", "link_gbps",
              "host_computed", "host_compute_share", "host_lane_ms_per_token", "host_lane_spans_per_token")
PROGRESS_FIGURES = {"TTFT": ("ttft_ms", 1, "{:.1f} ms"), "TPOT": ("tpot_ms", 1, "{:.1f} ms"),  # name: (key, scale, form)
                    "stall": ("stall_ms_per_token", 1, "{:.1f} ms/token"), "hit rate": ("hit_rate", 1, "{:.3f}"),
                    "read": ("bytes_per_token", 1e6, "{:.1f} MB/token"),
                    "host": ("host_bytes_per_token", 1e6, "{:.1f} MB/token"),
                    "on host": ("host_compute_share", 0.01, "{:.0f}% of misses"),
                    "host lane": ("host_lane_ms_per_token", 1, "{:.2f} ms/token")}


@dataclasses.dataclass(frozen=True)
class Job:
    policy: str
    sync: bool
    kind: str = "engine"
    host_compute: str = "off"  # EngineConfig.host_compute (our engine's runs)

    @property
    def mode(self) -> str:
        """plain, sync or async; with a host compute rule other than off, "async host RULE" (or sync's)."""
        mode = "plain" if self.kind == PLAIN else "sync" if self.sync else "async"
        return mode if self.host_compute == "off" else f"{mode} host {self.host_compute}"


def jobs(designs: str, rules: tuple[str, ...] = ("off",)) -> list[Job]:
    """Per budget: on-demand LRU, then async LRU, each design and default under each --host-compute rule
    (on-demand LRU, the reference, computes every miss on the device), transformers + accelerate."""
    policies = ["lru", *split_names(designs), "default"]
    return [Job("lru", True), *(Job(name, False, host_compute=rule) for rule in rules for name in policies)]


def host_rules(text: str) -> tuple[str, ...]:
    """--host-compute's rules, comma separated (each checked: a refusal names the flag), in order, once each."""
    from moestream.policies.compute_placement import compute_rule

    rules = tuple(dict.fromkeys(rule.strip() for rule in text.split(",") if rule.strip()))
    if not rules:
        raise MoestreamError("--host-compute: give a rule (off, share:F, default) or several, comma separated")
    for rule in rules:
        compute_rule(rule)
    return rules


def measure(args, run=run_isolated) -> dict:
    """The bench's document; each run through `run` (spec, memory cap) -> figures: one fresh process."""
    from moestream.bench.engine.host import copy_gbps
    from moestream.bench.integrity import report_integrity
    from moestream.checkpoint.demo import PROMPTS
    from moestream.checkpoint.index import build_index
    from moestream.memory_plan import check_host_room, sizes_of

    budgets, host = check_flags(args)
    rules = host_rules(args.host_compute)
    model = model_dir(args)
    index = build_index(model)
    topology = index.topology
    host_mib = _bytes(host, topology) / MIB
    if host_mib:  # before any expert is loaded
        check_host_room(host, sizes_of(index), args.device, max(_bytes(budget, topology) for budget in budgets))
    base = RunSpec(model=str(model), budget="1.0", prompts=PROMPTS[: args.prompts], device=args.device,
                   max_new_tokens=args.max_new_tokens, threads=args.threads, direct_io=args.direct_io,
                   native_gemv=args.native_gemv, replay_routing=args.replay_routing,
                   predictor_dirs=tuple(args.predictor_dir), warmup_steps=args.warmup_steps,
                   host_threads=args.host_threads)
    disk = disk_figures(Path(model), args.direct_io)
    resident = run(dataclasses.replace(base, preload=True))
    progress("all resident", "1.0", resident)
    plain, skipped = _plain_run(args, base, run)
    dense_mib = dense_bytes(model, topology) / MIB
    h2d = copy_gbps(topology.expert_bytes, args.device) * 1e9 if host_mib else None
    context = {"resident": resident, "disk_bw": disk["bandwidth"], "topology": topology, "dense_mib": dense_mib,
               "cap": _cap(args), "run": run, "host_mib": host_mib,
               "link_bw": h2d if _bytes(host, topology) >= topology.total_expert_bytes else None}
    base = dataclasses.replace(base, host_budget=host, layer_ms=resident["tpot_ms"] / topology.num_layers)
    run_list, skipped_budgets = _run_list(args, budgets, rules)
    skipped += skipped_budgets
    results = []
    for budget in budgets:
        results += _budget_runs(base, budget, run_list, context, skipped)
    cost = calibrate(topology, _calibration_run(results, topology) or resident | {"expert_read_ms": disk["expert_read_ms"]},
                     disk["bandwidth"])
    limits, oracle = _limits(budgets, _replayed(args, resident, topology), cost, context)
    rows = [_row(Job("lru", False), "1.0", resident, resident["tpot_ms"], topology)]
    rows += [_row(Job(PLAIN, False, PLAIN), "1.0", plain, None, topology)] if plain else []
    rows += [_row(job, budget, result, limits.get(budget), topology) for job, budget, result in results]
    floors = [row.pop("floor_rss_mib") for row in rows]
    floors = [floor for floor, row in zip(floors, rows) if row["memory_cap_mib"] is None]  # capped runs: twins
    integrity = report_integrity(Path(model), args.device, args.direct_io)  # digest and finite check costs
    return {"runs": rows, "resident_tpot_ms": resident["tpot_ms"], "floor_rss_mib": statistics.median(floors),
            "dense_mib": dense_mib, "disk_bw_gbps": disk["bandwidth"] / 1e9, "model": str(model),
            "checkpoint": checkpoint_summary(topology), "device": args.device, "prompts": args.prompts,
            "replay_routing": args.replay_routing, "replay_wraps": resident.get("replay_wraps", 0),
            "threads": args.threads, "native_gemv": args.native_gemv, "max_new_tokens": args.max_new_tokens,
            "skipped": skipped, "host_budget": host, "host_budget_mib": host_mib, "h2d_gbps": h2d and h2d / 1e9,
            "transformers": versus_transformers(resident, plain, args),
            "memory_cap": context["cap"], "cost_model": dataclasses.asdict(cost), "integrity": integrity,
            "oracle_bytes_per_token": oracle, "host_compute": list(rules), "host_threads": args.host_threads}


def _plain_run(args, base: RunSpec, run) -> tuple[dict | None, list[dict]]:
    """Plain transformers all resident (baselines.py), or why not: (its figures, the skipped note)."""
    reason = "not run with --no-transformers" if args.no_transformers else None
    label = {"policy": PLAIN, "budget": "1.0", "mode": "plain", "memory_cap_mib": None}
    if reason is None:
        try:
            plain = run(dataclasses.replace(base, kind=PLAIN), None) | {"memory_cap_mib": None}
            progress("plain transformers", "1.0", plain)
            return plain, []
        except (RunFailed, OSError) as error:
            progress("plain transformers", "1.0", None, str(error))
            reason = str(error)
    return None, [label | {"reason": reason}]


def versus_transformers(resident: dict, plain: dict | None, args) -> dict | None:
    """Our all-resident run against plain transformers': steady TPOT (each prompt's decode steps after the
    first --warmup-steps), also in process CPU time, and whether the tokens are the same (not compared under
    --replay-routing, where our engine follows the trace's routing); None where transformers did not run."""
    if plain is None:
        return None
    ours, theirs = resident["steady_tpot_ms"], plain["steady_tpot_ms"]
    our_cpu, their_cpu = resident["steady_cpu_tpot_ms"], plain["steady_cpu_tpot_ms"]
    return {"warmup_steps": args.warmup_steps, "resident_steady_tpot_ms": ours, "transformers_steady_tpot_ms": theirs,
            "ratio": _ratio(ours, theirs), "resident_steady_cpu_tpot_ms": our_cpu,
            "transformers_steady_cpu_tpot_ms": their_cpu, "cpu_ratio": _ratio(our_cpu, their_cpu),
            "dtype": plain["dtype"], "experts_implementation": plain["experts_implementation"],
            "same_tokens": None if args.replay_routing else resident["token_ids"] == plain["token_ids"]}


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours and theirs else None


def _run_list(args, budgets: list[str], rules: tuple[str, ...] = ("off",)) -> tuple[list[Job], list[dict]]:
    """The jobs of each budget, and the notes of those not run: transformers + accelerate's disk offload
    (the CPU baseline) is not run with --device cuda (nor with --no-hf)."""
    reason = ("not run with --device cuda: accelerate's disk offload is the CPU baseline"
              if args.device.startswith("cuda") else None)
    if args.no_hf:
        return jobs(args.designs, rules), []
    if reason is None:
        return jobs(args.designs, rules) + [Job(HF, True, HF)], []
    return jobs(args.designs, rules), [{"policy": HF, "budget": budget, "mode": "sync", "memory_cap_mib": None,
                                 "reason": reason} for budget in budgets]


def check_flags(args) -> tuple[list[str], str]:
    """The budgets and the host budget (RunSpec's text), each flag checked."""
    from moestream.bench.engine.host import budget_text
    from moestream.checkpoint.demo import PROMPTS
    from moestream.checks import at_least
    from moestream.threads import available_cores

    check_run_flags(args)
    at_least(0, {"--warmup-steps": args.warmup_steps})
    if not 1 <= args.host_threads <= available_cores():
        raise MoestreamError(f"--host-threads {args.host_threads}: must be between 1 and this machine's "
                             f"{available_cores()} cores")
    if not 1 <= args.prompts <= len(PROMPTS):
        raise MoestreamError(f"--prompts must be between 1 and {len(PROMPTS)}, got {args.prompts}")
    if args.memory_cap not in (None, "auto") and not args.memory_cap.isdigit():
        raise MoestreamError(f"--memory-cap must be auto or a size in MiB, got {args.memory_cap!r}")
    return budget_list(args.budgets), budget_text(args.host_budget)


def _bytes(budget: str, topology) -> int:
    """A budget's bytes: whole expert slots, at most every expert."""
    from moestream.memory_plan import host_bytes

    return host_bytes(budget, topology.expert_bytes, topology.total_experts)


def disk_figures(model: Path, direct_io: bool) -> dict:
    """Cold O_DIRECT figures of the largest shard: sequential bandwidth (the better of two ways) and
    random experts read a decode step's top_k in flight together, as the engine reads its misses."""
    from moestream.bench.tools.bandwidth import cold_read_samples
    from moestream.checkpoint.index import build_index

    shard = max(model.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    index = build_index(model).experts
    samples = cold_read_samples(shard, index, 0, direct_io)
    return {"bandwidth": max(samples["sequential"], samples["sequential_reader"]),
            "expert_read_ms": index.topology.expert_bytes / samples["random_experts"] * 1e3}


def calibrate(topology, run: dict, disk_bw: float = 0.0):
    """The simulator's cost model from a run's decode compute (its mean decode step less its stall, both per
    decode token; a run without the mean: its TPOT), its routed experts' compute and its expert reads: an
    on-demand (--sync) run reads each miss on the compute thread, so all are the engine's own. A read batch
    costs the line fitted to the run's batches (fixed part, per expert) when it has one; else, with the
    disk's bandwidth (bytes/s), a fixed part plus each expert's bytes at it.

    Not the median TPOT less the stall: one generation whose reads were slow (a loaded disk) holds most of the
    run's stall, and the median generation's TPOT can lie below the mean stall per token (issue 43)."""
    from moestream.bench.sim.cost import measured_cost_model

    decode_ms = run.get("decode_ms_per_token") or run["tpot_ms"]
    compute_ms, line = decode_ms - run["stall_ms_per_token"], run.get("read_batch_line_ms")
    return measured_cost_model(topology.num_layers, compute_ms, topology.expert_bytes, run["expert_read_ms"],
                               "bench engine: decode compute (TPOT - stall) and expert reads of "
                               f"{'an on-demand LRU run' if run['stall_ms_per_token'] else 'the all-resident run'}",
                               run.get("experts_per_read_batch") or 1.0, disk_bw / 1e9,
                               tuple(line) if line else None, run.get("routed_expert_ms") or 0.0)


def _calibration_run(results: list, topology) -> dict | None:
    """The on-demand LRU run nearest the 25% budget, the one the simulator's costs come from."""
    runs = [(abs(_fraction(budget, topology) - 0.25), result) for job, budget, result in results
            if job == Job("lru", True) and result["expert_read_ms"] and result["memory_cap_mib"] is None]
    return min(runs, key=lambda pair: pair[0])[1] if runs else None


def _replayed(args, resident: dict, topology):
    from moestream.bench.engine.simulated import replayed
    from moestream.trace.format import load_trace

    if args.replay_routing is None:
        return None
    return replayed(load_trace(args.replay_routing), resident["iterations"], resident["prefill"], topology)


def _cap(args) -> dict:
    if args.memory_cap is None:
        return {"requested": None, "applied": False, "reason": "not requested"}
    reason = cap_support()
    return {"requested": args.memory_cap, "applied": reason is None, "reason": reason or cap_method()}


def _budget_runs(base: RunSpec, budget: str, run_list: list[Job], context: dict, skipped: list) -> list:
    """(job, budget, figures) of every run at this budget that completed, each also under the memory cap
    when one applies and the uncapped run completed (figures' memory_cap_mib says which); the others go
    to skipped."""
    from moestream.store.config import Budget

    budget_mib = Budget.parse(budget).resolve(context["topology"].total_expert_bytes) / MIB
    caps = [None] + ([_cap_bytes(context, budget_mib)] if context["cap"]["applied"] else [])
    done = []
    for job in run_list:
        spec = dataclasses.replace(base, budget=budget, policy=job.policy if job.kind == "engine" else "lru",
                                   sync=job.sync, kind=job.kind, link_gbps=_link_bw(job, base, context) / 1e9,
                                   host_compute=job.host_compute)
        for cap in caps:
            label = f"{job.policy} {job.mode}" + (f" capped at {cap / MIB:.0f} MiB" if cap else "")
            try:
                link = spec.link_gbps if job.kind == "engine" else None
                ours = {"host_budget_mib": context["host_mib"], "link_gbps": link}
                done.append((job, budget, context["run"](spec, cap) | {"memory_cap_mib": cap and cap / MIB} | ours))
                progress(label, budget, done[-1][2])
            except (RunFailed, OSError) as error:
                progress(label, budget, None, str(error))
                skipped.append({"policy": job.policy, "budget": budget, "mode": job.mode,
                                "memory_cap_mib": cap and cap / MIB, "reason": str(error)})
                break  # no capped twin of a run that failed uncapped
    return done


def _link_bw(job: Job, base: RunSpec, context: dict) -> float:
    """The link the run's planner sees (bytes/s): the host -> device copy's where the store keeps a host tier
    apart that holds every expert (filled before timing), else the disk's (cold O_DIRECT). A run that computes
    on the host keeps its host tier apart, on the CPU too."""
    from moestream.store.factory import merges_tiers

    host = context["link_bw"] is not None and not merges_tiers(base.device, not job.sync, job.host_compute != "off")
    return context["link_bw"] if host else context["disk_bw"]


def progress(label: str, budget: str, result: dict | None, failure: str = "") -> None:
    """One line on stderr as each run ends, so that a bench stopped midway (a timeout) still shows
    what it measured; the table and the JSON come at the end."""
    if result is None:
        line = f"failed: {failure.splitlines()[-1] if failure else 'no reason given'}"
    else:
        line = ", ".join(f"{name} {'n/a' if result.get(key) is None else form.format(result[key] / scale)}"
                         for name, (key, scale, form) in PROGRESS_FIGURES.items())
    print(f"bench engine: {label} at {budget}: {line}", file=sys.stderr, flush=True)


def _cap_bytes(context: dict, budget_mib: float) -> int:
    cap = context["cap"]
    if cap["requested"] != "auto":
        return int(cap["requested"]) * MIB
    floor = context["resident"]["floor_rss_mib"]
    held_mib = budget_mib + context["host_mib"]
    return int((floor + context["dense_mib"] + held_mib + CAP_SLACK_MIB) * MIB)


def _limits(budgets: list[str], run, cost, context: dict) -> tuple[dict[str, float], dict[str, float]]:
    """Per budget: max(resident TPOT, oracle bytes per token / the misses' link bandwidth: the host -> device
    copy's where the host tier holds every expert, else O_DIRECT), and the oracle's bytes per token; none
    without a replayed trace."""
    from moestream.bench.engine.simulated import oracle_bytes_per_token, sim_ratio
    from moestream.store.config import Budget

    if run is None:
        return {}, {}
    topology, limits, oracle = context["topology"], {}, {}
    for budget in budgets:
        slots = Budget.parse(budget).resolve(topology.total_expert_bytes) // topology.expert_bytes
        moved = oracle_bytes_per_token(run, sim_ratio(slots, topology), cost)
        limits[budget] = max(context["resident"]["tpot_ms"], moved / (context["link_bw"] or context["disk_bw"]) * 1e3)
        oracle[budget] = moved
    return limits, oracle


def _fraction(budget: str, topology) -> float:
    """The budget as a share of all routed-expert bytes (whether given as a ratio or a size)."""
    from moestream.store.config import Budget

    return Budget.parse(budget).resolve(topology.total_expert_bytes) / topology.total_expert_bytes


def _row(job: Job, budget: str, result: dict, limit: float | None, topology) -> dict:
    """A run's row; routed_expert_ms (mean), memory_cap_mib (None: uncapped), cgroup_peak_mib, the tiers'
    slots and the planner's link (GB/s) where the run has them; floor_rss_mib is popped into the document's
    median floor."""
    fraction = _fraction(budget, topology)
    return ({"policy": job.policy, "budget": fraction, "budget_mib": fraction * topology.total_expert_bytes / MIB,
             "host_budget_mib": result.get("host_budget_mib", 0.0), "mode": job.mode, "host_compute": job.host_compute}
            | {key: result[key] for key in ROW_FIGURES} | {"limit_tpot_ms": limit}
            | {key: result.get(key) for key in ROW_EXTRAS}
            | ({"floor_rss_mib": result["floor_rss_mib"]} if "floor_rss_mib" in result else {}))
