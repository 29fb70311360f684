"""Epoch seconds to google.protobuf.Timestamp, for every admin reply that carries a time."""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp


def timestamp(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp
