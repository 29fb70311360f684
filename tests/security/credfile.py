"""A `--admin-credentials` file for tests that run a real server with several teams."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from sitsmesh.access.credentials import hash_token
from sitsmesh.dev import harness


def entry(name: str, role: str, token: str,
          scopes: Mapping[str, Sequence[str]] | None = None) -> dict[str, Any]:
    """One credential: `token` is stored as its hash, as the README says to."""
    found: dict[str, Any] = {"name": name, "role": role, "token_hash": hash_token(token)}
    if scopes is not None:
        found["scopes"] = {kind: list(names) for kind, names in scopes.items()}
    return found


def write(directory: Path, *entries: dict[str, Any]) -> Path:
    """The file, in `directory`; its path for `--admin-credentials`."""
    path = directory / "credentials.yaml"
    path.write_text(json.dumps({"credentials": list(entries)}))
    return path


@contextlib.contextmanager
def serving(directory: Path, *entries: dict[str, Any],
            args: Sequence[str] = ()) -> Iterator[harness.Sitsmesh]:
    """A real `sitsmesh serve` with these credentials (and `args`), killed on exit."""
    started = harness.start_sitsmesh(directory, "--admin-credentials",
                                     str(write(directory, *entries)), *args)
    try:
        yield started
    finally:
        started.kill()
