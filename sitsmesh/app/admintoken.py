"""The admin bearer token: from the environment, or a 0600 file in the state dir."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

from sitsmesh.errors import ConfigError, StartupError

TOKEN_ENV = "SITSMESH_ADMIN_TOKEN"  # noqa: S105 - the variable's name, not a secret


def read_token(path: Path) -> str:
    try:
        token = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise ConfigError(f"{path}: admin token file does not exist") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read admin token: {exc.strerror or exc}") from None
    if not token:
        raise ConfigError(f"{path}: admin token file is empty")
    return token


def load_or_create(path: Path, env: Mapping[str, str]) -> tuple[str, bool]:
    """Return (token, created). Creates the file once, atomically, with mode 0600."""
    from_env = env.get(TOKEN_ENV, "").strip()
    if from_env:
        return from_env, False
    try:
        if path.exists():
            return read_token(path), False
    except OSError as exc:
        raise StartupError(f"{path}: cannot write admin token: {exc.strerror or exc}") from None
    token = secrets.token_urlsafe(32)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(token + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        try:
            # link() fails if another process created the file first; theirs wins.
            os.link(tmp, path)
        except FileExistsError:
            return read_token(path), False
        _fsync_dir(path.parent)
    except OSError as exc:
        raise StartupError(f"{path}: cannot write admin token: {exc.strerror or exc}") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return token, True


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
