"""PNG figures of simulation results: hit rate against cache ratio, and hit rate per layer; TPOT and
each rank's hit rate against the number of ranks.

Takes plain result dicts ({policy: {ratio: metrics}}); knows nothing of how they were made.
Uses matplotlib's Agg backend, writes atomically.
"""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from moestream.atomic import atomic_path  # noqa: E402

Results = dict[str, dict[float, dict]]  # policy -> cache ratio -> metrics


def plot_results(results: Results, path: str | os.PathLike, title: str = "") -> Path:
    """Two panels: hit rate vs cache ratio per policy; per-layer hit rate at the smallest ratio."""
    figure, (by_ratio, by_layer) = plt.subplots(1, 2, figsize=(12, 4.5))
    _hit_rate_vs_ratio(by_ratio, results)
    _per_layer(by_layer, results)
    return _finish(figure, path, title)


def _hit_rate_vs_ratio(axes, results: Results) -> None:
    for policy, by_ratio in results.items():
        ratios = sorted(by_ratio)
        axes.plot(ratios, [100 * by_ratio[r]["hit_rate"] for r in ratios], marker="o", label=policy)
    axes.set(xlabel="cache ratio (device slots / routed experts)", ylabel="hit rate (%)", ylim=(0, 100),
             title="hit rate vs cache ratio")
    _grid(axes)


def _per_layer(axes, results: Results) -> None:
    ratio = min(r for by_ratio in results.values() for r in by_ratio)
    for policy, by_ratio in results.items():
        layers = by_ratio[ratio]["per_layer_hit_rate"]
        axes.plot(range(len(layers)), [100 * h for h in layers], marker=".", label=policy)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set(xlabel="MoE layer", ylabel="hit rate (%)", ylim=(0, 100),
             title=f"per-layer hit rate at cache ratio {ratio:g}")
    _grid(axes)


def _grid(axes) -> None:
    axes.grid(alpha=0.3)
    axes.legend()


Scaling = dict[str, dict[float, dict[int, dict]]]  # policy -> cache ratio -> number of ranks -> figures


def plot_scaling(results: Scaling, path: str | os.PathLike, title: str = "") -> Path:
    """Two panels: TPOT (and all-resident TPOT) against the number of ranks; each rank's hit rate."""
    figure, (tpot, hits) = plt.subplots(1, 2, figsize=(12, 4.5))
    for axes in (tpot, hits):
        axes.set_xscale("log", base=2)
    for policy, by_ratio in results.items():
        for ratio, by_ranks in by_ratio.items():
            _scaling_lines(tpot, hits, by_ranks, f"{policy} @ {ratio:g}")
    tpot.set(xlabel="ranks (one GPU each)", ylabel="TPOT (ms)", title="TPOT vs ranks", yscale="log")
    hits.set(xlabel="ranks (one GPU each)", ylabel="hit rate (%)", title="hit rate of each rank", ylim=(0, 100))
    for axes in (tpot, hits):
        axes.minorticks_off()
        _grid(axes)
    return _finish(figure, path, title)


def _scaling_lines(tpot, hits, by_ranks: dict[int, dict], label: str) -> None:
    worlds = sorted(by_ranks)
    line, = tpot.plot(worlds, [by_ranks[w]["tpot_ms"] for w in worlds], marker="o", label=label)
    tpot.plot(worlds, [by_ranks[w]["resident_tpot_ms"] for w in worlds], linestyle="--", color=line.get_color(),
              label=f"{label}, all resident")
    points = [(w, 100 * rank["hit_rate"]) for w in worlds for rank in by_ranks[w]["ranks"]]
    hits.scatter(*zip(*points), color=line.get_color(), s=12, label=label)
    hits.plot(worlds, [100 * by_ranks[w]["hit_rate"] for w in worlds], color=line.get_color())
    for axes in (tpot, hits):
        axes.set_xticks(worlds, [str(w) for w in worlds])


def _finish(figure, path, title: str | None) -> Path:
    """Titles, lays out and writes the figure (atomically), then closes it."""
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    try:
        with atomic_path(Path(path)) as tmp:
            figure.savefig(tmp, format="png", dpi=110)
        return Path(path)
    finally:
        plt.close(figure)
