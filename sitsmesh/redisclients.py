"""Redis clients from sitsmesh's one `redis_url`: a single server, or a Redis Cluster.

A single server is `redis://`, `rediss://` or `unix://`, as redis-py reads them. A
cluster is `redis+cluster://` or `rediss+cluster://` with one or more seed nodes,
`redis+cluster://[user:password@]host:port[,host:port...][/0][?option=value...]`.
redis-py's own `RedisCluster.from_url` takes one seed, so a seed that happens to be
down at start would stop the process; here every listed seed is tried. A cluster has
only database 0.

Every part of sitsmesh that shares state (counters, token budgets, the hop bus, the
leader lease, RLQS peers) gets its client here, so one setting reaches all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from redis.asyncio import Redis
    from redis.asyncio.cluster import RedisCluster

SINGLE_SCHEMES = ("redis", "rediss", "unix")
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
DEFAULT_PORT = 6379
MAX_SEEDS = 64


@dataclass(frozen=True, slots=True)
class Target:
    """Where a URL points: `url` in redis-py's form (for a cluster, its first seed),
    and every seed when it is a cluster."""

    url: str
    seeds: tuple[tuple[str, int], ...] = ()

    @property
    def cluster(self) -> bool:
        return bool(self.seeds)


def _seed(text: str) -> tuple[str, int]:
    if text.startswith("["):  # [v6 address]:port
        host, _, rest = text[1:].partition("]")
        port_text = rest.removeprefix(":") if rest.startswith(":") else rest
    else:
        host, _, port_text = text.rpartition(":") if ":" in text else (text, "", "")
    if not host:
        raise ValueError(f"seed {text!r}: no host")
    try:
        port = int(port_text) if port_text else DEFAULT_PORT
    except ValueError:
        raise ValueError(f"seed {text!r}: port {port_text!r} is not a number") from None
    if not 0 < port < 65536:
        raise ValueError(f"seed {text!r}: port {port} is out of range")
    return host, port


def parse(url: str) -> Target:
    """The target of a redis_url; ValueError naming what is wrong."""
    scheme, sep, rest = url.partition("://")
    if not sep or (scheme not in SINGLE_SCHEMES and scheme not in CLUSTER_SCHEMES):
        raise ValueError("expected a redis://, rediss://, unix://, redis+cluster:// or "
                         f"rediss+cluster:// URL, got {url!r}")
    if scheme in SINGLE_SCHEMES:
        return Target(url)
    location, _, query = rest.partition("?")
    hosts, _, database = location.partition("/")
    userinfo, _, hosts = hosts.rpartition("@")
    if database not in ("", "0"):
        raise ValueError(f"{scheme}: a Redis Cluster has only database 0, got /{database}")
    listed = [h.strip() for h in hosts.split(",")]
    if not hosts or any(not h for h in listed):
        raise ValueError(f"{scheme}: expected host:port[,host:port...] after ://")
    if len(listed) > MAX_SEEDS:
        raise ValueError(f"{scheme}: at most {MAX_SEEDS} seed nodes, got {len(listed)}")
    seeds = tuple(_seed(h) for h in listed)
    host, port = seeds[0]
    first = f"[{host}]" if ":" in host else host
    credentials = f"{userinfo}@" if userinfo else ""
    suffix = f"?{query}" if query else ""
    return Target(f"{CLUSTER_SCHEMES[scheme]}://{credentials}{first}:{port}/0{suffix}", seeds)


def connect(url: str, **options: Any) -> Redis | RedisCluster:
    """A client for `url`; `options` go to redis-py (timeouts, retry, protocol)."""
    # Imported here: settings validation parses URLs, and redis-py loads only where a
    # shared store is configured.
    from redis.asyncio import Redis
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    target = parse(url)
    if not target.cluster:
        return Redis.from_url(target.url, **options)
    others = [ClusterNode(host, port) for host, port in target.seeds[1:]]
    return RedisCluster.from_url(target.url, startup_nodes=others, **options)
