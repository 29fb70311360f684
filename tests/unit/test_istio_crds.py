"""Every Istio object under deploy/ validates against Istio's own CRD schemas: the
validators @kubernetes-models/istio compiles from the Istio release's CRDs (1.29's
crd-all.gen.yaml, the operator's from 1.18), pinned in tests/istio/package.json and
installed by `make test` (npm ci). Broken copies fail, so the check can fail."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
VALIDATOR = REPO / "tests" / "istio" / "validate.mjs"
INSTALLED = REPO / "tests" / "istio" / "node_modules" / "@kubernetes-models" / "istio"


def _istio_objects() -> list[dict[str, Any]]:
    found = []
    for path in sorted((REPO / "deploy").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and ".istio.io/" in str(doc.get("apiVersion", "")):
                found.append(doc)
    return found


def _validate(objects: list[dict[str, Any]], tmp_path: Path) -> tuple[int, list[str]]:
    assert INSTALLED.is_dir(), "Istio's schemas are missing: `make test` runs npm ci there"
    docs = tmp_path / "objects.json"
    docs.write_text(json.dumps(objects))
    done = subprocess.run(["node", str(VALIDATOR), str(docs)], capture_output=True, text=True,
                          timeout=60, check=False, cwd=VALIDATOR.parent)
    assert not done.stderr, done.stderr
    return done.returncode, done.stdout.splitlines()


def test_every_istio_object_in_deploy_validates_against_istios_crds(tmp_path: Path) -> None:
    objects = _istio_objects()
    kinds = {(o["apiVersion"], o["kind"]) for o in objects}
    # What the Istio set-up ships: ext_authz and ALS providers, policies, access logging,
    # the stats sink, quota and resilience filters.
    assert {("install.istio.io/v1alpha1", "IstioOperator"),
            ("security.istio.io/v1", "AuthorizationPolicy"),
            ("telemetry.istio.io/v1", "Telemetry"),
            ("networking.istio.io/v1alpha3", "EnvoyFilter")} <= kinds
    status, lines = _validate(objects, tmp_path)
    assert status == 0, lines
    assert lines == [f"ok {o['kind']} {o['metadata']['name']}" for o in objects]


@pytest.mark.parametrize(("path", "value", "error"), [
    (("spec", "accessLogging", 0, "providers", 0, "name"), 5,
     "data/spec/accessLogging/0/providers/0/name must be string"),
    (("spec", "action"), "ALLOWX", "data/spec/action must be equal to one of the allowed values"),
    (("spec", "configPatches", 0, "applyTo"), "HTTP_FILTR",
     "data/spec/configPatches/0/applyTo must be equal to one of the allowed values"),
])
def test_a_broken_copy_fails_with_the_schemas_message(
        tmp_path: Path, path: tuple[str | int, ...], value: object, error: str) -> None:
    by_kind = {"accessLogging": "Telemetry", "action": "AuthorizationPolicy",
               "configPatches": "EnvoyFilter"}
    kind = by_kind[str(path[1])]
    broken = next(o for o in _istio_objects() if o["kind"] == kind and
                  (kind != "AuthorizationPolicy" or "action" in o["spec"]))
    target: Any = broken
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    status, lines = _validate([broken], tmp_path)
    assert status == 1
    assert lines == [f"invalid {kind} {broken['metadata']['name']}: {error}"]


def test_an_object_of_a_kind_istio_does_not_define_is_refused(tmp_path: Path) -> None:
    status, lines = _validate([{"apiVersion": "telemetry.istio.io/v1", "kind": "Telemetri",
                                "metadata": {"name": "x"}}], tmp_path)
    assert status == 2 and lines == ["unknown telemetry.istio.io/v1 Telemetri x: no schema"]
