"""Runs one benchmark run in a fresh Python process, optionally under a cgroup v2 memory limit.

A fresh process per run makes peak RSS a run's own. The memory limit is a child cgroup of this
process's cgroup with `memory.max` set, where the machine allows creating one (a cgroup v2
hierarchy, the memory controller delegated to children, a writable cgroup); `cap_support` says why
not otherwise, and the runs go uncapped. Knows nothing of what a run measures.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import moestream
from moestream.bench.engine.spec import RunSpec

CGROUP_ROOT = Path("/sys/fs/cgroup")
RUN_TIMEOUT_S = 1800
_names = itertools.count()


class RunFailed(Exception):
    """A run's process failed (or was killed, e.g. by the memory cap); the message says how."""


def own_cgroup() -> Path | None:
    """This process's cgroup v2 directory, or None without a unified hierarchy."""
    if not (CGROUP_ROOT / "cgroup.controllers").is_file():
        return None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return CGROUP_ROOT / line[3:].lstrip("/")
    return None


def cap_support() -> str | None:
    """None where a memory-limited child cgroup can be created here, else why not (plainly)."""
    group = own_cgroup()
    if group is None:
        return f"no cgroup v2 hierarchy at {CGROUP_ROOT} (cgroup v1 or none)"
    if "memory" not in (group / "cgroup.subtree_control").read_text().split():
        return f"the memory controller is not delegated to child cgroups of {group}"
    try:
        with _child_cgroup(group, None):
            return None
    except OSError as error:
        return f"cannot create a child cgroup of {group}: {error.strerror or error}"


@contextmanager
def _child_cgroup(group: Path, limit_bytes: int | None):
    path = group / f"moestream-bench-{os.getpid()}-{next(_names)}"
    path.mkdir()
    try:
        if limit_bytes is not None:
            (path / "memory.max").write_text(str(limit_bytes))
            if (path / "memory.swap.max").exists():
                (path / "memory.swap.max").write_text("0")
        yield path
    finally:
        path.rmdir()


def run_isolated(spec: RunSpec, limit_bytes: int | None = None) -> dict:
    """The run's figures from a fresh process (in a cgroup limited to limit_bytes when given)."""
    with tempfile.TemporaryDirectory(prefix="moestream-bench-") as scratch:
        spec_path, out_path = Path(scratch) / "spec.json", Path(scratch) / "out.json"
        spec_path.write_text(RunSpec(**{**spec.__dict__, "scratch_dir": scratch}).to_json())
        command = [sys.executable, "-m", "moestream.bench.engine.child", str(spec_path), str(out_path)]
        env = os.environ | {"PYTHONPATH": str(Path(moestream.__file__).parents[1])}
        if limit_bytes is None:
            _call(command, env)
        else:
            with _child_cgroup(own_cgroup(), limit_bytes) as group:
                _call(command, env, group / "cgroup.procs")
        return json.loads(out_path.read_text())


def _call(command: list[str], env: dict, procs: Path | None = None) -> None:
    enter = None if procs is None else (lambda: procs.write_text(str(os.getpid())))
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                              preexec_fn=enter)
    except subprocess.TimeoutExpired:
        raise RunFailed(f"no result within {RUN_TIMEOUT_S} s") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        killed = " (killed: out of memory under the cap?)" if done.returncode < 0 else ""
        raise RunFailed(f"exit status {done.returncode}{killed}: {last}")
