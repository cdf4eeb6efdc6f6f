"""`moestream bench timeline`: where one decode token's time goes, lane by lane.

One prompt runs through the engine (cold, optional --replay-routing) with a `Tracer` keeping its spans.
For decode step --token (default the one before the last) it prints the step's wall time and per lane
the time busy and span count: routed expert MLPs, other layer expert work, policy decisions, waits, the
dense modules by role with their weights' effective bandwidth (`DenseSpans`), the host compute lane (the
compute thread's time on the results of experts computed on the host, `--host-compute` with a
`--host-budget`), the rest of the compute thread, and each link's transfers with their share overlapping
compute.

`DenseSpans` times the model's dense modules by role (`moestream.runtime.loader.dense_modules`:
attention, shared experts, dense MLPs, the output head) with forward hooks while attached; it changes no
input, output or parameter.
Figures only: nothing is asserted. Knows no policy by name.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from moestream.bench import add_model_flags, add_run_flags, check_run_flags, model_dir, write_figures
from moestream.bench.engine.runners import HOST_LANE
from moestream.config import EngineConfig
from moestream.contracts import Observer
from moestream.errors import MoestreamError
from moestream.settings import add_arguments
from moestream.tracer import LANES, Span, Tracer, busy_s, overlap_s

if TYPE_CHECKING:
    import torch

TRANSFER_LANES = ("disk", "h2d")
TIMELINE_LANES = LANES if HOST_LANE in LANES else (*LANES, HOST_LANE)
THREAD_LANES = ("experts", "layer", "policy", "wait", "dense", HOST_LANE)  # the compute thread's own spans
KEPT_SPANS = 200_000  # the latest spans the tracer keeps


def weight_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


class DenseSpans:
    """Times every call of the model's dense modules into `tracer`'s dense lane, labelled by role."""

    def __init__(self, model: torch.nn.Module, tracer: Tracer):
        from moestream.runtime.loader import dense_modules

        self.roles = dense_modules(model)
        self.bytes_per_call = {role: sum(map(weight_bytes, modules)) / len(modules)
                               for role, modules in self.roles.items()}
        self._tracer, self._began = tracer, {}
        self._handles = [hook for role, modules in self.roles.items() for module in modules
                         for hook in (module.register_forward_pre_hook(self._begin),
                                      module.register_forward_hook(self._end(role)))]

    def _begin(self, module, args) -> None:
        self._began[id(module)] = time.perf_counter()

    def _end(self, role: str):
        def end(module, args, output) -> None:
            self._tracer.add("dense", role, self._began.pop(id(module)), time.perf_counter())
        return end

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def add_parser(kinds) -> None:
    parser = kinds.add_parser("timeline", help="one decode token's compute, transfers and waits")
    add_model_flags(parser)
    add_run_flags(parser, 16, "write the token's spans and figures here")
    parser.add_argument("--budget", default="0.25", help="expert budget")
    parser.add_argument("--token", type=int, help="which decode step, 1 to max-new-tokens - 1 (default the one "
                        "before the last)")
    add_arguments(parser, EngineConfig, only=("replay_routing", "policy", "sync", "direct_io", "native_gemv",
                                              "host_budget", "host_compute", "host_threads"))
    parser.add_argument("--plot", type=Path, help="draw the token's spans here (PNG)")
    parser.set_defaults(handler=run)


class StepStarts(Observer):
    """When each iteration began (perf_counter seconds), and the compute thread's CPU time then."""

    def __init__(self):
        self.starts: list[float] = []
        self.cpu_s: list[float] = []

    def begin_iteration(self, ctx) -> None:
        self.mark()

    def mark(self) -> None:
        self.starts.append(time.perf_counter())
        self.cpu_s.append(time.thread_time())


def run(args) -> int:
    token = _check(args)
    tracer, steps, dense_bytes = _record(args)
    if token + 1 >= len(steps.starts):
        raise MoestreamError(f"the generation ended after {len(steps.starts) - 2} decode steps (end of sequence), "
                             f"before step {token}: pass a smaller --token")
    document = figures(tracer, steps.starts, token, dense_bytes) | {
        "compute_thread_cpu_ms": (steps.cpu_s[token + 1] - steps.cpu_s[token]) * 1e3}
    _print(document)
    write_figures(document, args.json)
    if args.plot:
        print(f"timeline plot: {plot(document, args.plot)}")
    return 0


def _check(args) -> int:
    check_run_flags(args, least_tokens=3)
    token = args.max_new_tokens - 2 if args.token is None else args.token
    if not 1 <= token <= args.max_new_tokens - 1:
        raise MoestreamError(f"--token must be between 1 and {args.max_new_tokens - 1}, got {token}")
    return token


def _record(args) -> tuple[Tracer, StepStarts, dict[str, float]]:
    import torch

    from moestream.bench.engine.host import fill_tiers
    from moestream.bench.engine.runners import make_policy
    from moestream.bench.engine.spec import RunSpec, shards
    from moestream.bench.tools.bandwidth import drop_page_cache
    from moestream.checkpoint.demo import PROMPTS
    from moestream.checkpoint.index import build_index
    from moestream.runtime import Engine, EngineConfig

    torch.set_num_threads(args.threads)
    model = str(model_dir(args, announce=True))
    config = EngineConfig(expert_budget=args.budget, direct_io=args.direct_io, sync=args.sync, num_threads=args.threads,
                          policy=args.policy, replay_routing=args.replay_routing, native_gemv=args.native_gemv,
                          host_budget=args.host_budget, host_compute=args.host_compute, host_threads=args.host_threads)
    spec = RunSpec(model=model, budget=args.budget, policy=args.policy, predictor_dirs=tuple(args.predictor_dir))
    policy = make_policy(spec, build_index(model).topology)
    tracer, steps = Tracer(keep_spans=KEPT_SPANS), StepStarts()
    with Engine(model, config, observers=[steps], policy=policy, tracer=tracer) as engine:
        dense = DenseSpans(engine.model, tracer)
        if engine.store.host_slots:
            fill_tiers(engine)  # as bench engine: the host tier warm before the steps
        drop_page_cache(shards(model))
        engine.generate([PROMPTS[0]], args.max_new_tokens)
        steps.mark()  # the end of the last step
        dense.detach()
    return tracer, steps, dense.bytes_per_call


