"""envoyproxy/ratelimit's YAML config format, read unchanged, into an immutable snapshot.

Every error names the file and says what is wrong; the wording follows the
reference service where it has one. Extensions beyond the reference:
`algorithm`, `unit_multiplier`, a `rate_limits` list on one descriptor, and
`metadata` returned to Envoy as dynamic metadata when the rule matches.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sitsmesh.errors import ConfigError
from sitsmesh.ratelimit import yamlread


class Unit(enum.IntEnum):
    """Values match envoy.service.ratelimit.v3.RateLimitResponse.RateLimit.Unit."""

    SECOND = 1
    MINUTE = 2
    HOUR = 3
    DAY = 4
    MONTH = 5
    YEAR = 6
    WEEK = 7


UNIT_SECONDS = {Unit.SECOND: 1, Unit.MINUTE: 60, Unit.HOUR: 3600, Unit.DAY: 86400,
                Unit.WEEK: 7 * 86400, Unit.MONTH: 30 * 86400, Unit.YEAR: 365 * 86400}


class Algorithm(enum.Enum):
    FIXED_WINDOW = "fixed_window"
    SLIDING_WINDOW = "sliding_window"
    GCRA = "gcra"


DESCRIPTOR_KEYS = frozenset({"key", "value", "rate_limit", "rate_limits", "descriptors",
                             "shadow_mode", "detailed_metric", "quota_mode",
                             "share_threshold", "value_to_metric", "metadata"})
RATE_LIMIT_KEYS = frozenset({"unit", "requests_per_unit", "unlimited", "name", "replaces",
                             "algorithm", "unit_multiplier", "adaptive", "pipeline"})
ROOT_KEYS = frozenset({"domain", "descriptors"})
MAX_REQUESTS_PER_UNIT = 2**32 - 1
# A domain holds at most this many descriptors (aliases and nesting: see yamlread).
MAX_DESCRIPTORS = 100_000


@dataclass(frozen=True, slots=True)
class Rule:
    """One limit. `stats_key` names it in metrics; `index` tells limits of one node apart."""

    stats_key: str
    requests_per_unit: int
    unit: Unit | None
    window_s: int
    algorithm: Algorithm = Algorithm.FIXED_WINDOW
    unlimited: bool = False
    name: str = ""
    replaces: tuple[str, ...] = ()
    shadow_mode: bool = False
    quota_mode: bool = False
    detailed_metric: bool = False
    index: int = 0
    # adaptive: the limit scales by this pipeline's admitted fraction (backpressure).
    adaptive_pipeline: str = ""


@dataclass(frozen=True, slots=True)
class Wildcard:
    """A final key (`key_value`) with `*`s, each matching any run of characters (none
    included), as envoyproxy/ratelimit matches it: the string starts with the first
    literal part, ends with the last, and holds the middle ones in order, leftmost."""

    parts: tuple[str, ...]

    @classmethod
    def of(cls, final: str) -> Wildcard:
        return cls(tuple(final.split("*")))

    def matches(self, text: str) -> bool:
        parts = self.parts
        first, last = parts[0], parts[-1]
        if (not text.startswith(first) or not text.endswith(last)
                or len(first) + len(last) > len(text)):
            return False
        at, end = len(first), len(text) - len(last)
        for middle in parts[1:-1]:
            found = text.find(middle, at, end)
            if found < 0:
                return False
            at = found + len(middle)
        return True


@dataclass(slots=True)
class Node:
    """One descriptor level: children by `key_value` or `key`, wildcards in config order."""

    children: dict[str, Node] = field(default_factory=dict)
    wildcards: list[tuple[Wildcard, Node]] = field(default_factory=list)
    rules: tuple[Rule, ...] = ()
    share_threshold: bool = False
    # The config value of a wildcard node, used as the shared counter key.
    pattern: str = ""
    metadata: Mapping[str, Any] | None = None
    # Name the request's value, not the config's key or pattern, in the stats key.
    value_to_metric: bool = False


@dataclass(frozen=True, slots=True)
class RateLimitConfig:
    domains: Mapping[str, Node]
    sources: Mapping[str, str]  # domain -> file it came from
    texts: Mapping[str, str]    # domain -> YAML text, for reading the live config back

    def rule_names(self) -> set[str]:
        names: set[str] = set()
        for node in self.domains.values():
            names |= {r.name for r in _walk_rules(node) if r.name}
        return names


def _walk_rules(node: Node) -> Iterable[Rule]:
    yield from node.rules
    for child in node.children.values():
        yield from _walk_rules(child)


class _Loader:
    def __init__(self, source: str) -> None:
        self.source = source
        self.count = 0  # descriptors so far

    def fail(self, message: str) -> ConfigError:
        return ConfigError(f"{self.source}: {message}")

    def check_keys(self, data: Mapping[Any, Any], allowed: frozenset[str], where: str) -> None:
        for key in data:
            if not isinstance(key, str):
                raise self.fail(f"config error, key is not of type string: {key!r} (at {where})")
            if key not in allowed:
                raise self.fail(f"config error, unknown key '{key}' (at {where})")

    def flag(self, data: Mapping[str, Any], key: str, where: str) -> bool:
        value = data.get(key, False)
        if not isinstance(value, bool):
            raise self.fail(f"'{key}' must be true or false, got {value!r} (at {where})")
        return value

    def requests_per_unit(self, data: Mapping[str, Any], unlimited: bool, where: str
                          ) -> int | None:
        rpu = data.get("requests_per_unit")
        if rpu is None and not unlimited:
            raise self.fail(f"rate limit has no requests_per_unit (at {where})")
        if rpu is not None and (isinstance(rpu, bool) or not isinstance(rpu, int)
                                or not 0 <= rpu <= MAX_REQUESTS_PER_UNIT):
            # The reference's words first: a float fails its leaf check, anything else
            # its decoding into a uint32.
            stage = ("error checking config" if isinstance(rpu, float)
                     else "error loading config file")
            raise self.fail(f"{stage}: requests_per_unit must be an integer from 0 to "
                            f"{MAX_REQUESTS_PER_UNIT}, got {rpu!r} (at {where})")
        return rpu

    def rule(self, data: Any, where: str, stats_key: str, flags: dict[str, bool],
             index: int) -> Rule:
        if not isinstance(data, dict):
            raise self.fail(f"rate limit must be a mapping (at {where})")
        self.check_keys(data, RATE_LIMIT_KEYS, where)
        unlimited = self.flag(data, "unlimited", where)
        unit_text = data.get("unit")
        unit = None
        if unit_text is not None:
            unit = Unit.__members__.get(str(unit_text).upper())
        if unlimited:
            if unit is not None:
                raise self.fail(f"should not specify rate limit unit when unlimited (at {where})")
        elif unit is None:
            raise self.fail(f"invalid rate limit unit '{unit_text or ''}' (at {where})")
        rpu = self.requests_per_unit(data, unlimited, where)
        multiplier = data.get("unit_multiplier", 1)
        if isinstance(multiplier, bool) or not isinstance(multiplier, int) or multiplier < 1:
            raise self.fail(f"unit_multiplier must be a positive integer, got {multiplier!r} "
                            f"(at {where})")
        try:
            algorithm = Algorithm(data.get("algorithm", "fixed_window"))
        except ValueError:
            raise self.fail(f"invalid algorithm '{data.get('algorithm')}'; use fixed_window, "
                            f"sliding_window or gcra (at {where})") from None
        name = data.get("name") or ""
        if not isinstance(name, str):
            raise self.fail(f"rate limit name must be a string (at {where})")
        replaces_raw = data.get("replaces") or []
        if not isinstance(replaces_raw, list):
            raise self.fail(f"replaces must be a list of {{name: ...}} (at {where})")
        replaces: list[str] = []
        for entry in replaces_raw:
            if not isinstance(entry, dict):
                raise self.fail(f"config error, yaml file contains list of type other than "
                                f"map: {entry} (at {where}.replaces)")
            self.check_keys(entry, frozenset({"name"}), f"{where}.replaces")
            target = entry.get("name") or ""
            if not target:
                raise self.fail(f"should not have an empty replaces entry (at {where})")
            if target == name:
                raise self.fail(f"replaces should not contain name of same descriptor "
                                f"(at {where})")
            replaces.append(str(target))
        window = UNIT_SECONDS[unit] * multiplier if unit is not None else 0
        adaptive = data.get("adaptive", False)
        pipeline = data.get("pipeline", "")
        if not isinstance(adaptive, bool):
            raise self.fail(f"adaptive must be true or false (at {where})")
        if adaptive and (not isinstance(pipeline, str) or not pipeline):
            raise self.fail(f"an adaptive rate limit needs the pipeline whose admitted "
                            f"fraction scales it (at {where})")
        if pipeline and not adaptive:
            raise self.fail(f"pipeline is only used with adaptive: true (at {where})")
        return Rule(stats_key=stats_key, requests_per_unit=int(rpu or 0), unit=unit,
                    window_s=window, algorithm=algorithm, unlimited=unlimited, name=name,
                    replaces=tuple(replaces), index=index,
                    adaptive_pipeline=pipeline if adaptive else "", **flags)

    def metadata(self, value: Any, where: str) -> None:
        """Only what a protobuf Struct holds: Envoy gets it as dynamic metadata."""
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise self.fail(f"error parsing metadata: key {key!r} is not a string "
                                    f"(at {where})")
                self.metadata(item, f"{where}.{key}")
        elif isinstance(value, list):
            for n, item in enumerate(value):
                self.metadata(item, f"{where}[{n}]")
        elif value is not None and not isinstance(value, str | int | float | bool):
            raise self.fail(f"error parsing metadata: a {type(value).__name__} value cannot be "
                            f"dynamic metadata (at {where})")

    def descriptors(self, parent: Node, items: Any, parent_key: str, where: str) -> None:
        if items is None:
            return
        if not isinstance(items, list):
            raise self.fail(f"descriptors must be a list (at {where})")
        for i, item in enumerate(items):
            here = f"{where}[{i}]"
            self.count += 1
            if self.count > MAX_DESCRIPTORS:
                raise self.fail(f"config error, more than {MAX_DESCRIPTORS} descriptors in "
                                f"one config file (at {here})")
            if not isinstance(item, dict):
                raise self.fail(f"config error, yaml file contains list of type other than "
                                f"map: {item} (at {here})")
            self.check_keys(item, DESCRIPTOR_KEYS, here)
            key, value = item.get("key"), item.get("value")
            if not key:
                raise self.fail(f"descriptor has empty key (at {here})")
            if not isinstance(key, str) or (value is not None and not isinstance(value, str)):
                raise self.fail(f"descriptor key and value must be strings (at {here})")
            final = f"{key}_{value}" if value else key
            composite = parent_key + final
            if final in parent.children:
                raise self.fail(f"duplicate descriptor composite key '{composite}'")
            flags = {k: self.flag(item, k, here)
                     for k in ("shadow_mode", "quota_mode", "detailed_metric")}
            share = self.flag(item, "share_threshold", here)
            wildcard = "*" in final  # anywhere in the key or the value, as the reference
            if share and not wildcard:
                raise self.fail(f"share_threshold can only be used with wildcard values "
                                f"(containing '*'), but found key '{final}' (at {here})")
            if "rate_limit" in item and "rate_limits" in item:
                raise self.fail(f"use either rate_limit or rate_limits, not both (at {here})")
            blocks: list[Any]
            if "rate_limits" in item:
                blocks = item["rate_limits"] if isinstance(item["rate_limits"], list) else [None]
                if not blocks:
                    raise self.fail(f"rate_limits must not be empty (at {here})")
            else:
                blocks = [item["rate_limit"]] if item.get("rate_limit") is not None else []
            rules = tuple(self.rule(block, f"{here}.rate_limit" + (f"s[{n}]" if
                                    "rate_limits" in item else ""), composite, flags, n)
                          for n, block in enumerate(blocks))
            metadata = item.get("metadata")
            if metadata is not None and not isinstance(metadata, dict):
                raise self.fail(f"metadata must be a mapping (at {here})")
            if metadata is not None:
                self.metadata(metadata, f"{here}.metadata")
            node = Node(rules=rules, share_threshold=share, pattern=final, metadata=metadata,
                        value_to_metric=self.flag(item, "value_to_metric", here))
            self.descriptors(node, item.get("descriptors"), composite + ".",
                             f"{here}.descriptors")
            parent.children[final] = node
            if wildcard:
                parent.wildcards.append((Wildcard.of(final), node))


def parse_domain(source: str, text: str) -> tuple[str, Node]:
    """Parse one file's text. Raises ConfigError starting with `source`."""
    loader = _Loader(source)
    data = yamlread.load(source, text)
    if not isinstance(data, dict):
        raise loader.fail("config file must be a mapping with 'domain' and 'descriptors'")
    loader.check_keys(data, ROOT_KEYS, "top level")
    domain = data.get("domain")
    if not domain or not isinstance(domain, str):
        raise loader.fail("config file cannot have empty domain")
    root = Node()
    loader.descriptors(root, data.get("descriptors"), domain + ".", "descriptors")
    return domain, root


