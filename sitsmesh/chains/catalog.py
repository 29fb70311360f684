"""Pipelines in the state store, swapped into the assembler on every change."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from sitsmesh import logs
from sitsmesh.chains.pipeline import PIPELINE_KIND, InvalidPipeline, Pipeline, pipeline_from
from sitsmesh.errors import NotFoundError
from sitsmesh.state import StateStore
from sitsmesh.state.watch import RevisionFollower

_log = logs.get("sitsmesh.chains.catalog")


class PipelineCatalog(RevisionFollower):
    def __init__(self, state: StateStore) -> None:
        super().__init__(state)
        self.pipelines: dict[str, Pipeline] = {}
        self._listeners: list[Callable[[Mapping[str, Pipeline]], None]] = []

    def on_change(self, listener: Callable[[Mapping[str, Pipeline]], None]) -> None:
        self._listeners.append(listener)

    async def _rebuild(self) -> None:
        pipelines: dict[str, Pipeline] = {}
        for record in await self._state.list(PIPELINE_KIND):
            try:
                pipelines[record.name] = pipeline_from(record.name, record.body)
            except InvalidPipeline as exc:
                _log.error("stored pipeline is invalid; ignoring it", error=exc.message)
        self.pipelines = pipelines
        for listener in self._listeners:
            listener(pipelines)

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
