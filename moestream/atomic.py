"""Atomic file writes: write a temporary file beside the target, then os.replace it into place,
so a reader never sees a half-written file and an interrupted write leaves nothing behind. What is
published is readable by others (0644 files, 0755 directories), as a plain write would leave it."""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from moestream.errors import MoestreamError


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yields a temporary path beside `path`; on success it replaces `path`, on error it is removed."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        os.chmod(tmp, 0o644)
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
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.{label}-", dir=out.parent))
    os.chmod(staging, 0o755)  # mkdtemp's 0700 would survive the rename
    return staging


def make_readable(directory: Path) -> None:
    """The files directly in `directory` readable by others (a library may have written them 0600)."""
    for path in directory.iterdir():
        if path.is_file():
            os.chmod(path, 0o644)


def write_json(data, path: str | os.PathLike) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2) + "\n")
    return Path(path)
