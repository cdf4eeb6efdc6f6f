"""The project's own routing-trace file: a versioned `.npz` archive, written atomically.

`save_trace` writes format "moestream-trace" version 1 (docs/trace-format.md); `load_trace` reads it or a DeepSeek
routing npz (told apart by the archive's entries, never the file name) and checks every array against the
topology; every problem raises TraceError naming the file. Knows the schema and importers, not their consumers."""

from __future__ import annotations

import json
import os
import zipfile
import zlib
from pathlib import Path
from typing import Mapping

import numpy as np

import moestream
from moestream.atomic import atomic_path
from moestream.errors import TraceError
from moestream.topology import Topology
from moestream.trace import deepseek
from moestream.trace.schema import Trace

FORMAT_NAME = "moestream-trace"
FORMAT_VERSION = 1
HEADER_KEY = "moestream_header"
REQUIRED_ARRAYS = ("experts", "seq_ids", "positions", "is_prefill")
FLOAT_ARRAYS = ("gate_weights", "gate_probs", "hidden", "embeddings")
ZIP_MAGIC = b"PK\x03\x04"


def save_trace(trace: Trace, path: str | os.PathLike) -> Path:
    """Write `trace` to `path` (conventionally `*.npz`) atomically; returns the path."""
    path = Path(path)
    header = json.dumps({"format": FORMAT_NAME, "version": FORMAT_VERSION, "topology": trace.topology.to_dict(),
                         "num_tokens": trace.num_tokens, "source": trace.source,
                         "writer": f"moestream {moestream.__version__}"}, sort_keys=True).encode("utf-8")
    arrays = {HEADER_KEY: np.frombuffer(header, dtype=np.uint8)} | _arrays(trace)
    with atomic_path(path) as tmp, open(tmp, "wb") as handle:
        np.savez_compressed(handle, **arrays)
        handle.flush()
        os.fsync(handle.fileno())
    return path


def load_trace(path: str | os.PathLike, tokens_path: str | os.PathLike | None = None) -> Trace:
    """Read a moestream trace or a DeepSeek routing npz (with its `<stem>_tokens.jsonl`)."""
    path = Path(path)
    arrays = read_npz(path)
    if HEADER_KEY in arrays:
        if tokens_path is not None:
            raise TraceError(f"{path}: a tokens file applies only to DeepSeek routing npz files")
        return _checked(path, lambda: _trace_from_arrays(arrays, path))
    if all(name in arrays for name in deepseek.REQUIRED_ARRAYS):
        return _checked(path, lambda: deepseek.trace_from_arrays(arrays, path, tokens_path))
    raise TraceError(f"{path}: unknown trace format (entries: {', '.join(sorted(arrays)) or 'none'}); "
                     f"expected a {FORMAT_NAME} file or a DeepSeek routing npz")


def read_npz(path: Path) -> dict[str, np.ndarray]:
    """Every array of an npz archive, with file problems turned into TraceError."""
    if not path.exists():
        raise TraceError(f"trace file not found: {path}")
    if path.is_dir():
        raise TraceError(f"{path} is a directory, not a trace file")
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as handle:
            start = handle.read(4)
        why = ("empty file, not a trace" if not start else "not an npz (zip) archive" if start != ZIP_MAGIC
               else "truncated or corrupt npz archive (no zip directory at its end)")
        raise TraceError(f"{path}: {why}")
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {name: npz[name] for name in npz.files}
    except (zipfile.BadZipFile, zlib.error, ValueError, OSError, EOFError, KeyError) as error:
        raise TraceError(f"{path}: corrupt npz archive ({error})") from None


def _checked(path: Path, build) -> Trace:
    try:
        return build()
    except TraceError as error:
        raise TraceError(f"{path}: {error}") from None


def _arrays(trace: Trace) -> dict[str, np.ndarray]:
    expert_dtype = np.uint8 if trace.topology.num_experts <= 256 else np.int16
    arrays = {"experts": trace.experts.astype(expert_dtype), "seq_ids": trace.seq_ids.astype(np.int32),  # [N, L, K]
              "positions": trace.positions.astype(np.int32), "is_prefill": trace.is_prefill.astype(bool)}  # [N] each
    if trace.token_ids is not None:
        arrays["token_ids"] = trace.token_ids.astype(np.int32)
    arrays |= {name: value.astype(np.float16) for name in FLOAT_ARRAYS if (value := getattr(trace, name)) is not None}
    if trace.tokens is not None:
        arrays["token_bytes"], arrays["token_offsets"] = pack_strings(trace.tokens)
    if trace.texts:
        seqs = sorted(trace.texts)
        arrays["text_seq_ids"] = np.asarray(seqs, dtype=np.int32)
        arrays["text_bytes"], arrays["text_offsets"] = pack_strings([trace.texts[s] for s in seqs])
    return arrays


