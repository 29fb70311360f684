"""Hostile input to ConfigService.Apply through a real `sitsmesh serve`: refused with a
precise INVALID_ARGUMENT, nothing written, the server still answering; and no call at
all without the admin token."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest

from sitsmesh.admin.v1 import config_pb2, config_pb2_grpc
from sitsmesh.declarative import documents
from sitsmesh.dev import harness

pytestmark = pytest.mark.integration

TENANT = """apiVersion: sitsmesh.io/v1alpha1
kind: Tenant
metadata: {{name: t{n}}}
spec: {{models: [bert]}}
"""
BOMB = "\n".join(["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"] + [
    f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]) + "\n"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[harness.Sitsmesh]:
    started = harness.start_sitsmesh(tmp_path_factory.mktemp("decl-security"))
    yield started
    started.kill()


def one(text: str) -> config_pb2.ApplyFile:
    return config_pb2.ApplyFile(name="t.yaml", documents=text)


def apply(node: harness.Sitsmesh, text: str, metadata: tuple[tuple[str, str], ...] | None = None
          ) -> config_pb2.ApplyResponse:
    with grpc.insecure_channel(node.admin_addr, options=[
            ("grpc.max_send_message_length", 8 << 20)]) as channel:
        reply: config_pb2.ApplyResponse = config_pb2_grpc.ConfigServiceStub(channel).Apply(
            config_pb2.ApplyRequest(
                files=[config_pb2.ApplyFile(name="attack.yaml", documents=text)]), timeout=10,
            metadata=node.admin_metadata() if metadata is None else metadata)
        return reply


def refused(node: harness.Sitsmesh, text: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        apply(node, text)
    return info.value


def nothing_stored(node: harness.Sitsmesh) -> None:
    """No object was written, and the server still answers a good (dry-run) apply."""
    with grpc.insecure_channel(node.admin_addr) as channel:
        stub = config_pb2_grpc.ConfigServiceStub(channel)
        reply = stub.Get(config_pb2.GetRequest(), timeout=5, metadata=node.admin_metadata())
        assert list(reply.documents) == []
        dry = stub.Apply(config_pb2.ApplyRequest(files=[one(TENANT.format(n="ok"))],
                                                 dry_run=True),
                         timeout=5, metadata=node.admin_metadata())
    assert [(r.name, r.action) for r in dry.results] == [("tok",
                                                          config_pb2.APPLY_ACTION_CREATED)]


def test_oversized_body_is_refused_and_writes_nothing(node: harness.Sitsmesh) -> None:
    one = TENANT.format(n=0)
    text = (one + "---\n") * (documents.MAX_BYTES // len(one) + 10)
    error = refused(node, text)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "is more than the 1048576 an apply accepts" in (error.details() or "")
    nothing_stored(node)


def test_too_many_documents_are_refused_and_write_nothing(node: harness.Sitsmesh) -> None:
    text = "---\n".join(TENANT.format(n=i) for i in range(documents.MAX_DOCUMENTS + 1))
    error = refused(node, text)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "more than 500 documents in one apply" in (error.details() or "")
    nothing_stored(node)


def test_yaml_bomb_is_refused_at_once(node: harness.Sitsmesh) -> None:
    # 10^9 leaves if expanded; refused from the event stream before anything is built.
    started = time.monotonic()
    error = refused(node, BOMB)
    assert time.monotonic() - started < 5
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "attack.yaml: line 1: YAML anchors and aliases are not accepted" in (
        error.details() or "")
    nothing_stored(node)


def test_deep_nesting_is_refused_not_a_crash(node: harness.Sitsmesh) -> None:
    # PyYAML's pure-Python composer recurses per level: this ended in RecursionError
    # (UNKNOWN) before the depth check; libyaml refuses past 1000 levels itself.
    for depth, message in ((100, "attack.yaml: line 1: nested deeper than 64 levels"),
                           (50_000, "attack.yaml: invalid YAML")):
        error = refused(node, "[" * depth + "]" * depth)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in (error.details() or "")
    block = "".join(f"{' ' * i}k{i}:\n" for i in range(100)) + " " * 100 + "v: 1\n"
    error = refused(node, block)
    assert "nested deeper than 64 levels" in (error.details() or "")
    nothing_stored(node)


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong"),)])
def test_config_service_needs_the_admin_token(node: harness.Sitsmesh,
                                              metadata: tuple[tuple[str, str], ...]) -> None:
    with pytest.raises(grpc.RpcError) as info:
        apply(node, TENANT.format(n="sneak"), metadata)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    nothing_stored(node)


def test_prune_never_touches_unlabelled_records(node: harness.Sitsmesh) -> None:
    node.cli("tenants", "create", "by-hand", "--models", "*")
    try:
        reply = apply(node, TENANT.format(n="x"))
        assert [r.name for r in reply.results] == ["tx"]
        with grpc.insecure_channel(node.admin_addr) as channel:
            pruned = config_pb2_grpc.ConfigServiceStub(channel).Apply(
                config_pb2.ApplyRequest(files=[one(TENANT.format(n="x"))], prune=True,
                                        prune_selector="sitsmesh.io/managed-by=team-a"),
                timeout=5, metadata=node.admin_metadata())
        assert [r.action for r in pruned.results] == [config_pb2.APPLY_ACTION_UNCHANGED]
        assert node.cli("tenants", "get", "by-hand").returncode == 0
    finally:
        node.cli("tenants", "delete", "by-hand")
        node.cli("tenants", "delete", "tx")