def figures(tracer: Tracer, starts: list[float], token: int, dense_bytes: dict[str, float]) -> dict:
    """The figures and spans of decode step `token` (step 0 is the prefill): from its start to the next's;
    dense_bytes: the weight bytes of one module of each dense role."""
    begin, end = starts[token], starts[token + 1]
    spans = tracer.window(begin, end)
    lanes = {lane: [s for s in spans if s.lane == lane] for lane in TIMELINE_LANES}
    thread = [s for lane in THREAD_LANES for s in lanes[lane]]
    computing = lanes["experts"] + lanes["layer"] + lanes["policy"]
    token_s = end - begin
    return {
        "token": token,
        "token_ms": token_s * 1e3,
        "lanes": {lane: {"busy_ms": busy_s(lanes[lane]) * 1e3, "spans": len(lanes[lane])} for lane in TIMELINE_LANES},
        "dense": {role: _dense_role([s for s in lanes["dense"] if s.label == role], nbytes)
                  for role, nbytes in dense_bytes.items()},
        "rest_of_compute_thread_ms": (token_s - busy_s(thread)) * 1e3,
        "transfer_beside_wait_ms": {lane: overlap_s(lanes[lane], lanes["wait"]) * 1e3 for lane in TRANSFER_LANES},
        "transfer_beside_expert_compute_ms": {lane: overlap_s(lanes[lane], computing) * 1e3
                                              for lane in TRANSFER_LANES},
        "spans": [_relative(s, begin) for s in spans],
    }


def _dense_role(spans: list[Span], weight_bytes: float) -> dict:
    """One dense role's time in the step, and its weights' effective bandwidth (bytes of one module / its
    median call)."""
    calls = sorted(s.end_s - s.begin_s for s in spans)
    median_s = calls[len(calls) // 2] if calls else 0.0
    return {"busy_ms": busy_s(spans) * 1e3, "calls": len(calls), "weight_mb": weight_bytes / 1e6,
            "gb_per_s": weight_bytes / median_s / 1e9 if median_s else 0.0}


def _relative(span: Span, origin_s: float) -> dict:
    return {"lane": span.lane, "label": span.label, "begin_ms": (span.begin_s - origin_s) * 1e3,
            "end_ms": (span.end_s - origin_s) * 1e3}


def _print(document: dict) -> None:
    lanes = document["lanes"]
    print(f"decode token {document['token']}: {document['token_ms']:.1f} ms")
    print(f"{'lane':<28}{'busy ms':>9}{'spans':>7}")
    for lane in THREAD_LANES:
        print(f"{'compute thread: ' + lane:<28}{lanes[lane]['busy_ms']:>9.1f}{lanes[lane]['spans']:>7}")
    for role, row in document["dense"].items():
        print(f"{'  dense: ' + role:<28}{row['busy_ms']:>9.1f}{row['calls']:>7}   "
              f"{row['weight_mb']:.2f} MB of weights a call, {row['gb_per_s']:.1f} GB/s (median call)")
    print(f"{'compute thread: the rest':<28}{document['rest_of_compute_thread_ms']:>9.1f}{'-':>7}   "
          "(embeddings, norms, routers, sampling, Python)")
    print(f"{'compute thread: CPU time':<28}{document['compute_thread_cpu_ms']:>9.1f}{'-':>7}   "
          "(on a core; the rest of the step it waited: bytes, the GIL, the scheduler)")
    for lane in (lane for lane in TRANSFER_LANES if lanes[lane]["spans"]):
        beside_wait = document["transfer_beside_wait_ms"][lane]
        print(f"{'link: ' + lane:<28}{lanes[lane]['busy_ms']:>9.1f}{lanes[lane]['spans']:>7}   "
              f"{lanes[lane]['busy_ms'] - beside_wait:.1f} ms of it while the compute thread was not waiting, "
              f"{document['transfer_beside_expert_compute_ms'][lane]:.1f} beside expert MLPs and policy")


def plot(document: dict, path: Path) -> Path:
    """One row per lane, a bar per span (Agg backend, written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moestream.atomic import atomic_path

    figure, axes = plt.subplots(figsize=(10, 3))
    for row, lane in enumerate(TIMELINE_LANES):
        bars = [(s["begin_ms"], s["end_ms"] - s["begin_ms"]) for s in document["spans"] if s["lane"] == lane]
        axes.broken_barh(bars, (row - 0.4, 0.8))
    axes.set(yticks=range(len(TIMELINE_LANES)), yticklabels=TIMELINE_LANES, xlabel="ms from the token's start",
             xlim=(0, document["token_ms"]), title=f"decode token {document['token']}: {document['token_ms']:.1f} ms")
    with atomic_path(path) as tmp:
        figure.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    plt.close(figure)
    return path
