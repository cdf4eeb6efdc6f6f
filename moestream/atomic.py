"""Atomic file writes: write a temporary file beside the target, then os.replace it into place,
so a reader never sees a half-written file and an interrupted write leaves nothing behind. What is
published gets the permissions a plain write would leave under the process's umask (0644 files and
0755 directories under the usual 022), not the 0600/0700 of temporary files."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from moestream.errors import MoestreamError
from moestream.procfs import status_field


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yields a temporary path beside `path`; on success it replaces `path`, on error it is removed."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        os.chmod(tmp, 0o666 & ~_umask())
    except OSError as error:
        raise MoestreamError(f"cannot write {path}: {error.strerror or error}") from None
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except OSError as error:
        Path(tmp).unlink(missing_ok=True)
        raise MoestreamError(f"cannot write {path}: {error.strerror or error}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def staging_dir(out: Path, label: str) -> Path:
    """A fresh directory beside `out` to fill and then rename into place."""
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.{label}-", dir=out.parent))
    except OSError as error:
        raise MoestreamError(f"cannot write beside {out}: {error.strerror or error}") from None
    try:
        os.chmod(staging, 0o777 & ~_umask())  # mkdtemp's 0700 would survive the rename
    except OSError as error:
        staging.rmdir()
        raise MoestreamError(f"cannot write beside {out}: {error.strerror or error}") from None
    return staging


def check_output_file(path: Path | None, flag: str) -> None:
    """Refuses an output file (`flag`) that is a folder or whose folder does not exist: a typo is named at once."""
    if path is None:
        return
    if path.is_dir():
        raise MoestreamError(f"{flag} {path} is a folder: name the file to write")
    if not path.parent.is_dir():
        raise MoestreamError(f"{flag} {path}: folder {path.parent} does not exist")


def check_empty_dir(out: Path, error: type[MoestreamError] = MoestreamError, name: str = "output") -> None:
    """Refuses an `out` that exists and is not an empty directory (named `name` in the message)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise error(f"{name} {out} already exists and is not an empty directory")


def publish_dir(out: Path, write: Callable[[Path], None], error: type[MoestreamError] = MoestreamError,
                name: str = "output") -> Path:
    """Fills a staging directory with write(staging), then renames it to `out` (absent or empty): whole or untouched."""
    check_empty_dir(out, error, name)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_dir(out, "partial")
    try:
        write(staging)
        make_readable(staging)
        check_empty_dir(out, error, name)
        if out.exists():
            out.rmdir()
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def make_readable(directory: Path) -> None:
    """The files directly in `directory` as a plain write leaves them (a library may write them 0600)."""
    mode = 0o666 & ~_umask()
    for path in directory.iterdir():
        if path.is_file():
            os.chmod(path, mode)


def _umask() -> int:
    """The process's umask, read without changing it (Linux); 022 elsewhere."""
    value = status_field("Umask")
    return 0o022 if value is None else int(value, 8)


def write_json(data, path: str | os.PathLike) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2) + "\n")
    return Path(path)
