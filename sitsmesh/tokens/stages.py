"""Which pipeline stage a token stream belongs to: its Envoy upstream cluster or route
name, matched against the pipelines' stages as access-log hops are."""

from __future__ import annotations

from collections.abc import Mapping

from sitsmesh.chains.pipeline import Pipeline

UNKNOWN = ("-", "-")


class StageIndex:
    __slots__ = ("_index", "_names")

    def __init__(self) -> None:
        self._index: dict[tuple[str, str], tuple[str, str]] = {}
        self._names: frozenset[tuple[str, str]] = frozenset()

    def set_pipelines(self, pipelines: Mapping[str, Pipeline]) -> None:
        index: dict[tuple[str, str], tuple[str, str]] = {}
        for pipeline in pipelines.values():
            for stage in pipeline.stages:
                if stage.match_key in ("upstream_cluster", "route_name"):
                    index.setdefault((stage.match_key, stage.match_value),
                                     (pipeline.name, stage.name))
        self._index = index
        self._names = frozenset((p.name, stage.name) for p in pipelines.values()
                                for stage in p.stages)

    def has(self, pipeline: str, stage: str) -> bool:
        return (pipeline, stage) in self._names

    def stage_of(self, cluster: str, route: str) -> tuple[str, str]:
        """(pipeline, stage), or ("-", "-") for a stream of no pipeline's stage."""
        index = self._index
        return (index.get(("upstream_cluster", cluster)) or index.get(("route_name", route))
                or UNKNOWN)
