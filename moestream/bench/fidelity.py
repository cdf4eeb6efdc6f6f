"""`moestream bench fidelity`: does the simulator predict the engine? The same replayed rows run in both.

The engine runs once (a fresh cold process, `--replay-routing TRACE`) and records each iteration's trace
rows and what its policy saw; the simulator replays exactly those with the same policy, device slots
and predictors run inline (as the simulator does), under a cost model calibrated from an on-demand LRU
run at the same budget or given as `--cost-model measured:PATH`. Decode hit rate must agree within 0.03
and stall per token within 15% (ok/missed, never asserted); `--sync` compares the on-demand path, the
default the asynchronous one with cache-aware reordering. `--host-compute RULE`: both keep every expert in
a host tier and compute the misses the rule places there; the simulator takes the engine's measured host
compute costs and its host copy link, and the choice at every layer step must be the same (placements:
ok/missed). `--host-budget B`: the engine's host tier (on the CPU a tier apart with --sync; otherwise it joins
the device tier there); the simulator runs the same chain of links and host tier (`moestream.store.chain`),
so what it compares is only the cost model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from moestream.bench import add_model_flags, add_run_flags, check_run_flags, model_dir, write_figures
from moestream.config import EngineConfig
from moestream.settings import add_arguments

HIT_RATE_TOLERANCE = 0.03  # absolute
STALL_TOLERANCE = 0.15  # relative to the engine's stall


def add_parser(kinds) -> None:
    parser = kinds.add_parser("fidelity", help="engine vs simulator on the same replayed routing")
    parser.add_argument("--replay-routing", required=True, metavar="TRACE", help="trace whose routing both follow")
    add_model_flags(parser)
    add_run_flags(parser, 32, "write the figures and the cost model here")
    parser.add_argument("--budget", default="0.25", help="expert budget")
    parser.add_argument("--host-budget", default="0", help="host-tier budget (the engine's --host-budget)")
    parser.add_argument("--cost-model", metavar="measured:PATH", help="a calibration (default: measure one now)")
    add_arguments(parser, EngineConfig, only=("policy", "sync", "reorder", "direct_io", "link_gbps", "layer_ms",
                                              "host_compute", "host_threads"))
    parser.set_defaults(handler=run)


def run(args) -> int:
    document = compare(args)
    _print(document)
    write_figures(document, args.json)
    return 0


def compare(args) -> dict:
    from moestream.bench.engine.isolation import run_isolated
    from moestream.bench.engine.spec import RunSpec
    from moestream.checkpoint.demo import PROMPTS
    from moestream.checkpoint.index import build_index

    check_run_flags(args, least_tokens=2)
    model = model_dir(args, announce=True)
    index = build_index(model)
    topology = index.topology
    spec = RunSpec(model=str(model), budget=args.budget, policy=args.policy, sync=args.sync, reorder=args.reorder,
                   prompts=PROMPTS, max_new_tokens=args.max_new_tokens, threads=args.threads, direct_io=args.direct_io,
                   replay_routing=args.replay_routing, predictor_dirs=tuple(args.predictor_dir),
                   link_gbps=args.link_gbps, layer_ms=args.layer_ms,  # the planner's link: the same on both sides
                   background_predictor=False, keep_embeddings=True,  # inline, as the simulator: the module doc
                   host_compute=args.host_compute, host_threads=args.host_threads,
                   host_budget="100%" if args.host_compute != "off" else args.host_budget)
    engine = run_isolated(spec)
    cost = _cost_model(args, spec, engine, topology)
    num_chunks = len(next(iter(index.experts.locations.values())).segments)  # one per weight matrix
    simulated = _simulate(args, spec, engine, topology, cost, num_chunks)
    return {"model": str(model), "budget": args.budget, "host_budget": args.host_budget, "policy": args.policy,
            "mode": "sync" if args.sync else "async", "reorder": args.reorder,
            "replay_routing": args.replay_routing,
            "engine": {k: engine[k] for k in ("hit_rate", "stall_ms_per_token", "tpot_ms", "bytes_per_token",
                                              "host_bytes_per_token", "decode_tokens", "expert_hits", "expert_misses",
                                              "expert_read_ms", "experts_per_read_batch", "read_batch_line_ms",
                                              "routed_expert_ms", "peak_rss_mib")},
            "simulator": simulated, "agreement": agreement(engine, simulated),
            "cost_model": dataclasses.asdict(cost)} | _placed(engine, simulated)


def _cost_model(args, spec, engine: dict, topology):
    """--cost-model, else a calibration run: on-demand LRU at the same budget (the compared run itself
    when it is one: then the stall check tests the simulator's mechanism and miss counts, not its costs)."""
    from moestream.bench.engine.isolation import run_isolated
    from moestream.bench.engine.plan import calibrate, disk_figures
    from moestream.bench.sim.cost import get_cost_model

    if args.cost_model:
        return get_cost_model(args.cost_model)
    itself = spec.sync and spec.policy == "lru" and spec.host_compute == "off"
    calibration = spec if itself else dataclasses.replace(spec, sync=True, policy="lru", reorder=True,
                                                          host_compute="off", host_budget="0")
    disk_bw = disk_figures(Path(spec.model), spec.direct_io)["bandwidth"]
    return calibrate(topology, engine if calibration == spec else run_isolated(calibration), disk_bw)


def _simulate(args, spec, engine: dict, topology, cost, num_expert_chunks: int) -> dict:
    """The simulator on the engine's rows, tiers and chunks (one per weight matrix: the engine's default)."""
    from moestream.bench.engine.runners import make_policy
    from moestream.bench.engine.simulated import engine_iterations, replayed, sim_ratio, simulate
    from moestream.link_model import LinkFigures
    from moestream.policies.compute_placement import ComputeCosts
    from moestream.topology import ExpertKey
    from moestream.trace.format import load_trace

    run = replayed(load_trace(args.replay_routing), engine["iterations"], engine["prefill"], topology,
                   engine.get("iteration_token_ids"), engine.get("iteration_tokens"), engine.get("iteration_embeddings"))
    policy = make_policy(spec, topology)
    order = "loaded" if spec.sync else "ready" if spec.reorder else "given"  # as the engine computes a layer
    figures = LinkFigures(spec.link_gbps, spec.layer_ms, spec.reorder) if spec.link_gbps > 0 else None
    host_costs = ComputeCosts(**engine["host_costs"]) if engine.get("host_costs") else None
    if host_costs is not None:  # every expert in host RAM, copied up over the engine's measured link
        cost = cost.with_overrides(host_holds_all=True, host_to_device_gbps=host_costs.link_bytes_per_ms / 1e6,
                                   host_to_device_latency_ms=0.0, demand_batch_ms=0.0)  # copies, not reads
    host_slots = engine["host_slots"] if host_costs is None else 0  # host compute: every expert in host RAM
    return simulate(policy, run, engine_iterations(run), sim_ratio(engine["device_slots"], topology), cost,
                    expert_order=order, modelled_link=figures is not None, host_slots=host_slots, sync=spec.sync,
                    num_expert_chunks=num_expert_chunks,
                    link_figures=figures,  # the engine's link, or none where its planner had none
                    host_compute=spec.host_compute, compute_costs=host_costs,
                    warm=[ExpertKey(*key) for key in engine.get("warm_device", ())],
                    warm_host=[ExpertKey(*key) for key in engine.get("warm_host", ())])


def _placed(engine: dict, simulated: dict) -> dict:
    """Where host compute ran: the layer steps whose host experts the simulator chose as the engine did."""
    if "host_placements" not in engine:
        return {}
    ours, theirs = engine["host_placements"], simulated.get("host_placements", [])
    same = sum(a == b for a, b in zip(ours, theirs))
    return {"placements": {"layer_steps": len(ours), "same": same, "host_experts": sum(len(e) for _, e in ours),
                           "agree": "ok" if same == len(ours) == len(theirs) else "missed"}}


def agreement(engine: dict, simulated: dict) -> dict:
    """Hit rate within HIT_RATE_TOLERANCE (absolute), stall per token within STALL_TOLERANCE of the engine's."""
    hit_gap = simulated["hit_rate"] - engine["hit_rate"]
    stall = engine["stall_ms_per_token"]
    stall_gap = (simulated["stall_ms_per_token"] - stall) / stall if stall > 0 else None
    stall_ok = abs(stall_gap) <= STALL_TOLERANCE if stall_gap is not None else simulated["stall_ms_per_token"] == 0
    return {"hit_rate_gap": hit_gap, "hit_rate": "ok" if abs(hit_gap) <= HIT_RATE_TOLERANCE else "missed",
            "stall_gap": stall_gap, "stall": "ok" if stall_ok else "missed"}


def _print(document: dict) -> None:
    engine, sim, agree = document["engine"], document["simulator"], document["agreement"]
    print(f"[replayed routing from {document['replay_routing']}: figures are for measurement only]")
    host = f", host budget {document['host_budget']}" if document["host_budget"] not in ("0", "0%") else ""
    print(f"fidelity: {document['policy']} {document['mode']} at budget {document['budget']}{host}, "
          f"{engine['decode_tokens']} decode tokens, cost model {document['cost_model']['name']} "
          f"({document['cost_model']['layer_compute_ms']:.2f} ms per layer, "
          f"{document['cost_model']['disk_to_host_gbps']:.2f} GB/s expert reads)")
    print(f"{'':14}{'engine':>10}{'simulator':>12}")
    print(f"{'hit rate':14}{engine['hit_rate']:>10.3f}{sim['hit_rate']:>12.3f}   gap {agree['hit_rate_gap']:+.3f} "
          f"(within {HIT_RATE_TOLERANCE}): {agree['hit_rate']}")
    gap = "-" if agree["stall_gap"] is None else f"{agree['stall_gap']:+.1%}"
    print(f"{'stall ms/tok':14}{engine['stall_ms_per_token']:>10.2f}{sim['stall_ms_per_token']:>12.2f}   gap {gap} "
          f"(within {STALL_TOLERANCE:.0%}): {agree['stall']}")
    print(f"{'TPOT ms':14}{engine['tpot_ms']:>10.2f}{sim['tpot_ms']:>12.2f}   (informational)")
    moved = engine["bytes_per_token"] + engine["host_bytes_per_token"]  # from disk and from the host tier
    print(f"{'KiB/tok':14}{moved / 1024:>10.0f}{sim['bytes_per_token'] / 1024:>12.0f}")
    print(f"{'peak RSS MiB':14}{engine['peak_rss_mib']:>10.0f}")
    placed = document.get("placements")
    if placed:
        print(f"host compute: {placed['same']} of {placed['layer_steps']} layer steps placed as the engine did "
              f"({placed['host_experts']} experts on the engine's host): {placed['agree']}")
    if engine["expert_read_ms"]:
        cost = document["cost_model"]
        print(f"engine reads: {engine['expert_read_ms']:.2f} ms per expert, {engine['experts_per_read_batch']:.1f} "
              f"experts per read batch; simulator: {cost['demand_batch_ms']:.2f} ms per batch of a layer's demand "
              f"loads + bytes / {cost['disk_to_host_gbps']:.2f} GB/s per expert; a routed expert computes in "
              f"{cost['routed_expert_ms']:.3f} ms")
