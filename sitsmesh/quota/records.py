"""What the quota service keeps: streams, their buckets, the groups of buckets that
share a rate, the assignment each is due, and what keeping a bucket id costs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from sitsmesh.quota import buckets
from sitsmesh.quota.buckets import Kind, Target, Verdict
from sitsmesh.quota.split import TokenShare
from sitsmesh.ratelimit.config import Node

CHANGE = 0.2           # a share that moved less than this is not worth a new bucket
# Bytes a stored bucket id costs, as counted by `id_bytes`: its text three times (the
# id, its key, and its wire form the RLQS transport keeps), and the objects around
# each entry and each bucket. Long ids cost ~25 MB a
# stream before these bounds (issue 26); 2 MiB still holds 1 000 ids of the fragment's
# four entries (~0.6 KiB each).
MAX_STREAM_ID_BYTES = 2 * 1024 * 1024
# Across every stream: 100 Envoys of 1 000 such buckets fit (~75 MiB counted), and
# ids of the longest kind stop at ~130 MB of a 512 Mi pod.
MAX_ID_BYTES = 96 * 1024 * 1024
ENTRY_BYTES = 96
BUCKET_BYTES = 256


def id_bytes(bucket_id: Mapping[str, str]) -> int:
    """What keeping `bucket_id` costs, charged against the per-stream and global bounds."""
    text = sum(len(k) + len(v) for k, v in bucket_id.items())
    return 3 * text + ENTRY_BYTES * len(bucket_id) + BUCKET_BYTES


@dataclass(frozen=True, slots=True)
class Assignment:
    kind: Kind
    share: TokenShare | None = None

    def close_to(self, other: Assignment | None) -> bool:
        """Close enough not to send: Envoy starts a changed token bucket full, so every
        new share costs a burst."""
        if other is None or other.kind is not self.kind:
            return False
        if self.share is None or other.share is None:
            return self.share == other.share
        if self.share.fill_s != other.share.fill_s:
            return False
        return abs(self.share.rate - other.share.rate) <= CHANGE * other.share.rate


ALLOWED = Assignment(Kind.ALLOW)
DENIED = Assignment(Kind.DENY)


@dataclass(eq=False, slots=True)
class Group:
    """Buckets that share one verdict: a rule's target, or a pipeline's priority."""

    target: Target | None = None             # a rule's group
    pipeline: str = ""                       # or a pipeline's priority
    priority: int = 0
    members: dict[str, Bucket] = field(default_factory=dict)  # member name -> bucket
    verdict: Verdict = buckets.ALLOW
    shares: dict[str, TokenShare] = field(default_factory=dict)
    computed: bool = False
    demand: float = 0.0  # requests/s of every member, at the last split
    drift: float = 0.0   # how far the members' demands moved since (requests/s)
    since: float = 0.0   # when it was last computed


@dataclass(eq=False, slots=True)
class Bucket:
    id: dict[str, str]
    key: str
    stream: str = ""
    cost: int = 0
    demand: float | None = None  # requests/s this stream's Envoy saw, smoothed
    last_used: float = 0.0
    sent: Assignment | None = None
    due: Assignment | None = None  # what the last pass computed
    groups: tuple[str, ...] = ()   # the shared rates it takes part in
    rule: Group | None = None
    admission: Group | None = None

    @property
    def member(self) -> str:
        return f"{self.stream}\x1f{self.key}"


@dataclass
class Stream:
    """One Envoy's RLQS stream (one per Envoy and domain)."""

    name: str
    domain: str = ""
    buckets: dict[str, Bucket] = field(default_factory=dict)
    by_id: dict[int, Bucket] = field(default_factory=dict)  # id(bucket.id) -> bucket
    id_bytes: int = 0
    root: Node | None = None  # the domain's tree its buckets were matched against


# (bucket id, what to send); None sends abandon_action: Envoy drops the bucket.
Update = tuple[dict[str, str], Assignment | None]

