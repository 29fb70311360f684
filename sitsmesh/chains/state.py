"""Pipelines in the state store, swapped into the assembler on every change."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from sitsmesh import logs
from sitsmesh.chains.pipeline import PIPELINE_KIND, InvalidPipeline, Pipeline, pipeline_from
from sitsmesh.errors import NotFoundError
from sitsmesh.state import StateStore

_log = logs.get("sitsmesh.chains.state")


class PipelineState:
    def __init__(self, state: StateStore) -> None:
        self._state = state
        self.pipelines: dict[str, Pipeline] = {}
        self._listeners: list[Callable[[Mapping[str, Pipeline]], None]] = []
        self._revision = -1

    def on_change(self, listener: Callable[[Mapping[str, Pipeline]], None]) -> None:
        self._listeners.append(listener)

    async def refresh(self) -> None:
        revision = await self._state.revision()
        pipelines: dict[str, Pipeline] = {}
        for record in await self._state.list(PIPELINE_KIND):
            try:
                pipelines[record.name] = pipeline_from(record.name, record.body)
            except InvalidPipeline as exc:
                _log.error("stored pipeline is invalid; ignoring it", error=exc.message)
        self.pipelines = pipelines
        self._revision = revision
        for listener in self._listeners:
            listener(pipelines)

    async def watch(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                if await self._state.revision() != self._revision:
                    await self.refresh()
            except Exception as exc:  # a transient store error must not end the watch
                _log.warning("pipeline watch failed", error=str(exc))

    async def apply(self, name: str, body: dict[str, Any], source: str) -> Pipeline:
        pipeline = pipeline_from(name, body, source)
        await self._state.put(PIPELINE_KIND, name, pipeline.to_body())
        await self.refresh()
        return pipeline

    async def get(self, name: str) -> Pipeline:
        record = await self._state.get(PIPELINE_KIND, name)
        if record is None:
            raise NotFoundError(f"pipeline {name} does not exist")
        return pipeline_from(name, record.body)

    async def delete(self, name: str) -> None:
        if not await self._state.delete(PIPELINE_KIND, name):
            raise NotFoundError(f"pipeline {name} does not exist")
        await self.refresh()
