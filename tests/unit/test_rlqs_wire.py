"""RLQS replies built from cached wire bytes (sitsmesh.transport.rlqs._Encoder) are the
messages the plain protobuf build gives, for every kind of assignment and abandons."""

from __future__ import annotations

from sitsmesh.quota.buckets import Kind
from sitsmesh.quota.service import Assignment, Update
from sitsmesh.quota.split import TokenShare
from sitsmesh.transport.rlqs import _Encoder, response


def test_encoded_replies_equal_the_protobuf_build() -> None:
    shared = Assignment(Kind.SHARED, TokenShare(37, 10, 4))
    ids = [{"tenant": f"t{i}", "priority": str(i % 10), "model": "m" * (i % 300)}
           for i in range(300)]
    kinds: list[Assignment | None] = [Assignment(Kind.ALLOW), Assignment(Kind.DENY),
                                      shared, None]
    updates: list[Update] = [(bid, kinds[i % 4]) for i, bid in enumerate(ids)]
    encoder = _Encoder(20)
    for _ in range(2):  # the second time from the cache
        assert encoder.response(updates) == response(updates, 20)
    assert encoder.response([]) == response([], 20)


def test_an_outbox_keeps_one_update_per_bucket_and_marks_a_caller_that_does_not_read(
) -> None:
    """Issue 26: the refresh pushed a reply per step into a queue of 64, so a busy but
    reading stream was ended; and a stream that never read was never ended. Pending
    updates now merge by bucket (the newest wins), and only reports answered during
    one stuck write count towards the bound."""
    from sitsmesh.transport.rlqs import MAX_QUEUED, MAX_REPLY, _Outbox

    ids = [{"tenant": f"t{i}"} for i in range(MAX_REPLY + 50)]
    box = _Outbox(20)
    for step in range(500):  # pushes: however many, one pending update per bucket
        box.put([(bid, Assignment(Kind.SHARED, TokenShare(step + 1, 1, 2)))
                 for bid in ids], report=False)
    assert len(box.pending) == len(ids) and not box.stuck.is_set()
    first = box.take()
    assert len(first) == MAX_REPLY and box.pending  # the rest follow
    rest = box.take()
    assert len(rest) == 50 and not box.pending
    assert all(a is not None and a.share is not None and a.share.tokens_per_fill == 500
               for _, a in first + rest)
    for _ in range(MAX_QUEUED):
        box.put([(ids[0], None)], report=True)
    assert not box.stuck.is_set()
    box.put([(ids[0], None)], report=True)
    assert box.stuck.is_set()


def test_a_kept_bucket_id_is_made_once_from_its_bytes_and_an_abandoned_one_not_kept(
) -> None:
    from envoy.service.rate_limit_quota.v3 import rlqs_pb2

    encoder = _Encoder(20)
    kept, refused = (rlqs_pb2.BucketId(bucket={"tenant": t}) for t in ("a", "b"))
    first = [encoder.bucket_id(m.SerializeToString(), m) for m in (kept, refused)]
    encoder.kept([(first[0], Assignment(Kind.ALLOW)), (first[1], None)])
    again = [encoder.bucket_id(m.SerializeToString(), m) for m in (kept, refused)]
    assert again[0] is first[0]  # the service finds its bucket by this object
    assert again[1] is not first[1] and again[1] == first[1]
    assert encoder.response([(again[0], None)]) == response([({"tenant": "a"}, None)], 20)


def test_equal_assignments_of_distinct_objects_encode_alike() -> None:
    """The encoder looks an assignment up by identity first: an equal one that is
    another object (not interned) still gets the same bytes."""
    encoder = _Encoder(20)
    updates: list[Update] = [({"tenant": f"t{i}"},
                              Assignment(Kind.SHARED, TokenShare(37 + i % 2, 10, 4)))
                             for i in range(50)]
    assert encoder.response(updates) == response(updates, 20)
    assert encoder.response(updates[::-1]) == response(updates[::-1], 20)


def test_the_collector_is_frozen_as_buckets_join_and_thawed_as_they_leave() -> None:
    """Issue 26 (A2): the GC's full passes walked every bucket of every stream, 45-185 ms
    each while 100 streams of 1 000 joined, with Check waiting. The objects held once
    FREEZE_BUCKETS more buckets joined are frozen (skipped by the passes). Once as many
    left with their streams they are thawed, and frozen again only after a full pass
    has collected the cycles that died meanwhile."""
    import gc
    from types import SimpleNamespace
    from typing import Any, cast

    from sitsmesh.transport.rlqs import FREEZE_BUCKETS, RateLimitQuotaServicer

    streams: dict[str, Any] = {}
    service = SimpleNamespace(streams=streams, refresh=dict)
    servicer = RateLimitQuotaServicer(cast(Any, service), 20)
    gc.unfreeze()
    try:
        streams["a"] = SimpleNamespace(buckets=dict.fromkeys(range(FREEZE_BUCKETS - 1)))
        servicer.push()
        assert gc.get_freeze_count() == 0
        streams["b"] = SimpleNamespace(buckets=dict.fromkeys(range(1)))
        servicer.push()
        frozen = gc.get_freeze_count()
        assert frozen > 0
        garbage: list[list[int]] = [[] for _ in range(100)]
        servicer.push()  # nothing joined: no new freeze
        assert gc.get_freeze_count() == frozen
        del garbage
        # Streams ending: the transport counts their buckets as they close.
        servicer._left = FREEZE_BUCKETS
        del streams["a"]
        servicer.push()
        assert gc.get_freeze_count() == 0
        streams["c"] = SimpleNamespace(buckets=dict.fromkeys(range(2 * FREEZE_BUCKETS)))
        servicer.push()  # no full pass since the thaw: not frozen again yet
        assert gc.get_freeze_count() == 0
        gc.collect()
        servicer.push()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
