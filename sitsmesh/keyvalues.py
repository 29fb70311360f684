"""The flag and environment form of a mapping: 'key=value,key=value'."""

from __future__ import annotations


def split_pairs(text: str, shape: str) -> list[tuple[str, str]]:
    """[(key, value), ...], both stripped; empty parts are skipped. A part without '=' is
    an error naming `shape` (what one part should look like, e.g. 'key=value')."""
    items = []
    for part in text.split(","):
        if part.strip():
            key, sep, value = part.partition("=")
            if not sep:
                raise ValueError(f"expected {shape}, got {part!r}")
            items.append((key.strip(), value.strip()))
    return items
