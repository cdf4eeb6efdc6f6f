"""Runs one benchmark run in a fresh Python process, optionally under a cgroup memory limit.

A fresh process per run makes peak RSS a run's own. The memory limit is a child cgroup of this
process's memory cgroup, with swap forbidden (`MemoryCgroup.swap_settings`), where the machine allows
creating one: cgroup v2 (`memory.max`; the memory controller delegated to children) or, on a v1
hierarchy, the memory controller's own (`memory.limit_in_bytes`). `cap_support` says why not
otherwise, and the runs go uncapped. A capped run also reports the cgroup's peak usage: the memory
charged to it, which, unlike RSS, leaves out pages of shared libraries that processes outside it
faulted in first. Knows nothing of what a run measures.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Iterator

import moestream
from moestream.bench.engine.spec import RunSpec
from moestream.cgroup import CGROUP_ROOT, PROC_CGROUP, MemoryCgroup, own_cgroup
from moestream.errors import MoestreamError

RUN_TIMEOUT_S = 1800
MIB = 2**20
_names = itertools.count()


class RunFailed(MoestreamError):
    """A run's process failed (or was killed, e.g. by the memory cap); the message says how."""


def cap_support(root: Path = CGROUP_ROOT, proc: Path = PROC_CGROUP) -> str | None:
    """None where a memory-limited child cgroup can be created here, else why not (plainly)."""
    group = own_cgroup(root, proc)
    if group is None:
        return f"no memory cgroup (v2 or v1) under {root}"
    if group.version == 2 and "memory" not in (group.path / "cgroup.subtree_control").read_text().split():
        return f"the memory controller is not delegated to child cgroups of {group.path}"
    try:
        with _child_cgroup(group, 1 << 40):  # a limit written, as a capped run writes one
            return None
    except OSError as error:
        return f"cannot create a memory-limited child cgroup of {group.path}: {error.strerror or error}"


def cap_method() -> str:
    """How a cap is set here ("none" without a memory cgroup)."""
    group = own_cgroup()
    return group.label if group else "none"


@contextmanager
def _child_cgroup(group: MemoryCgroup, limit_bytes: int | None, name: str | None = None):
    path = group.path / (name or f"moestream-bench-{os.getpid()}-{next(_names)}")
    path.mkdir()
    try:
        if limit_bytes is not None:
            (path / group.limit_file).write_text(str(limit_bytes))  # first: v1's memory + swap may not be below it
            for name, value in group.swap_settings(limit_bytes):
                if (path / name).exists():
                    (path / name).write_text(value)
        yield path
    finally:
        _remove(path)


def _remove(path: Path, tries: int = 50) -> None:
    """Removes a child cgroup once the processes killed in it are gone (busy until then)."""
    for _ in range(tries - 1):
        try:
            return path.rmdir()
        except OSError:
            time.sleep(0.1)
    path.rmdir()


def run_isolated(spec: RunSpec, limit_bytes: int | None = None, env: dict[str, str | None] | None = None) -> dict:
    """The run's figures from a fresh process (in a cgroup limited to limit_bytes when given; env: variables
    set in its environment, None removes one)."""
    with tempfile.TemporaryDirectory(prefix="moestream-bench-") as scratch:
        spec_path, out_path = Path(scratch) / "spec.json", Path(scratch) / "out.json"
        spec_path.write_text(RunSpec(**{**spec.__dict__, "scratch_dir": scratch}).to_json())
        command = [sys.executable, "-m", "moestream.bench.engine.child", str(spec_path), str(out_path)]
        env = {name: value for name, value in (os.environ | {"PYTHONPATH": str(Path(moestream.__file__).parents[1])}
                                               | (env or {})).items() if value is not None}
        if limit_bytes is None:
            call(command, env)
            return json.loads(out_path.read_text())
        group = own_cgroup()
        with _child_cgroup(group, limit_bytes) as path:
            call(command, env, path / "cgroup.procs")
            peak = cgroup_peak_mib(path)
        return json.loads(out_path.read_text()) | {"cgroup_peak_mib": peak}


@contextmanager
def rank_cgroups(limits: list[int]) -> Iterator[tuple[str, list[Path]]]:
    """One memory-limited child cgroup per rank (limits[rank] bytes): (the prefix to which a rank appends its
    local rank, for rank_cgroup.py; the cgroups), all removed afterwards."""
    if not limits:
        yield "", []
        return
    group = own_cgroup()
    prefix = f"moestream-ranks-{os.getpid()}-{next(_names)}-"
    with ExitStack() as stack:
        paths = [stack.enter_context(_child_cgroup(group, limit, f"{prefix}{rank}"))
                 for rank, limit in enumerate(limits)]
        yield str(group.path / prefix), paths


def cgroup_peak_mib(path: Path) -> float | None:
    """The memory charged to a cgroup at its peak (MiB), None where the kernel has no such file."""
    peak = _read_int(path / own_cgroup().peak_file)
    return peak and peak / MIB


def call(command: list[str], env: dict, procs: Path | None = None, timeout_s: float = RUN_TIMEOUT_S) -> None:
    """Runs a command to its end (in the cgroup whose cgroup.procs file is `procs`, if given), in a session of
    its own, so that a timeout or Ctrl-C here ends all it started (torchrun's ranks too, whose cgroups can
    then go); RunFailed (its last line of stderr) if it fails."""
    enter = None if procs is None else (lambda: procs.write_text(str(os.getpid())))
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          preexec_fn=enter, start_new_session=True) as proc:
        try:
            _, stderr = proc.communicate(timeout=timeout_s)
        except BaseException as error:
            with suppress(ProcessLookupError):  # its session may have ended meanwhile
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            if isinstance(error, subprocess.TimeoutExpired):
                raise RunFailed(f"no result within {timeout_s:g} s") from None
            raise
    if proc.returncode != 0:
        last = (stderr.strip().splitlines() or ["no output"])[-1]
        killed = " (killed: out of memory under the cap?)" if proc.returncode < 0 else ""
        raise RunFailed(f"exit status {proc.returncode}{killed}: {last}")


def _read_int(path: Path) -> int | None:
    """The integer a cgroup file holds, None where the kernel has no such file."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
