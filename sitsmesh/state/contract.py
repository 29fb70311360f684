"""The state-store contract, apart from any implementation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sitsmesh.errors import ConflictError


@dataclass(frozen=True, slots=True)
class Record:
    kind: str
    name: str
    body: dict[str, Any]
    # Store-wide revision of the write that produced this version of the record.
    revision: int
    updated_at: float


# expect_revision=ABSENT: the write creates the record, and fails if it exists by then
# (revisions start at 1, so no stored record is ever at 0).
ABSENT = 0


@dataclass(frozen=True, slots=True)
class Put:
    kind: str
    name: str
    body: dict[str, Any]
    expect_revision: int | None = None


def check_expected(kind: str, name: str, stored: int | None, expected: int | None) -> None:
    """Every backend's expect_revision rule: ConflictError unless the stored revision is
    the expected one (ABSENT: no stored record)."""
    if expected is None:
        return
    if expected == ABSENT:
        if stored is not None:
            raise ConflictError(f"{kind} '{name}' exists (at revision {stored}), expected none")
    elif stored != expected:
        current = "absent" if stored is None else f"at revision {stored}"
        raise ConflictError(f"{kind} '{name}' is {current}, not at revision {expected}")


@dataclass(frozen=True, slots=True)
class Delete:
    kind: str
    name: str


class StateStore(Protocol):
    """Documents grouped by kind. Every acknowledged write is durable and bumps the revision."""

    async def get(self, kind: str, name: str) -> Record | None: ...

    async def list(self, kind: str) -> list[Record]: ...

    async def create(self, kind: str, name: str, body: dict[str, Any]) -> Record:
        """Insert; raises ConflictError if the record exists."""
        ...

    async def put(
        self, kind: str, name: str, body: dict[str, Any], *, expect_revision: int | None = None
    ) -> Record:
        """Upsert. With expect_revision, raises ConflictError unless the stored record has it
        (ABSENT: unless there is none)."""
        ...

    async def delete(self, kind: str, name: str) -> bool: ...

    async def apply(self, writes: Sequence[Put | Delete]) -> int:
        """Every write in one transaction, or none (ConflictError on a failed expected
        revision; NotFoundError when a Delete finds nothing). Returns the revision."""
        ...

    async def revision(self) -> int: ...

    async def wait_for_change(self, after: int, within_s: float) -> int:
        """The revision once it differs from `after`, or after `within_s` seconds (then it
        may still equal `after`). Raises like `revision()` when the store is unreachable."""
        ...

    async def close(self) -> None: ...
