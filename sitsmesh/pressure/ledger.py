"""Thresholds in the state store: validated, persisted, audited, followed by every process."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sitsmesh import logs
from sitsmesh.pressure.thresholds import (
    AUDIT_KIND,
    THRESHOLDS_KIND,
    InvalidThresholds,
    Thresholds,
    thresholds_from,
)
from sitsmesh.state import StateStore
from sitsmesh.state.watch import RevisionFollower

_log = logs.get("sitsmesh.pressure")
AUDIT_KEEP = 1000


@dataclass(frozen=True, slots=True)
class Change:
    pipeline: str
    actor: str
    peer: str
    at: float
    before: Mapping[str, Any] | None
    after: Mapping[str, Any]


class ThresholdLedger(RevisionFollower):
    def __init__(self, state: StateStore, clock: Callable[[], float] = time.time) -> None:
        super().__init__(state)
        self._clock = clock
        self.thresholds: dict[str, Thresholds] = {}
        self._listeners: list[Callable[[Mapping[str, Thresholds]], None]] = []
        self._sequence = 0

    def on_change(self, listener: Callable[[Mapping[str, Thresholds]], None]) -> None:
        self._listeners.append(listener)

    async def _rebuild(self) -> None:
        found: dict[str, Thresholds] = {}
        for record in await self._state.list(THRESHOLDS_KIND):
            try:
                found[record.name] = thresholds_from(record.body, f"stored {record.name}")
            except InvalidThresholds as exc:
                _log.error("stored thresholds are invalid; using defaults", error=exc.message)
        self.thresholds = found
        for listener in self._listeners:
            listener(found)

    async def get(self, pipeline: str) -> tuple[Thresholds, bool]:
        """(thresholds, whether they are the defaults because none were set)."""
        record = await self._state.get(THRESHOLDS_KIND, pipeline)
        if record is None:
            return Thresholds(), True
        return thresholds_from(record.body, f"stored {pipeline}"), False

    async def set(self, pipeline: str, body: Mapping[str, Any], *, source: str, actor: str,
                  peer: str, dry_run: bool = False) -> Thresholds:
        """Validate; unless dry_run, persist and write an audit entry of who changed what."""
        parsed = thresholds_from(body, source)
        if dry_run:
            return parsed
        before = await self._state.get(THRESHOLDS_KIND, pipeline)
        after = parsed.to_body()
        await self._state.put(THRESHOLDS_KIND, pipeline, after)
        now = self._clock()
        self._sequence += 1
        await self._state.put(AUDIT_KIND, f"{now:017.6f}-{self._sequence:04d}-{pipeline}", {
            "pipeline": pipeline, "actor": actor, "peer": peer, "at": now,
            "before": before.body if before is not None else None, "after": after})
        _log.info("thresholds changed", pipeline=pipeline, actor=actor, peer=peer,
                  before=before.body if before is not None else None, after=after)
        await self.refresh()
        return parsed

    async def changes(self, pipeline: str = "", limit: int = 50) -> list[Change]:
        records = await self._state.list(AUDIT_KIND)  # names sort by time
        items = [Change(r.body["pipeline"], r.body["actor"], r.body["peer"], r.body["at"],
                        r.body["before"], r.body["after"]) for r in reversed(records)]
        if pipeline:
            items = [c for c in items if c.pipeline == pipeline]
        return items[:limit] if limit > 0 else items
