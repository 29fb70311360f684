"""What the admin areas share: YAML documents in requests and replies, and timestamps."""

from __future__ import annotations

import asyncio
from typing import Any

import yaml
from google.protobuf.timestamp_pb2 import Timestamp

from sitsmesh.declarative import documents

# One pipeline or thresholds document: as much as a whole declarative apply may carry.
MAX_YAML_BYTES = documents.MAX_BYTES


async def read_yaml(text: str, source: str) -> Any:
    """A YAML document from an admin request; malformed, oversized, aliased or too deeply
    nested YAML is INVALID_ARGUMENT. Checked for size first, and parsed off the event loop,
    which also answers Check and ShouldRateLimit in a single process."""
    if len(text) > MAX_YAML_BYTES:  # characters: at least as many bytes, so refused as is
        documents.load_one(text, source, MAX_YAML_BYTES)
    return await asyncio.to_thread(documents.load_one, text, source, MAX_YAML_BYTES)


def yaml_text(body: Any) -> str:
    return yaml.safe_dump(body, sort_keys=False) if body is not None else ""


def timestamp(seconds: float) -> Timestamp:
    """Epoch seconds as the google.protobuf.Timestamp every admin reply carries."""
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp
