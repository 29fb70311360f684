"""sitsmesh's rate-limit counters under the Prometheus names envoyproxy/ratelimit exports.

The reference counts in statsd names (`ratelimit.service.rate_limit.<key>.over_limit`)
and its Prometheus sink maps them with `src/stats/prom/default_mapper.yaml`. This
module re-reads sitsmesh's own families at scrape time and emits what that mapper
would: nothing on the request path, and the same in multiprocess mode, where the
source is the collector that sums every worker's files.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

MODES = ("sitsmesh", "envoyproxy", "both")
RATE_LIMIT_PREFIX = "ratelimit_service_rate_limit_"
CONFIG_LOAD_SUCCESS = "ratelimit_service_config_load_success"
CONFIG_LOAD_ERROR = "ratelimit_service_config_load_error"
SHOULD_RATE_LIMIT_ERROR = "ratelimit_service_should_rate_limit_error"
TOTAL_REQUESTS = "ratelimit_service_total_requests"
# No mapping names it: statsd_exporter exports it unmapped, its dots made underscores.
GLOBAL_SHADOW_MODE = "ratelimit_service_global_shadow_mode"
# sitsmesh's families that have a reference name; with `envoyproxy` only the latter shows.
REPLACED = frozenset({"sitsmesh_ratelimit_hits", "sitsmesh_ratelimit_config_loads",
                      "sitsmesh_ratelimit_config_load_errors",
                      "sitsmesh_ratelimit_store_errors",
                      "sitsmesh_ratelimit_global_shadow_mode"})
RLS_SERVICE = "envoy.service.ratelimit.v3.RateLimitService"
# Answers that mean the request or the service was at fault, as the reference's
# serviceError (no config, empty domain, no descriptors). Refusals of the caller
# (UNAUTHENTICATED, PERMISSION_DENIED) and cancellations are not the service's.
SERVICE_ERROR_CODES = frozenset({"INVALID_ARGUMENT", "FAILED_PRECONDITION",
                                 "RESOURCE_EXHAUSTED", "INTERNAL", "UNKNOWN"})
# Keys are bounded by RuleMetrics; this only stops the name cache outliving them.
MAX_CACHED_NAMES = 50_000

_IPV4 = re.compile(r"[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}")
# The mapper's order: near, over, total, within, shadow. Globs (exactly domain.key1) are
# tried first; the regex rules after them, in file order, and unanchored, as Go's
# FindStringSubmatchIndex searches.
_COUNTERS = ("near_limit", "over_limit", "total_hits", "within_limit", "shadow_mode")
_GLOB = re.compile(r"ratelimit\.service\.rate_limit\.([^.]*)\.([^.]*)\.("
                   + "|".join(_COUNTERS) + ")")
_REGEXES = tuple((counter, re.compile(
    r"ratelimit\.service\.rate_limit\.([^.]*)\.([^.]*)\.([^.]*)(\..*)?\." + counter))
    for counter in _COUNTERS)

Labels = tuple[tuple[str, str], ...]


def sanitize(stats_key: str) -> str:
    """The reference's SanitizeStatName: `:` and `|` become `_`, and so do the dots of
    anything shaped like an IPv4 address (ASCII digits only, as Go's `\\d`)."""
    name = stats_key.replace(":", "_").replace("|", "_")
    return _IPV4.sub(lambda m: m.group().replace(".", "_"), name)


def reference_series(stats_key: str, outcome: str) -> tuple[str, Labels] | None:
    """The (name, labels) the reference's default mapper gives one counter of a stats
    key, or None where it leaves the name unmapped (a key with one part)."""
    stat = f"ratelimit.service.rate_limit.{sanitize(stats_key)}.{outcome}"
    m = _GLOB.fullmatch(stat)
    if m is not None:
        return RATE_LIMIT_PREFIX + m[3], (("domain", m[1]), ("key1", m[2]))
    for counter, regex in _REGEXES:
        m = regex.search(stat)
        if m is not None:
            return RATE_LIMIT_PREFIX + counter, (("domain", m[1]), ("key1", m[2]),
                                                 ("key2", m[3]))
    return None


_REQUESTS = (TOTAL_REQUESTS, (("grpc_method", "ShouldRateLimit"),))
_SERVICE_ERROR = (SHOULD_RATE_LIMIT_ERROR, (("err_type", "service_error"),))
# sitsmesh sample name -> the reference series it is, one for one.
_RENAMED: dict[str, tuple[tuple[str, Labels], ...]] = {
    "sitsmesh_ratelimit_config_loads_total": ((CONFIG_LOAD_SUCCESS, ()),),
    "sitsmesh_ratelimit_config_load_errors_total": ((CONFIG_LOAD_ERROR, ()),),
    "sitsmesh_ratelimit_global_shadow_mode_total": ((GLOBAL_SHADOW_MODE, ()),),
    "sitsmesh_ratelimit_store_errors_total": ((SHOULD_RATE_LIMIT_ERROR,
                                               (("err_type", "redis_error"),)),),
}


class _Source(Protocol):
    def collect(self) -> Iterable[Metric]: ...


_HELP = {
    CONFIG_LOAD_SUCCESS: "Rate-limit config snapshots made live (envoyproxy/ratelimit name).",
    CONFIG_LOAD_ERROR: "Rate-limit configs refused (envoyproxy/ratelimit name).",
    TOTAL_REQUESTS: "ShouldRateLimit calls, by grpc_method (envoyproxy/ratelimit name).",
    GLOBAL_SHADOW_MODE: "Requests over limit let through by global shadow mode "
                        "(envoyproxy/ratelimit name).",
    SHOULD_RATE_LIMIT_ERROR: "ShouldRateLimit calls that failed, by err_type: redis_error "
                             "(failed store calls), service_error (error answers) "
                             "(envoyproxy/ratelimit name).",
}


class ReferenceNames(Collector):
    """Everything `source` collects (less the REPLACED families unless `keep_own`), then
    the reference's families built from it."""

    def __init__(self, source: _Source, *, keep_own: bool) -> None:
        self._source = source
        self._keep_own = keep_own
        self._names: dict[tuple[str, str], tuple[str, Labels] | None] = {}

    def collect(self) -> Iterator[Metric]:
        sums: dict[str, dict[Labels, float]] = {}
        for family in self._source.collect():
            if self._keep_own or family.name not in REPLACED:
                yield family
            for sample in family.samples:
                for name, labels in self._route(sample):
                    by_labels = sums.setdefault(name, {})
                    by_labels[labels] = by_labels.get(labels, 0.0) + sample.value
        for name, by_labels in sums.items():
            # Untyped, not counter: prometheus-client would name a counter's sample
            # `<name>_total` and OpenMetrics requires that suffix, while the reference's
            # names have none. An unknown-typed family keeps the exact name in both
            # formats, and rate()/increase() work on it all the same.
            family = Metric(name, _HELP.get(name, "Hits per rate-limit stats key, as "
                                           "envoyproxy/ratelimit's default mapper names them."),
                            "unknown")
            for labels, value in by_labels.items():
                # As the reference's statsd sink: a counter shows once it has moved.
                if value:
                    family.add_sample(name, dict(labels), value)
            if family.samples:
                yield family

    def _route(self, sample: Sample) -> tuple[tuple[str, Labels], ...]:
        """The reference series a sample adds to (none, one, or two)."""
        name, labels = sample.name, sample.labels
        if name == "sitsmesh_ratelimit_hits_total":
            found = self._hits(labels.get("key", ""), labels.get("outcome", ""))
            return (found,) if found is not None else ()
        if (name == "grpc_server_handled_total"
                and labels.get("grpc_service") == RLS_SERVICE
                and labels.get("grpc_method") == "ShouldRateLimit"):
            # ShouldRateLimit only: the data server's other methods (ext_authz's Check,
            # health) are not the reference's.
            if labels.get("grpc_code") in SERVICE_ERROR_CODES:
                return _REQUESTS, _SERVICE_ERROR
            return (_REQUESTS,)
        return _RENAMED.get(name, ())

    def _hits(self, key: str, outcome: str) -> tuple[str, Labels] | None:
        cache_key = (key, outcome)
        try:
            return self._names[cache_key]
        except KeyError:
            pass
        if len(self._names) >= MAX_CACHED_NAMES:
            self._names.clear()
        found = self._names[cache_key] = reference_series(key, outcome)
        return found


def exposed(registry: CollectorRegistry, names: str) -> CollectorRegistry:
    """The registry /metrics serves for the `ratelimit_metric_names` setting."""
    if names not in MODES:
        raise ValueError(f"ratelimit_metric_names must be one of {', '.join(MODES)}, "
                         f"got {names!r}")
    if names == "sitsmesh":
        return registry
    # Not described: names are known only by collecting the source. Registered without
    # names, it is still collected for a `name[]`-filtered scrape.
    served = CollectorRegistry(auto_describe=False, support_collectors_without_names=True)
    served.register(ReferenceNames(registry, keep_own=names == "both"))
    return served
