"""What the admin areas share: YAML documents in requests and replies, and timestamps."""

from __future__ import annotations

from typing import Any

import yaml
from google.protobuf.timestamp_pb2 import Timestamp

from sitsmesh.errors import InvalidArgumentError


def read_yaml(text: str, source: str) -> Any:
    """A YAML document from an admin request; malformed YAML is INVALID_ARGUMENT."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InvalidArgumentError(
            f"{source}: invalid YAML: {str(exc).splitlines()[0]}") from None


def yaml_text(body: Any) -> str:
    return yaml.safe_dump(body, sort_keys=False) if body is not None else ""


def timestamp(seconds: float) -> Timestamp:
    """Epoch seconds as the google.protobuf.Timestamp every admin reply carries."""
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp
