"""The persisted history of a swap: one record per swap, rewritten at every step.

A record that says `running` when sitsmesh starts belongs to a process that
died mid-swap; `mark_interrupted` closes it so the history stays true and the
model is free for the next swap.
"""

from __future__ import annotations

import secrets
from dataclasses import asdict, dataclass, field
from typing import Any

from sitsmesh.errors import NotFoundError
from sitsmesh.state import StateStore

SWAP_KIND = "swap"
RUNNING, SUCCEEDED, FAILED, ROLLED_BACK, INTERRUPTED = (
    "running", "succeeded", "failed", "rolled_back", "interrupted")


@dataclass(slots=True)
class Step:
    phase: str
    state: str                    # running, ok, failed, skipped
    started_at: float
    ended_at: float | None = None
    message: str = ""
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class SwapRecord:
    id: str
    model: str
    endpoint: str
    to_version: int
    from_version: int | None = None
    state: str = RUNNING
    phase: str = "precheck"
    error: str = ""
    started_at: float = 0.0
    ended_at: float | None = None
    steps: list[Step] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)

    def to_body(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> SwapRecord:
        data = dict(body)
        data["steps"] = [Step(**s) for s in data.get("steps", [])]
        return cls(**data)

    def step(self, phase: str) -> Step | None:
        for step in reversed(self.steps):
            if step.phase == phase:
                return step
        return None


def new_id() -> str:
    return "swp_" + secrets.token_hex(6)


class SwapHistory:
    def __init__(self, state: StateStore) -> None:
        self._state = state

    async def save(self, record: SwapRecord) -> None:
        await self._state.put(SWAP_KIND, record.id, record.to_body())

    async def get(self, swap_id: str) -> SwapRecord:
        stored = await self._state.get(SWAP_KIND, swap_id)
        if stored is None:
            raise NotFoundError(f"swap {swap_id} does not exist")
        return SwapRecord.from_body(stored.body)

    async def recent(self, model: str = "", limit: int = 50) -> list[SwapRecord]:
        records = [SwapRecord.from_body(r.body) for r in await self._state.list(SWAP_KIND)]
        if model:
            records = [r for r in records if r.model == model]
        records.sort(key=lambda r: r.started_at, reverse=True)
        return records[:limit] if limit > 0 else records

    async def mark_interrupted(self, now: float) -> list[SwapRecord]:
        """Close every `running` record: its process is gone. Returns those records."""
        closed = []
        for record in await self.recent(limit=0):
            if record.state != RUNNING:
                continue
            record.state = INTERRUPTED
            record.error = (f"sitsmesh stopped during {record.phase}; the swap did not "
                            "finish. Check the model's versions before the next swap")
            record.ended_at = now
            for step in record.steps:
                if step.state == "running":
                    step.state, step.ended_at = "failed", now
                    step.message = "interrupted"
            await self.save(record)
            closed.append(record)
        return closed
