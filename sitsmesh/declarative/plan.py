"""From validated documents and the stored records to the writes of one transaction, each
document's outcome and a unified diff. Pure: the caller reads the store and commits."""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from sitsmesh.authz.keypolicy import KEYPOLICY_KIND
from sitsmesh.authz.model import APIKEY_KIND, TENANT_KIND
from sitsmesh.budgets.model import BUDGET_KIND
from sitsmesh.chains.pipeline import PIPELINE_KIND
from sitsmesh.declarative.models import API_VERSION, KINDS, Document
from sitsmesh.errors import InvalidArgumentError
from sitsmesh.pressure.thresholds import THRESHOLDS_KIND
from sitsmesh.ratelimit.reload import KIND as RATELIMIT_KIND
from sitsmesh.state import Delete, Put, Record
from sitsmesh.state.contract import ABSENT

# Declarative kind -> the state store's kind, the one the imperative RPCs write.
STORE_KIND = {"Tenant": TENANT_KIND, "ApiKeyPolicy": KEYPOLICY_KIND,
              "TokenBudget": BUDGET_KIND, "Pipeline": PIPELINE_KIND, "Thresholds": THRESHOLDS_KIND,
              "RateLimitConfig": RATELIMIT_KIND}
# metadata.labels of applied objects, apart from their bodies (which the domain validators
# keep strict): name "<Kind>/<name>", body {"labels": {...}}. Prune reads them.
LABELS_KIND = "declarative-labels"
# libyaml's emitter where PyYAML has it: a diff of 500 documents in tens of milliseconds.
_DUMPER: type[yaml.SafeDumper] = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
CREATED, CONFIGURED, UNCHANGED, PRUNED = "created", "configured", "unchanged", "pruned"


@dataclass(frozen=True, slots=True)
class Outcome:
    kind: str
    name: str
    action: str
    diff: str = ""


@dataclass(slots=True)
class Plan:
    outcomes: list[Outcome] = field(default_factory=list)
    writes: list[Put | Delete] = field(default_factory=list)

    @property
    def diff(self) -> str:
        return "".join(o.diff for o in self.outcomes)

    def touched(self, kind: str) -> list[Outcome]:
        return [o for o in self.outcomes if o.kind == kind and o.action != UNCHANGED]


@dataclass(frozen=True, slots=True)
class Stored:
    """What the plan needs from the store: the records of the declarative kinds, their
    labels, and the API keys (pruning a tenant revokes its keys, as DeleteTenant does)."""
    records: Mapping[tuple[str, str], Record]
    labels: Mapping[tuple[str, str], Record]
    apikeys: Sequence[Record] = ()


def selector(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip() or not value.strip():
        raise InvalidArgumentError(f"prune selector {text!r}: use key=value, e.g. "
                                   "sitsmesh.io/managed-by=team-a")
    return key.strip(), value.strip()


def document(kind: str, name: str, body: Mapping[str, Any],
             labels: Mapping[str, str]) -> dict[str, Any]:
    """A stored record as the document `get` prints and `apply` accepts back."""
    metadata: dict[str, Any] = {"name": name}
    if labels:
        metadata["labels"] = dict(labels)
    return {"apiVersion": API_VERSION, "kind": kind, "metadata": metadata,
            "spec": KINDS[kind].spec_of(name, dict(body))}


def _text(doc: Mapping[str, Any] | None) -> list[str]:
    if doc is None:
        return []
    # Through JSON so the diff compares what get -o yaml would print.
    plain = json.loads(json.dumps(doc))
    return yaml.dump(plain, Dumper=_DUMPER, sort_keys=False).splitlines(keepends=True)


def unified(kind: str, name: str, before: Mapping[str, Any] | None,
            after: Mapping[str, Any] | None) -> str:
    return "".join(difflib.unified_diff(_text(before), _text(after),
                                        f"live/{kind}/{name}", f"applied/{kind}/{name}"))


def _labels_of(stored: Stored, kind: str, name: str) -> dict[str, str]:
    record = stored.labels.get((kind, name))
    return dict(record.body.get("labels", {})) if record is not None else {}


def _label_writes(stored: Stored, kind: str, name: str,
                  labels: Mapping[str, str]) -> list[Put | Delete]:
    key = f"{kind}/{name}"
    record = stored.labels.get((kind, name))
    if not labels:
        return [Delete(LABELS_KIND, key)] if record is not None else []
    return [Put(LABELS_KIND, key, {"labels": dict(labels)},
                expect_revision=record.revision if record is not None else ABSENT)]


def plan(docs: Sequence[Document], stored: Stored, *, prune: tuple[str, str] | None = None,
         new_uid: Callable[[], str] = lambda: "") -> Plan:
    result = Plan()
    named: set[tuple[str, str]] = set()
    for doc in docs:
        kind, name = doc.KIND, doc.metadata.name
        named.add((kind, name))
        record = stored.records.get((STORE_KIND[kind], name))
        body = doc.body()
        if kind == "Tenant":  # the store gives the uid, once; keys bind to it
            body["uid"] = (str(record.body.get("uid", "")) if record is not None
                           else new_uid()) or new_uid()
        labels = doc.metadata.labels
        before = (document(kind, name, record.body, _labels_of(stored, kind, name))
                  if record is not None else None)
        after = document(kind, name, body, labels)
        if before == after:
            result.outcomes.append(Outcome(kind, name, UNCHANGED))
            continue
        result.outcomes.append(Outcome(kind, name, CONFIGURED if record else CREATED,
                                       unified(kind, name, before, after)))
        if record is None or KINDS[kind].spec_of(name, record.body) != after["spec"]:
            result.writes.append(Put(STORE_KIND[kind], name, body, expect_revision=(
                record.revision if record is not None else ABSENT)))
        if labels != _labels_of(stored, kind, name):
            result.writes.extend(_label_writes(stored, kind, name, labels))
    if prune is not None:
        _prune(result, stored, prune, {d.KIND for d in docs}, named)
    return result


def _prune(result: Plan, stored: Stored, prune: tuple[str, str], kinds: Iterable[str],
           named: set[tuple[str, str]]) -> None:
    """Delete what carries the label and the files no longer name. Only the applied
    kinds, and never a record without the label (made by hand, or by another team)."""
    key, value = prune
    for (kind, name), labels in sorted(stored.labels.items()):
        if kind not in kinds or (kind, name) in named:
            continue
        if labels.body.get("labels", {}).get(key) != value:
            continue
        record = stored.records.get((STORE_KIND[kind], name))
        result.writes.append(Delete(LABELS_KIND, f"{kind}/{name}"))
        if record is None:
            continue  # deleted by hand since: only its labels are left to drop
        before = document(kind, name, record.body, labels.body.get("labels", {}))
        result.outcomes.append(Outcome(kind, name, PRUNED, unified(kind, name, before, None)))
        result.writes.append(Delete(STORE_KIND[kind], name))
        if kind == "Tenant":
            result.writes.extend(
                Put(APIKEY_KIND, r.name, {**r.body, "revoked": True}, expect_revision=r.revision)
                for r in stored.apikeys
                if r.body.get("tenant") == name and not r.body.get("revoked"))
