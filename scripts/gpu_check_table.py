"""The table of a gpu-check run: every `bench engine` run of $OUT/bench-engine-*.json (plain transformers right
after our all-resident run, with the comparison of the two; host bytes per token beside disk bytes where a
--host-budget was given), and each step's exit status.

Usage: python3 scripts/gpu_check_table.py OUT_DIR [--out table.md]. Prints Markdown; needs only the standard
library, so a failed step leaves the others' figures readable.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

COLUMNS = ("budget", "policy", "mode", "TTFT ms", "TPOT ms", "steady TPOT ms", "stall ms/tok", "hit rate", "MB/tok",
           "host MB/tok", "on host", "slots d+h", "limit ms", "TPOT/limit", "peak RSS MiB")


def _cell(value, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def run_row(run: dict, resident: bool = False) -> list[str]:
    limit, host, slots = run.get("limit_tpot_ms"), run.get("host_bytes_per_token"), run.get("device_slots")
    return ["all resident" if resident else f"{run['budget']:.0%}", run["policy"], run["mode"], _cell(run["ttft_ms"], "{:.1f}"),
            _cell(run["tpot_ms"], "{:.1f}"), _cell(run.get("steady_tpot_ms"), "{:.1f}"),
            _cell(run["stall_ms_per_token"], "{:.1f}"), _cell(run["hit_rate"], "{:.1%}"),
            _cell(run["bytes_per_token"] / 1e6, "{:.0f}"), _cell(host and host / 1e6, "{:.0f}"),
            _cell(run.get("host_compute_share"), "{:.0%}"), "-" if slots is None else f"{slots}+{run.get('host_slots')}", _cell(limit, "{:.1f}"),
            _cell(limit and run["tpot_ms"] / limit, "{:.2f}"), _cell(run["peak_rss_mib"], "{:.0f}")]


def plain_line(document: dict) -> list[str]:
    """bench engine's comparison of its all-resident run with plain transformers, where it ran."""
    plain = document.get("transformers")
    if not plain:
        return []
    ratio, same = plain.get("ratio"), plain.get("same_tokens")
    tokens = {True: "same tokens", False: "DIFFERENT tokens", None: "tokens not compared (replayed routing)"}[same]
    ours, theirs = (_cell(plain.get(key), "{:.2f}") for key in ("resident_steady_tpot_ms", "transformers_steady_tpot_ms"))
    return [f"- all resident / plain transformers ({plain.get('dtype')}, {plain.get('experts_implementation')}), "
            f"steady TPOT after {plain.get('warmup_steps')} warm-up steps: {ours} / {theirs} ms = "
            f"{_cell(ratio, '{:.2f}x')}; {tokens}"]


def document_lines(path: Path, document: dict) -> list[str]:
    lines = [f"### {path.name}", "",
             f"checkpoint {document['model']}: {document.get('checkpoint', '?')}; device {document.get('device', '?')}; "
             f"replayed routing: {document.get('replay_routing') or 'no'}; {document.get('prompts', '?')} prompt(s) x "
             f"{document['max_new_tokens']} new tokens; cold O_DIRECT read {document['disk_bw_gbps']:.2f} GB/s; "
             f"dense part {document['dense_mib']:.0f} MiB; process floor {document['floor_rss_mib']:.0f} MiB"
             + (f"; host budget {document['host_budget']} ({document['host_budget_mib']:.0f} MiB), host -> device "
                f"copy {document['h2d_gbps']:.2f} GB/s" if document.get("host_budget_mib") else ""), "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    resident, *offloaded = document["runs"]  # bench engine's first run: every expert resident
    runs = sorted(offloaded, key=lambda r: (r["mode"] != "plain", r["budget"], r["policy"], r["mode"]))
    lines += ["| " + " | ".join(run_row(run, run is resident or run["mode"] == "plain")) + " |"
              for run in [resident, *runs]]
    lines += plain_line(document)
    lines += [f"- skipped {s['policy']} {s['mode']} at {s['budget']}: {s['reason']}" for s in document["skipped"]]
    return lines + [""]


def table(out: Path) -> str:
    lines = ["# gpu-check", ""]
    steps = out / "steps.tsv"
    if steps.is_file():
        rows = [line.split("\t") for line in steps.read_text().splitlines() if line.strip()]
        lines += ["| " + " | ".join(row) + " |" for row in rows[:1]] + ["|---|---|---|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows[1:]] + [""]
    for path in sorted(out.glob("bench-engine-*.json")):
        try:
            lines += document_lines(path, json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as error:
            lines += [f"### {path.name}: unreadable ({error})", ""]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the gpu-check output folder")
    parser.add_argument("--out", dest="table", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    text = table(args.out)
    print(text)
    if args.table:
        args.table.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
