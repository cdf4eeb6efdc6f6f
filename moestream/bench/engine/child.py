"""One run of `moestream bench engine`, in a fresh process so that its peak RSS is its own.

`python -m moestream.bench.engine.child SPEC OUT` reads a `RunSpec` (JSON), measures the process
floor (Python + torch + transformers imported, with the family's modeling module, before anything is
loaded), drops the checkpoint from the page cache, loads, drops it again (the dense part shares files
with experts), generates each prompt in turn and writes the figures (JSON) to OUT. `run_spec` is the
same run in this process.

Figures per token are over the decode steps (what TPOT times): an observer snapshots the store's
counters when each prompt's first decode step begins. Stall: on the synchronous path every expert
read happens on the compute thread, so the reader's busy time is the stall; an engine that reports
its own stall (`GenerationMetrics.stall_ms`, async) is taken at its word for the whole run.
Knows no policy by name.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from moestream.bench.engine.spec import RunSpec, peak_rss_mib


def run_spec(spec: RunSpec) -> dict:
    """The run's figures."""
    import torch

    from moestream.bench.engine.baselines import RUNS  # ours and the baselines

    import_model_code(Path(spec.model))
    floor = peak_rss_mib()
    torch.set_num_threads(spec.threads)
    result = RUNS.create(spec.kind).run(spec)
    return result | {"floor_rss_mib": floor, "peak_rss_mib": peak_rss_mib()}


def import_model_code(model: Path) -> None:
    """Imports transformers' modeling module of the checkpoint's family (transformers imports it
    lazily), so that the floor holds all of transformers' code that the run uses."""
    import importlib

    model_type = json.loads((model / "config.json").read_text()).get("model_type", "").replace("-", "_")
    try:
        importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    except ImportError:
        pass  # a family whose module is named otherwise: its import counts above the floor


def main(argv: list[str]) -> int:
    spec_path, out_path = map(Path, argv)
    out_path.write_text(json.dumps(run_spec(RunSpec.from_json(spec_path.read_text()))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
