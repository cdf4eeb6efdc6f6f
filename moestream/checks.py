"""Refusals that the commands and the benches share, made before any heavy import: a flag's value below
its bound, a checkpoint path that is no checkpoint directory, the serve extra not installed, a server
that is not on this machine. Each is one MoestreamError line that names the flag; knows no command."""

from __future__ import annotations

from pathlib import Path

from moestream.errors import CheckpointError, MoestreamError

LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}


def at_least(least, values: dict, strict: bool = False) -> None:
    """Refuses a flag (key) whose value is below `least` (strict: not above it); None is not given."""
    for flag, value in values.items():
        if value is not None and not (value > least if strict else value >= least):
            raise MoestreamError(f"{flag} must be {'>' if strict else '>='} {least}, got {value}")


def require_checkpoint_dir(path: Path) -> None:
    """Refuses a checkpoint path that is not a directory with a config.json (no heavy imports)."""
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path} is a file: pass the checkpoint's directory")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"no config.json in checkpoint directory {path}")


def require_serve_extra() -> None:
    """Refuses in one line when the server's libraries (the `serve` extra) are not installed."""
    import importlib.util

    missing = [name for name in ("fastapi", "uvicorn", "prometheus_client", "httpx")
               if importlib.util.find_spec(name) is None]
    if missing:
        raise MoestreamError(f"this command needs the serve extra: pip install 'moestream[serve]' "
                             f"({', '.join(missing)} missing)")


def check_loopback(url: str, refusal: str = "loadgen only targets") -> None:
    """Refuses a URL whose host is not this machine; `refusal` begins the message (the command's words)."""
    from urllib.parse import urlparse

    host = urlparse(url).hostname
    if host not in LOOPBACK_HOSTS:
        raise MoestreamError(f"{refusal} servers on this machine (127.0.0.1, localhost, ::1), not {host!r}")
