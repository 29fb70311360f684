"""JSON schemas for the prometheus-operator objects in deploy/observability.

kubernetes-validate has no schemas for monitoring.coreos.com, and no copy of the
operator's CRDs is available offline, so these are written from the CRDs' documented
fields (prometheus-operator v0.7x, monitoring.coreos.com/v1) the same way as the Istio
schemas in test_deploy_validation.py: required fields, and only known keys where the
manifests here set them, so a misspelt key fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Schema = dict[str, Any]

STR: Schema = {"type": "string", "minLength": 1}
STRS: Schema = {"type": "array", "items": STR}
BOOL: Schema = {"type": "boolean"}
STR_MAP: Schema = {"type": "object", "additionalProperties": {"type": "string"}}
# The operator's Duration: Prometheus' duration syntax, one unit each, largest first.
DURATION: Schema = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?"
                                                 r"(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?"
                                                 r"(([0-9]+)ms)?)$", "minLength": 1}


def _obj(properties: dict[str, Schema], required: Sequence[str] = ()) -> Schema:
    return {"type": "object", "properties": properties, "required": list(required),
            "additionalProperties": False}


def _list(items: Schema, min_items: int = 0) -> Schema:
    return {"type": "array", "items": items, "minItems": min_items}


def _top(kind: str, spec: Schema) -> Schema:
    metadata = _obj({"name": STR, "namespace": STR, "labels": STR_MAP, "annotations": STR_MAP},
                    ["name", "namespace"])
    return _obj({"apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": kind},
                 "metadata": metadata, "spec": spec},
                ["apiVersion", "kind", "metadata", "spec"])


LABEL_SELECTOR = _obj({
    "matchLabels": STR_MAP,
    "matchExpressions": _list(_obj({
        "key": STR, "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
        "values": STRS}, ["key", "operator"])),
})
NAMESPACE_SELECTOR = _obj({"any": BOOL, "matchNames": STRS})
RELABEL = _obj({
    "sourceLabels": STRS, "separator": {"type": "string"}, "targetLabel": STR,
    "regex": {"type": "string"}, "modulus": {"type": "integer", "minimum": 1},
    "replacement": {"type": "string"},
    "action": {"enum": ["replace", "Replace", "keep", "Keep", "drop", "Drop", "hashmod",
                        "HashMod", "labelmap", "LabelMap", "labeldrop", "LabelDrop",
                        "labelkeep", "LabelKeep", "lowercase", "Lowercase", "uppercase",
                        "Uppercase", "keepequal", "KeepEqual", "dropequal", "DropEqual"]},
})
# Fields an endpoint of either monitor has; the TLS and auth objects are not checked.
_ENDPOINT: dict[str, Schema] = {
    "port": STR,
    "path": {"type": "string", "pattern": "^/"},
    "scheme": {"enum": ["http", "https"]},
    "params": {"type": "object", "additionalProperties": STRS},
    "interval": DURATION,
    "scrapeTimeout": DURATION,
    "honorLabels": BOOL,
    "honorTimestamps": BOOL,
    "relabelings": _list(RELABEL),
    "metricRelabelings": _list(RELABEL),
    "followRedirects": BOOL,
    "enableHttp2": BOOL,
    "tlsConfig": {"type": "object"},
    "basicAuth": {"type": "object"},
    "authorization": {"type": "object"},
    "proxyUrl": STR,
}
SERVICE_MONITOR = _top("ServiceMonitor", _obj({
    "selector": LABEL_SELECTOR,
    "namespaceSelector": NAMESPACE_SELECTOR,
    "endpoints": _list(_obj({**_ENDPOINT, "targetPort": {"type": ["integer", "string"]},
                             "bearerTokenSecret": {"type": "object"}}), min_items=1),
    "jobLabel": STR,
    "targetLabels": STRS,
    "podTargetLabels": STRS,
    "sampleLimit": {"type": "integer", "minimum": 0},
    "targetLimit": {"type": "integer", "minimum": 0},
}, ["selector", "endpoints"]))
POD_MONITOR = _top("PodMonitor", _obj({
    "selector": LABEL_SELECTOR,
    "namespaceSelector": NAMESPACE_SELECTOR,
    "podMetricsEndpoints": _list(_obj({**_ENDPOINT, "targetPort": {"type": ["integer", "string"]},
                                       "bearerTokenSecret": {"type": "object"}}), min_items=1),
    "jobLabel": STR,
    "podTargetLabels": STRS,
    "sampleLimit": {"type": "integer", "minimum": 0},
    "targetLimit": {"type": "integer", "minimum": 0},
}, ["selector", "podMetricsEndpoints"]))

_RULE_COMMON: dict[str, Schema] = {
    "expr": STR, "labels": STR_MAP,
}
_ALERT = _obj({**_RULE_COMMON, "alert": STR, "for": DURATION, "keep_firing_for": DURATION,
               "annotations": STR_MAP}, ["alert", "expr"])
_RECORD = _obj({**_RULE_COMMON, "record": STR}, ["record", "expr"])
PROMETHEUS_RULE = _top("PrometheusRule", _obj({
    "groups": _list(_obj({
        "name": STR,
        "interval": DURATION,
        "limit": {"type": "integer", "minimum": 0},
        "partial_response_strategy": {"type": "string"},
        "rules": _list({"oneOf": [_ALERT, _RECORD]}, min_items=1),
    }, ["name", "rules"]), min_items=1),
}, ["groups"]))

MONITORING_SCHEMAS: dict[tuple[str, str], Schema] = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR,
    ("monitoring.coreos.com/v1", "PodMonitor"): POD_MONITOR,
    ("monitoring.coreos.com/v1", "PrometheusRule"): PROMETHEUS_RULE,
}
