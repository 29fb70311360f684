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


def _zero_or(parse: Callable[[Any], int]) -> Callable[[Any], int]:
    """0 (work it out at startup), or a value `parse` accepts."""
    def zero_or(raw: Any) -> int:
        if not isinstance(raw, bool) and str(raw).strip() == "0":
            return 0
        try:
            return parse(raw)
        except ValueError as exc:
            raise ValueError(f"{exc} (or 0: from the memory limit)") from None

    return zero_or


LIMIT_PARSERS: dict[str, Callable[[Any], int]] = {
    "max_message_bytes": int_range(4 * KIB, 256 * MIB),
    "max_check_message_bytes": int_range(4 * KIB, 256 * MIB),
    "max_ratelimit_message_bytes": int_range(4 * KIB, 256 * MIB),
    "max_concurrent_rpcs": int_range(1, 1_000_000),
    "max_streams_per_connection": int_range(1, 1_000_000),
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
    # 0: 1/8 of the container's memory limit (see sitsmesh/transport/budget.py)
    "inflight_budget_bytes": _zero_or(int_range(4 * MIB, 64 * 1024 * MIB)),
    "large_message_lag_ms": int_range(1, 10_000),
}