def pack_strings(strings: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """UTF-8 bytes of all strings back to back [B] uint8, and their offsets [S+1] int64."""
    encoded = [s.encode("utf-8") for s in strings]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    return np.frombuffer(b"".join(encoded), dtype=np.uint8), offsets


def unpack_strings(data: np.ndarray, offsets: np.ndarray, name: str) -> list[str]:
    if data.ndim != 1 or offsets.ndim != 1 or len(offsets) < 1:
        raise TraceError(f"{name} arrays must be one-dimensional")
    if offsets[0] != 0 or offsets[-1] != len(data) or np.any(np.diff(offsets) < 0):
        raise TraceError(f"{name} offsets do not match its byte array")
    raw = data.astype(np.uint8).tobytes()
    try:
        return [raw[a:b].decode("utf-8") for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
    except UnicodeDecodeError as error:
        raise TraceError(f"{name} is not valid UTF-8 ({error})") from None


def _read_header(arrays: Mapping[str, np.ndarray]) -> dict:
    try:
        header = json.loads(arrays[HEADER_KEY].astype(np.uint8).tobytes().decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise TraceError(f"unreadable {HEADER_KEY} entry ({error})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT_NAME:
        raise TraceError(f"unknown trace format {header.get('format') if isinstance(header, dict) else header!r}")
    version = header.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise TraceError(f"invalid {FORMAT_NAME} version {version!r}")
    if version > FORMAT_VERSION:
        raise TraceError(f"{FORMAT_NAME} version {version} is newer than this moestream reads "
                         f"(up to {FORMAT_VERSION}); upgrade moestream")
    return header


def _trace_from_arrays(arrays: Mapping[str, np.ndarray], path: Path) -> Trace:
    header = _read_header(arrays)
    try:
        topology = Topology.from_dict(header.get("topology"))
    except (TypeError, ValueError) as error:
        raise TraceError(f"invalid topology in header ({error})") from None
    if missing := [name for name in REQUIRED_ARRAYS if name not in arrays]:
        raise TraceError(f"missing required array(s): {', '.join(missing)}")
    n = len(arrays["seq_ids"])
    if header.get("num_tokens", n) != n:
        raise TraceError(f"header says {header['num_tokens']} tokens, seq_ids has {n}")
    check_arrays(arrays, topology, n)
    return Trace(topology=topology, experts=arrays["experts"].astype(np.int16),
                 seq_ids=arrays["seq_ids"].astype(np.int32), positions=arrays["positions"].astype(np.int32),
                 is_prefill=arrays["is_prefill"].astype(bool),
                 token_ids=arrays["token_ids"].astype(np.int32) if "token_ids" in arrays else None,
                 tokens=_tokens(arrays), texts=_texts(arrays), source=str(header.get("source") or path),
                 **{name: arrays[name].astype(np.float16) if name in arrays else None for name in FLOAT_ARRAYS})


def check_arrays(arrays: Mapping[str, np.ndarray], topology: Topology, n: int) -> None:
    """Shapes and dtypes of every array against the topology and the row count n."""
    layers, k, e = topology.num_layers, topology.top_k, topology.num_experts
    expected = {"experts": (n, layers, k), "gate_weights": (n, layers, k), "gate_probs": (n, layers, e)}
    for name, shape in expected.items():
        if name in arrays and arrays[name].shape != shape:
            raise TraceError(f"{name} has shape {arrays[name].shape}, topology and row count say {shape}")
    for name in ("seq_ids", "positions", "is_prefill", "token_ids"):
        if name in arrays and arrays[name].shape != (n,):
            raise TraceError(f"{name} has shape {arrays[name].shape}, expected ({n},)")
    for name, ndim in (("hidden", 3), ("embeddings", 2)):
        if name in arrays and (arrays[name].ndim != ndim or len(arrays[name]) != n):
            raise TraceError(f"{name} has shape {arrays[name].shape}, expected {ndim} dimensions and {n} rows")
    if "hidden" in arrays and arrays["hidden"].shape[1] != layers:
        raise TraceError(f"hidden has {arrays['hidden'].shape[1]} layers, topology has {layers}")
    kinds = dict.fromkeys(("experts", "seq_ids", "positions", "token_ids"), "iu") | dict.fromkeys(FLOAT_ARRAYS, "f")
    for name, kind in kinds.items():
        if name in arrays and arrays[name].dtype.kind not in kind:
            raise TraceError(f"{name} must hold {'integers' if kind == 'iu' else 'floats'}, found {arrays[name].dtype}")
    experts = arrays["experts"]
    if experts.size and (int(experts.min()) < 0 or int(experts.max()) >= e):
        raise TraceError(f"expert ids range over [{int(experts.min())}, {int(experts.max())}], "
                         f"outside the topology's [0, {e - 1}]")


def _tokens(arrays: Mapping[str, np.ndarray]) -> list[str] | None:
    if "token_bytes" not in arrays:
        return None
    if "token_offsets" not in arrays:
        raise TraceError("token_bytes without token_offsets")
    return unpack_strings(arrays["token_bytes"], arrays["token_offsets"], "token_bytes")


def _texts(arrays: Mapping[str, np.ndarray]) -> dict[int, str]:
    if "text_seq_ids" not in arrays:
        return {}
    if "text_bytes" not in arrays or "text_offsets" not in arrays:
        raise TraceError("text_seq_ids without text_bytes/text_offsets")
    texts = unpack_strings(arrays["text_bytes"], arrays["text_offsets"], "text_bytes")
    seqs = arrays["text_seq_ids"].tolist()
    if len(seqs) != len(texts):
        raise TraceError(f"text_seq_ids has {len(seqs)} entries, text_bytes holds {len(texts)} texts")
    return dict(zip(seqs, texts))
