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