def build(files: Iterable[tuple[str, str]], *, merge: bool = False) -> RateLimitConfig:
    """Build one snapshot from (source name, YAML text) pairs; all or nothing.

    With `merge` (envoyproxy/ratelimit's MERGE_DOMAIN_CONFIG), a later file of a domain
    adds its top-level descriptors to the earlier ones; a descriptor both define is an
    error, as in the reference, and nothing merges below the top level."""
    domains: dict[str, Node] = {}
    sources: dict[str, str] = {}
    texts: dict[str, str] = {}
    for source, text in files:
        domain, root = parse_domain(source, text)
        if domain in domains and merge:
            _merge(domains[domain], root, domain, source)
            sources[domain] += f" + {source}"
            texts[domain] += f"\n---\n{text}"
            continue
        if domain in domains:
            raise ConfigError(f"{source}: duplicate domain '{domain}' in config file "
                              f"(also in {sources[domain]})")
        domains[domain], sources[domain], texts[domain] = root, source, text
    config = RateLimitConfig(domains, sources, texts)
    known = config.rule_names()
    for domain, root in domains.items():
        for rule in _walk_rules(root):
            for target in rule.replaces:
                if target not in known:
                    raise ConfigError(f"{sources[domain]}: replaces names no rule: '{target}' "
                                      f"(in {rule.stats_key})")
    return config


