"""Which pipeline stage a token stream belongs to: its Envoy upstream cluster or route
name, matched against the pipelines' stages as access-log hops are; and the stall
threshold the stage configured, if it did."""

from __future__ import annotations

from collections.abc import Mapping

from sitsmesh.chains.pipeline import Pipeline

UNKNOWN = ("-", "-")


class StageIndex:
    __slots__ = ("_index", "_names", "_stall_s")

    def __init__(self) -> None:
        self._index: dict[tuple[str, str], tuple[str, str]] = {}
        self._names: frozenset[tuple[str, str]] = frozenset()
        self._stall_s: dict[tuple[str, str], float] = {}

    def set_pipelines(self, pipelines: Mapping[str, Pipeline]) -> None:
        index: dict[tuple[str, str], tuple[str, str]] = {}
        stall_s: dict[tuple[str, str], float] = {}
        for pipeline in pipelines.values():
            for stage in pipeline.stages:
                if stage.match_key in ("upstream_cluster", "route_name"):
                    index.setdefault((stage.match_key, stage.match_value),
                                     (pipeline.name, stage.name))
                if stage.stall_ms is not None:
                    stall_s[pipeline.name, stage.name] = stage.stall_ms / 1000
        # Each built whole, then swapped: a reader sees the old set or the new one.
        self._index, self._stall_s = index, stall_s
        self._names = frozenset((p.name, stage.name) for p in pipelines.values()
                                for stage in p.stages)

    @property
    def names(self) -> frozenset[tuple[str, str]]:
        """Every (pipeline, stage); a new object after each change."""
        return self._names

    def has(self, pipeline: str, stage: str) -> bool:
        return (pipeline, stage) in self._names

    def stage_of(self, cluster: str, route: str) -> tuple[str, str]:
        """(pipeline, stage), or ("-", "-") for a stream of no pipeline's stage."""
        index = self._index
        return (index.get(("upstream_cluster", cluster)) or index.get(("route_name", route))
                or UNKNOWN)

    def configured_stall_s(self, key: tuple[str, str]) -> float | None:
        """The stage's `stall_ms` in seconds; None where it left it to be learned."""
        return self._stall_s.get(key)
