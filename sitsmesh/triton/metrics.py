"""Triton's Prometheus page, read once: fetch it, and the series sitsmesh uses per version.

Both the swap protocol (pending requests per version) and the backpressure
scrape (per-model counters) read this page; one parser serves both.
"""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

# Triton's family name -> the short name sitsmesh uses.
FAMILIES = {"nv_inference_pending_request_count": "pending",
            "nv_inference_request_success": "success",
            "nv_inference_request_failure": "failure",
            "nv_inference_queue_duration_us": "queue_us",
            "nv_inference_request_duration_us": "request_us"}


def fetch(url: str, timeout_s: float) -> str:
    """The page's text; raises OSError (urllib's errors included) when it cannot be read."""
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:  # noqa: S310 (config URL)
        return str(reply.read().decode())


def by_version(text: str) -> dict[tuple[str, int], dict[str, float]]:
    """(model, version) -> {short name: value} for the families above."""
    found: dict[tuple[str, int], dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        # The parser drops a counter's _total suffix from the family name.
        field = FAMILIES.get(family.name) or FAMILIES.get(family.name + "_total")
        if field is None:
            continue
        for sample in family.samples:
            version = sample.labels.get("version", "")
            model = sample.labels.get("model")
            if sample.name.endswith("_created") or not model or not version.isdigit():
                continue
            found.setdefault((model, int(version)), {})[field] = sample.value
    return found