def _merge(into: Node, root: Node, domain: str, source: str) -> None:
    for final, node in root.children.items():
        if final in into.children:
            raise ConfigError(f"{source}: duplicate descriptor composite key "
                              f"'{domain}.{final}'")
        into.children[final] = node
    into.wildcards.extend(root.wildcards)  # after the earlier file's, as loaded


def expand(paths: Iterable[Path]) -> list[Path]:
    """Files named directly, plus *.yaml / *.yml in named directories, sorted."""
    out: list[Path] = []
    for path in paths:
        if path.is_dir():
            out += sorted(p for p in path.iterdir()
                          if p.suffix in (".yaml", ".yml") and not p.name.startswith("."))
        else:
            out.append(path)
    return out


def read_files(paths: Iterable[Path]) -> list[tuple[str, str]]:
    files = []
    for path in expand(paths):
        try:
            files.append((str(path), path.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}"
                              ) from None
    return files


def load(paths: Iterable[Path], *, merge: bool = False) -> RateLimitConfig:
    return build(read_files(paths), merge=merge)


EMPTY = RateLimitConfig({}, {}, {})
# Before the first successful load: told apart from EMPTY (loaded, no domains) by identity,
# because the reference answers the two differently (an error, and OK for every domain).
NOT_LOADED = RateLimitConfig({}, {}, {})
