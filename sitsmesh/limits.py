"""The ranges of the limit settings (issue 13), kept apart so config.py stays small.

Every limit bounds bytes an untrusted caller controls or memory they can make
the process hold; the defaults fit the shipped 512 Mi pod with room to spare.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

KIB = 1 << 10
MIB = 1 << 20


def _int_range(low: int, high: int) -> Callable[[Any], int]:
    def parse(raw: Any) -> int:
        if isinstance(raw, bool) or not isinstance(raw, int | str):
            raise ValueError(f"expected an integer, got {raw!r}")
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"expected an integer, got {raw!r}") from None
        if not low <= value <= high:
            raise ValueError(f"must be between {low} and {high}, got {value}")
        return value

    return parse


LIMIT_PARSERS: dict[str, Callable[[Any], int]] = {
    "max_message_bytes": _int_range(4 * KIB, 256 * MIB),
    "max_check_message_bytes": _int_range(4 * KIB, 256 * MIB),
    "max_ratelimit_message_bytes": _int_range(4 * KIB, 256 * MIB),
    "max_concurrent_rpcs": _int_range(1, 1_000_000),
    "check_max_headers": _int_range(1, 100_000),
    "check_max_header_bytes": _int_range(KIB, 256 * MIB),
    "ratelimit_max_entries": _int_range(1, 1000),
    "ratelimit_max_key_length": _int_range(1, MIB),
    "ratelimit_max_value_length": _int_range(1, MIB),
    "ratelimit_max_hits_addend": _int_range(1, 2**32 - 1),
    "ratelimit_cache_bytes": _int_range(0, 64 * 1024 * MIB),
    "ratelimit_store_bytes": _int_range(MIB, 64 * 1024 * MIB),
    "request_id_max_length": _int_range(1, 64 * KIB),
    "chain_max_bytes": _int_range(MIB, 64 * 1024 * MIB),
}
