"""Importer for the DeepSeek-V2-Lite routing npz of the MoE-Beyond study (`experts` [T, L, K] uint8,
`prompt_id` [T], `token_pos` [T], `moe_layer_ids` [L]), and its `<stem>_tokens.jsonl` (one line per prompt:
prompt_id, n_tokens, tokens, text). Each prompt is teacher-forced text whose routing is causal, so every
token is stored with is_prefill=False (the source does not record where a prompt would end). Knows the
file layout only; `format.load_trace` decides when to call it."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Mapping

import numpy as np

from moestream.errors import TraceError
from moestream.topology import Topology
from moestream.trace.schema import Trace

log = logging.getLogger(__name__)

REQUIRED_ARRAYS = ("experts", "prompt_id", "token_pos", "moe_layer_ids")
NUM_EXPERTS = 64
NUM_SHARED_EXPERTS = 2
EXPERT_BYTES = 3 * 2048 * 1408 * 2  # gate, up and down projections in bf16


def trace_from_arrays(arrays: Mapping[str, np.ndarray], path: Path, tokens_path=None) -> Trace:
    experts, prompt_ids, positions = arrays["experts"], arrays["prompt_id"], arrays["token_pos"]
    layer_ids = arrays["moe_layer_ids"]
    if experts.ndim != 3 or layer_ids.ndim != 1 or experts.shape[1] != len(layer_ids):
        raise TraceError(f"experts has shape {experts.shape}, moe_layer_ids lists {layer_ids.shape} layers")
    _check_rows(experts, prompt_ids, positions)
    try:  # DeepSeek-V2-Lite: 64 routed experts per MoE layer plus 2 shared ones, bf16
        topology = Topology(moe_layer_ids=tuple(int(i) for i in layer_ids), num_experts=NUM_EXPERTS,
                            top_k=experts.shape[2], expert_bytes=EXPERT_BYTES, num_shared_experts=NUM_SHARED_EXPERTS)
    except ValueError as error:
        raise TraceError(f"DeepSeek npz does not fit DeepSeek-V2-Lite ({error})") from None
    if experts.size and int(experts.max()) >= topology.num_experts:
        raise TraceError(f"expert ids reach {int(experts.max())}, DeepSeek-V2-Lite has {topology.num_experts} experts")
    seqs = prompt_ids.astype(np.int32)
    tokens, texts = _read_tokens(path, tokens_path, seqs)
    return Trace(topology=topology, experts=experts.astype(np.int16), seq_ids=seqs,  # experts [T, L, K]
                 positions=positions.astype(np.int32), is_prefill=np.zeros(len(seqs), dtype=bool), tokens=tokens,
                 texts=texts, source=f"deepseek-v2-lite:{path.name}")


def _check_rows(experts: np.ndarray, prompt_ids: np.ndarray, positions: np.ndarray) -> None:
    n = len(experts)
    for name, values in (("prompt_id", prompt_ids), ("token_pos", positions)):
        if values.shape != (n,) or values.dtype.kind not in "iu":
            raise TraceError(f"{name} must be {n} integers, found shape {values.shape} {values.dtype}")
    if experts.dtype.kind not in "iu":
        raise TraceError(f"experts must hold integers, found {experts.dtype}")
    starts = np.r_[True, prompt_ids[1:] != prompt_ids[:-1]] if n else np.zeros(0, bool)
    if int(starts.sum()) != len(np.unique(prompt_ids)):
        raise TraceError("tokens are not grouped by prompt_id")
    if n and np.any(np.diff(positions)[~starts[1:]] <= 0):
        raise TraceError("token_pos does not increase within a prompt")


def _read_tokens(path: Path, tokens_path, seq_ids: np.ndarray) -> tuple[list[str] | None, dict[int, str]]:
    if tokens_path is None:
        tokens_path = path.with_name(f"{path.stem}_tokens.jsonl")
        if not tokens_path.exists():
            log.info("no tokens file %s: trace has no token strings", tokens_path)
            return None, {}
    tokens_path = Path(tokens_path)
    if not tokens_path.is_file():
        raise TraceError(f"tokens file not found: {tokens_path}")
    records = read_tokens_jsonl(tokens_path)
    ids, counts = np.unique(seq_ids, return_counts=True)
    lengths = dict(zip(ids.tolist(), counts.tolist()))
    missing, extra = sorted(set(lengths) - set(records)), sorted(set(records) - set(lengths))
    if missing or extra:
        raise TraceError(f"{tokens_path} disagrees with the npz: prompts missing from it {missing[:5]}, "
                         f"prompts not in the npz {extra[:5]}")
    for seq, count in lengths.items():
        if len(records[seq][0]) != count:
            raise TraceError(f"{tokens_path} disagrees with the npz: prompt {seq} has {len(records[seq][0])} tokens "
                             f"there, {count} in the npz")
    order = [int(s) for s in seq_ids[np.r_[True, seq_ids[1:] != seq_ids[:-1]]]] if len(seq_ids) else []
    tokens = [token for seq in order for token in records[seq][0]]
    return tokens, {seq: records[seq][1] for seq in order}


def read_tokens_jsonl(path: Path) -> dict[int, tuple[list[str], str]]:
    """prompt_id -> (token strings, text), checking each line's own consistency."""
    records: dict[int, tuple[list[str], str]] = {}
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                seq, count, tokens = int(record["prompt_id"]), int(record["n_tokens"]), record["tokens"]
            except (ValueError, KeyError, TypeError) as error:
                raise TraceError(f"{path}:{number}: not a tokens record ({error})") from None
            if not isinstance(tokens, list) or len(tokens) != count or not all(isinstance(t, str) for t in tokens):
                held = f"{len(tokens)} entries" if isinstance(tokens, list) else type(tokens).__name__
                raise TraceError(f"{path}:{number}: n_tokens is {count} but tokens holds {held}")
            if seq in records:
                raise TraceError(f"{path}:{number}: prompt_id {seq} appears twice")
            records[seq] = (tokens, str(record.get("text", "")))
    return records
