"""The ranges of the limit settings: the bounds on what an untrusted caller can make sitsmesh hold.

Every limit bounds bytes an untrusted caller controls or memory they can make
the process hold; the defaults fit the shipped 512 Mi pod with room to spare.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sitsmesh.settingvalues import int_range

KIB = 1 << 10
MIB = 1 << 20

LIMIT_PARSERS: dict[str, Callable[[Any], int]] = {
    "max_message_bytes": int_range(4 * KIB, 256 * MIB),
    "max_check_message_bytes": int_range(4 * KIB, 256 * MIB),
    "max_ratelimit_message_bytes": int_range(4 * KIB, 256 * MIB),
    "max_concurrent_rpcs": int_range(1, 1_000_000),
    "check_max_headers": int_range(1, 100_000),
    "check_max_header_bytes": int_range(KIB, 256 * MIB),
    "ratelimit_max_entries": int_range(1, 1000),
    "ratelimit_max_key_length": int_range(1, MIB),
    "ratelimit_max_value_length": int_range(1, MIB),
    "ratelimit_max_hits_addend": int_range(1, 2**32 - 1),
    "ratelimit_cache_bytes": int_range(0, 64 * 1024 * MIB),
    "ratelimit_store_bytes": int_range(MIB, 64 * 1024 * MIB),
    "request_id_max_length": int_range(1, 64 * KIB),
    "chain_max_bytes": int_range(MIB, 64 * 1024 * MIB),
}
