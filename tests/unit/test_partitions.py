"""Partition routing and ownership: pure functions every replica must compute alike."""

from __future__ import annotations

import random
from collections import Counter

from sitsmesh.shared.partitions import PARTITIONS, owned, owners, partition_of, stream_key


def test_a_request_id_always_goes_to_the_same_partition_and_ids_spread_evenly() -> None:
    rng = random.Random(31)
    ids = [f"{rng.getrandbits(128):032x}" for _ in range(16_000)]
    assert [partition_of(i) for i in ids] == [partition_of(i) for i in ids]
    counts = Counter(partition_of(i) for i in ids)
    assert set(counts) == set(range(PARTITIONS))
    assert max(counts.values()) < 1.2 * 16_000 / PARTITIONS
    # Fixed values: a change of hash would split a fleet mid-upgrade.
    assert partition_of("req-1") == partition_of("req-1", 16) == 1
    assert partition_of("") == 0
    assert partition_of("\ud800") in range(PARTITIONS)  # a lone surrogate does not raise


def test_each_partition_stream_has_its_own_cluster_hash_tag() -> None:
    keys = [stream_key(p) for p in range(PARTITIONS)]
    assert keys[3] == "sitsmesh:{hops:3}"
    assert len({k[k.index("{"):k.index("}") + 1] for k in keys}) == PARTITIONS


def test_every_partition_has_exactly_one_owner_whatever_order_members_are_seen() -> None:
    members = ["replica-a", "replica-b", "replica-c"]
    split = owners(members)
    assert len(split) == PARTITIONS and set(split) <= set(members)
    assert owners(reversed(members)) == split == owners([*members, "replica-a"])
    shares = [owned(m, members) for m in members]
    assert frozenset().union(*shares) == frozenset(range(PARTITIONS))
    assert sum(len(s) for s in shares) == PARTITIONS
    assert owners([]) == []
    assert owned("replica-a", ["replica-a"]) == frozenset(range(PARTITIONS))


def test_a_replica_joining_or_leaving_moves_only_the_partitions_it_wins_or_held() -> None:
    rng = random.Random(7)
    for _ in range(50):
        members = [f"r{rng.getrandbits(32):x}" for _ in range(rng.randint(1, 6))]
        joiner = f"j{rng.getrandbits(32):x}"
        before, after = owners(members, 256), owners([*members, joiner], 256)
        moved = [p for p in range(256) if before[p] != after[p]]
        assert all(after[p] == joiner for p in moved)
        # and leaving restores the split exactly
        assert owners(members, 256) == before


def test_the_split_is_roughly_even() -> None:
    members = [f"sitsmesh-{i}" for i in range(4)]
    counts = Counter(owners(members, 4096))
    assert all(700 < n < 1350 for n in counts.values())
