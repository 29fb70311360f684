"""The reference's walk of the descriptor tree: which node a descriptor matches, and the
counter and stats keys that match names (envoyproxy/ratelimit's GetLimit)."""

from __future__ import annotations

from collections.abc import Sequence

from sitsmesh.ratelimit.config import Node


def match(root: Node, entries: Sequence[tuple[str, str]]
          ) -> tuple[Node | None, list[str], list[str] | None]:
    """The node whose rules apply, the counter key's parts (share_threshold patterns in
    place of values), and, where a node on the path has `value_to_metric`, the stats
    key's parts; reference matching order."""
    level = root
    parts: list[str] = []
    path: list[tuple[Node, str, str, str]] = []  # (node, how it matched, key, value)
    found: Node | None = None
    last = len(entries) - 1
    for i, (key, value) in enumerate(entries):
        exact = f"{key}_{value}"
        node, how = step(level, key, exact)
        if node is None:
            return None, parts, None
        parts.append(node.pattern if node.share_threshold else exact)
        path.append((node, how, key, value))
        if i == last:
            found = node
        elif not node.children:
            return None, parts, None  # the request is deeper than the config
        level = node
    named = ([_stats_part(*step) for step in path]
             if any(step[0].value_to_metric for step in path) else None)
    return found, parts, named


def step(level: Node, key: str, exact: str) -> tuple[Node | None, str]:
    """The child of `level` an entry reaches (`exact` is its `key_value`), and how:
    by exact value, then by wildcard in config order, then by key alone."""
    node = level.children.get(exact)
    if node is not None:
        return node, "exact"
    for pattern, candidate in level.wildcards:
        if pattern.matches(exact):
            return candidate, "wildcard"
    return level.children.get(key), "key"


def _stats_part(node: Node, how: str, key: str, value: str) -> str:
    """One level of a value_to_metric stats key, as envoyproxy/ratelimit names it."""
    if how == "exact" or (how == "wildcard" and node.share_threshold):
        return node.pattern
    if node.value_to_metric:
        return f"{key}_{value}" if value else key
    return node.pattern


def detailed_key(domain: str, entries: Sequence[tuple[str, str]], parts: list[str]) -> str:
    """detailed_metric's stats key as the reference builds it: every request entry's
    key_value, whichever node matched; a share_threshold pattern keeps its pattern (and
    then an empty value writes the key alone)."""
    exact = [f"{key}_{value}" for key, value in entries]
    if parts == exact:
        return f"{domain}." + ".".join(exact)
    return f"{domain}." + ".".join(
        part if part != whole else (whole if value else key)
        for part, whole, (key, value) in zip(parts, exact, entries, strict=True))
