"""Declarative documents: the domain validators' messages, bounded parsing, and the plan of
one apply (outcomes, diff, prune scoped by label)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from sitsmesh.authz.model import APIKEY_KIND, InvalidObject, tenant_from
from sitsmesh.chains.pipeline import InvalidPipeline, pipeline_from
from sitsmesh.declarative import documents
from sitsmesh.declarative.plan import (
    CONFIGURED,
    CREATED,
    LABELS_KIND,
    PRUNED,
    UNCHANGED,
    Stored,
    plan,
    selector,
)
from sitsmesh.errors import ConfigError, InvalidArgumentError
from sitsmesh.pressure.thresholds import InvalidThresholds, thresholds_from
from sitsmesh.ratelimit.config import parse_domain
from sitsmesh.state import Delete, Put, Record

MANAGED = {"sitsmesh.io/managed-by": "team-a"}


def doc(kind: str, name: str, spec: dict[str, Any], labels: dict[str, str] | None = None
        ) -> dict[str, Any]:
    return {"apiVersion": "sitsmesh.io/v1alpha1", "kind": kind,
            "metadata": {"name": name, "labels": labels or {}}, "spec": spec}


def refusal(raw: dict[str, Any]) -> str:
    with pytest.raises(InvalidArgumentError) as info:
        documents.validate([raw])
    return info.value.message


# --- the same messages as the imperative RPCs ------------------------------------------

def test_tenant_messages_are_tenant_from_s() -> None:
    spec = {"models": ["m"], "priority": 12}
    with pytest.raises(InvalidObject) as domain:
        tenant_from("team-a", spec)
    assert refusal(doc("Tenant", "team-a", spec)) == \
        f"document 0 (Tenant/team-a): {domain.value.message}"


def test_pipeline_messages_are_pipeline_from_s() -> None:
    spec = {"stages": [{"name": "a", "match": {"nowhere": "x"}}]}
    with pytest.raises(InvalidPipeline) as domain:
        pipeline_from("p", spec, "pipeline p")
    assert refusal(doc("Pipeline", "p", spec)).endswith(domain.value.message)


def test_thresholds_messages_are_thresholds_from_s() -> None:
    spec = {"min_concurrency": 9, "max_concurrency": 3}
    with pytest.raises(InvalidThresholds) as domain:
        thresholds_from(spec, "thresholds p")
    assert refusal(doc("Thresholds", "p", spec)).endswith(domain.value.message)


def test_ratelimit_messages_are_the_loader_s() -> None:
    spec = {"descriptors": [{"key": "k", "rate_limit": {"unit": "fortnight",
                                                         "requests_per_unit": 1}}]}
    with pytest.raises(ConfigError) as domain:
        parse_domain("api:dom", yaml.safe_dump({"domain": "dom", **spec}, sort_keys=False))
    assert refusal(doc("RateLimitConfig", "dom", spec)).endswith(domain.value.message)


def test_unknown_keys_kind_and_version_are_refused_by_name() -> None:
    assert "spec.colour: Extra inputs are not permitted" in refusal(
        doc("Tenant", "t", {"models": ["m"], "colour": "blue"}))
    assert "kind must be one of Tenant" in refusal(doc("Gadget", "t", {}))
    assert "apiVersion must be sitsmesh.io/v1alpha1" in refusal(
        {**doc("Tenant", "t", {"models": ["m"]}), "apiVersion": "v1"})


def test_every_error_is_reported_and_names_its_document() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        documents.validate([doc("Tenant", "ok", {"models": ["m"]}),
                            doc("Tenant", "bad", {"models": []}),
                            doc("Pipeline", "p", {"stages": []}),
                            doc("Tenant", "ok", {"models": ["n"]})])
    lines = info.value.message.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "document 1 (Tenant/bad)", "document 2 (Pipeline/p)", "document 3 (Tenant/ok)"]
    assert "also defined by document 0" in lines[2]


def test_yaml_off_policy_is_read_as_off_like_set_thresholds() -> None:
    (parsed,) = documents.validate([doc("Thresholds", "p", {"policy": False})])
    assert parsed.body()["policy"] == "off"


# --- bounded parsing ----------------------------------------------------------------------

def test_aliases_and_anchors_are_refused() -> None:
    bomb = 'a: &a ["x","x"]\nb: &b [*a,*a]\nc: [*b,*b]\n'
    with pytest.raises(InvalidArgumentError, match="anchors and aliases are not accepted"):
        documents.load(bomb, "f.yaml")


def test_size_and_count_bounds() -> None:
    with pytest.raises(InvalidArgumentError, match="bytes is more than"):
        documents.load("#" * (documents.MAX_BYTES + 1))
    many = "---\n".join("a: 1\n" for _ in range(documents.MAX_DOCUMENTS + 1))
    with pytest.raises(InvalidArgumentError, match="more than 500 documents"):
        documents.load(many)


def test_empty_documents_are_skipped_and_bad_yaml_named() -> None:
    assert documents.load("---\n---\na: 1\n") == [{"a": 1}]
    with pytest.raises(InvalidArgumentError, match=r"f\.yaml: invalid YAML"):
        documents.load("a: [1,\n", "f.yaml")


# --- the plan -----------------------------------------------------------------------------

def record(kind: str, name: str, body: dict[str, Any], revision: int = 1) -> Record:
    return Record(kind, name, body, revision, 0.0)


def labels_record(kind: str, name: str, labels: dict[str, str], revision: int = 1) -> Record:
    return record(LABELS_KIND, f"{kind}/{name}", {"labels": labels}, revision)


def stored(records: list[Record], labels: list[Record], keys: list[Record] | None = None
           ) -> Stored:
    return Stored({(r.kind, r.name): r for r in records},
                  {tuple(r.name.split("/", 1)): r for r in labels},  # type: ignore[misc]
                  keys or [])


TENANT = {"models": ["m"], "priority": 1}


def test_plan_created_configured_unchanged() -> None:
    docs = documents.validate([doc("Tenant", "new", TENANT, MANAGED),
                               doc("Tenant", "same", TENANT),
                               doc("Tenant", "moved", {**TENANT, "priority": 2})])
    body = {**tenant_from("x", TENANT).to_body(), "uid": "u1"}
    live = stored([record("tenant", "same", body, 4), record("tenant", "moved", body, 5)], [])
    result = plan(docs, live, new_uid=lambda: "fresh")
    assert [(o.name, o.action) for o in result.outcomes] == [
        ("new", CREATED), ("same", UNCHANGED), ("moved", CONFIGURED)]
    puts = {(w.kind, w.name): w for w in result.writes if isinstance(w, Put)}
    assert puts[("tenant", "new")].body["uid"] == "fresh"
    assert puts[("tenant", "moved")].body["uid"] == "u1"  # keys stay bound to it
    assert puts[("tenant", "moved")].expect_revision == 5
    assert puts[(LABELS_KIND, "Tenant/new")].body == {"labels": MANAGED}
    assert ("tenant", "same") not in puts
    moved = result.outcomes[2].diff
    assert "-  priority: 1\n" in moved and "+  priority: 2\n" in moved
    assert moved.startswith("--- live/Tenant/moved\n+++ applied/Tenant/moved\n")


def test_prune_deletes_only_labelled_records_of_applied_kinds_missing_from_files() -> None:
    body = {**tenant_from("x", TENANT).to_body(), "uid": "u"}
    pipeline = pipeline_from("p", {"stages": [{"name": "s", "match": {"header": "s"}}]}
                             ).to_body()
    live = stored(
        [record("tenant", "kept", body), record("tenant", "gone", body, 7),
         record("tenant", "other-team", body), record("tenant", "by-hand", body),
         record("pipeline", "p", pipeline)],
        [labels_record("Tenant", "kept", MANAGED), labels_record("Tenant", "gone", MANAGED),
         labels_record("Tenant", "other-team", {"sitsmesh.io/managed-by": "team-b"}),
         labels_record("Pipeline", "p", MANAGED)],
        [record(APIKEY_KIND, "k1", {"tenant": "gone", "revoked": False}, 3),
         record(APIKEY_KIND, "k2", {"tenant": "kept", "revoked": False}, 3)])
    docs = documents.validate([doc("Tenant", "kept", TENANT, MANAGED)])
    result = plan(docs, live, prune=selector("sitsmesh.io/managed-by=team-a"))
    assert [(o.name, o.action) for o in result.outcomes] == [
        ("kept", UNCHANGED), ("gone", PRUNED)]
    assert Delete("tenant", "gone") in result.writes
    assert Delete(LABELS_KIND, "Tenant/gone") in result.writes
    # Its keys are revoked in the same transaction, as DeleteTenant does.
    assert Put(APIKEY_KIND, "k1", {"tenant": "gone", "revoked": True},
               expect_revision=3) in result.writes
    deleted = {(w.kind, w.name) for w in result.writes if isinstance(w, Delete)}
    # Not another team's, not one without labels, not a kind the files did not apply.
    assert deleted == {("tenant", "gone"), (LABELS_KIND, "Tenant/gone")}
    assert result.outcomes[1].diff.startswith("--- live/Tenant/gone\n+++ applied/Tenant/gone")


def test_without_prune_nothing_is_deleted() -> None:
    body = {**tenant_from("x", TENANT).to_body(), "uid": "u"}
    live = stored([record("tenant", "gone", body)], [labels_record("Tenant", "gone", MANAGED)])
    result = plan(documents.validate([doc("Tenant", "kept", TENANT, MANAGED)]), live)
    assert not [w for w in result.writes if isinstance(w, Delete)]


@pytest.mark.parametrize("text", ["", "managed", "=x", "k="])
def test_bad_selector(text: str) -> None:
    with pytest.raises(InvalidArgumentError, match="use key=value"):
        selector(text)


def test_errors_name_the_file_and_the_bounds_hold_across_files() -> None:
    raws, where = documents.load_files(
        [("a.yaml", "---\n" + yaml.safe_dump(doc("Tenant", "ok", TENANT))),
         ("b.yaml", yaml.safe_dump(doc("Tenant", "ok", TENANT)) + "---\n"
          + yaml.safe_dump(doc("Tenant", "bad", {"models": []})))],
        [{**doc("Tenant", "built", TENANT), "spec": {"models": ["m"], "priority": 1.0}}])
    assert where == ["a.yaml: document 0", "b.yaml: document 0", "b.yaml: document 1",
                     "objects[0]"]
    assert raws[3]["spec"]["priority"] == 1  # a Struct's double, whole: an int again
    with pytest.raises(InvalidArgumentError) as info:
        documents.validate(raws, where)
    assert info.value.message.splitlines() == [
        "b.yaml: document 0 (Tenant/ok): also defined by a.yaml: document 0",
        "b.yaml: document 1 (Tenant/bad): tenant bad: models must be a non-empty list of "
        "globs"]
    half = "a: 1\n---\n" * (documents.MAX_DOCUMENTS // 2 + 1)
    with pytest.raises(InvalidArgumentError, match="more than 500 documents"):
        documents.load_files([("a.yaml", half), ("b.yaml", half)])
    big = "#" * (documents.MAX_BYTES // 2 + 1)
    with pytest.raises(InvalidArgumentError, match=r"the files together: .* is more than"):
        documents.load_files([("a.yaml", big), ("b.yaml", big)])


@pytest.mark.parametrize("text", [
    "a: 1\nb: [1, 2.5, true, null, ~, 'x', \"y\", 2026-12-01, 0x10, 1e3, .inf, off, yes]\n",
    "- {a: b}\n- [1, [2, [3]]]\n", "", "---\na: 1\n---\n---\nb: 2\n", "x", "!!str 12",
    "a: !!binary aGVsbG8=\n", '{"json": [1, 2, {"k": null}]}', "a:\n  b:\n    c: [x]\n",
    "? a\n: 1\n", "empty: {}\nlist: []\n", "k: |\n  multi\n  line\n"])
def test_documents_are_built_from_events_as_the_safe_loader_builds_them(text: str) -> None:
    assert documents._documents(text, "t") == list(yaml.load_all(text, Loader=yaml.SafeLoader))


@pytest.mark.parametrize(("text", "message"), [
    ("a: &x 1\nb: *x\n", "t: line 1: YAML anchors and aliases are not accepted"),
    ("[" * 65 + "]" * 65, "t: line 1: nested deeper than 64 levels"),
    ("[" * 100_000 + "]" * 100_000, "t: invalid YAML: while increasing flow level"),
    ("? [a]\n: 1\n", "t: line 1: a mapping key must be a scalar"),
    ("!!set {a}", "t: line 1: YAML tag 'tag:yaml.org,2002:set' is not accepted here"),
    ("a: !foo 1", "t: invalid YAML: could not determine a constructor for the tag '!foo'"),
])
def test_documents_refuse_what_config_never_needs(text: str, message: str) -> None:
    with pytest.raises(InvalidArgumentError) as refused:
        documents._documents(text, "t")
    assert refused.value.message.startswith(message), refused.value.message


def test_one_document_is_bounded_by_size_before_it_is_parsed() -> None:
    with pytest.raises(InvalidArgumentError, match=r"^p: 2000001 bytes is more than the "
                                                   r"1048576 one document may have$"):
        documents.load_one("[" * 2_000_001, "p")
    with pytest.raises(InvalidArgumentError, match="one YAML document expected, got 2"):
        documents.load_one("a: 1\n---\nb: 2\n", "p")
    assert documents.load_one("", "p") is None
