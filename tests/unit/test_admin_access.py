"""Admin credentials (file validation, token hashes) and the per-resource policy: pure
logic. Through a real server: tests/security/test_admin_rbac.py."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

import pytest

from sitsmesh.access import GLOBAL, MODEL, PIPELINE, READ, TENANT, WRITE, denial
from sitsmesh.access.credentials import (
    Credential,
    CredentialSet,
    builtin,
    hash_token,
    load,
    parse,
)
from sitsmesh.admin.v1 import admin_pb2
from sitsmesh.errors import ConfigError
from sitsmesh.transport.adminaccess import (
    NOT_PARSED,
    RULES,
    VIA_YAML,
    AdminAccess,
    parsed,
    rule,
)
from sitsmesh.transport.errors import Refused

TOKEN = "t" * 40
HASH = hash_token(TOKEN)
SERVICE = admin_pb2.DESCRIPTOR.services_by_name["AdminService"]


def test_every_admin_rpc_has_a_rule() -> None:
    assert set(RULES) == set(SERVICE.methods_by_name)


def test_an_rpc_missing_from_the_table_is_admin_only() -> None:
    assert (rule("SomeNewRpc").verb, rule("SomeNewRpc").kind) == (WRITE, GLOBAL)


@pytest.mark.parametrize("method", sorted(RULES))
def test_each_rule_names_a_field_of_its_request(method: str) -> None:
    wanted = RULES[method]
    if not wanted.field:
        return
    message = SERVICE.methods_by_name[method].input_type
    for part in wanted.field.split("."):
        assert part in message.fields_by_name, (method, wanted.field)
        message = message.fields_by_name[part].message_type or message


def _doc(**entry: object) -> dict[str, object]:
    return {"credentials": [{"name": "team-a", "role": "operator", "token_hash": HASH,
                             "scopes": {"tenants": ["a"]}, **entry}]}


@pytest.mark.parametrize(("entry", "message"), [
    ({"role": "root"}, "f: credentials[0] (team-a): unknown role 'root' (expected viewer, "
                       "operator or admin)"),
    ({"token_hash": "sha256:abc"}, "f: credentials[0] (team-a): token_hash must be 'sha256:' "
                                   "and 64 lowercase hex digits (`sitsmesh admin-credentials "
                                   "hash` prints one)"),
    ({"scopes": None}, "f: credentials[0] (team-a): an operator needs scopes: some of "
                       "tenants, pipelines, models, each a list of names or '*'"),
    ({"scopes": {"tenants": []}}, "f: credentials[0] (team-a): scopes.tenants must be a "
                                  "non-empty list of names or '*'"),
    ({"scopes": {"teams": ["a"]}}, "f: credentials[0] (team-a): unknown scope 'teams' "
                                   "(expected tenants, pipelines, models)"),
    ({"mtls_identity": "spiffe://x"}, "f: credentials[0] (team-a): give exactly one of "
                                      "token_hash and mtls_identity"),
    ({"role": "viewer"}, "f: credentials[0] (team-a): scopes apply to operators only; a "
                         "viewer reads everything"),
    ({"token": TOKEN}, "f: credentials[0] (team-a): unknown key 'token' (expected one of "
                       "name, role, token_hash, mtls_identity, scopes)"),
    ({"name": "a b"}, "f: credentials[0]: name must be 1-63 letters, digits, '.', '_', '@' "
                      "or '-', got 'a b'"),
])
def test_bad_entries_are_refused_precisely(entry: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse(_doc(**entry), "f")
    assert err.value.message == message


def test_duplicates_are_refused() -> None:
    twice = {"credentials": [*_doc()["credentials"],  # type: ignore[misc]
                             {"name": "team-a", "role": "viewer", "mtls_identity": "x"}]}
    with pytest.raises(ConfigError, match=r"credentials\[1\] \(team-a\): duplicate name, "
                                          "already used by team-a"):
        parse(twice, "f")
    same_token = {"credentials": [*_doc()["credentials"],  # type: ignore[misc]
                                  {"name": "b", "role": "viewer", "token_hash": HASH}]}
    with pytest.raises(ConfigError, match=r"\(b\): duplicate token, already used by team-a"):
        parse(same_token, "f")
    same_san = {"credentials": [{"name": n, "role": "viewer", "mtls_identity": "spiffe://x"}
                                for n in ("a", "b")]}
    with pytest.raises(ConfigError, match=r"\(b\): duplicate identity, already used by a"):
        parse(same_san, "f")


def test_a_file_that_cannot_be_read_or_parsed_names_itself(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"missing\.yaml: cannot read admin credentials"):
        load(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("credentials: [\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: invalid YAML"):
        load(bad)
    bad.write_text("- name: a\n")
    with pytest.raises(ConfigError, match="expected a mapping with the one key 'credentials'"):
        load(bad)


def test_tokens_match_only_their_hash_and_identities_their_san() -> None:
    creds = parse({"credentials": [
        {"name": "a", "role": "viewer", "token_hash": HASH},
        {"name": "ci", "role": "admin", "mtls_identity": "spiffe://t/ci"}]}, "f")
    found = creds.by_token(TOKEN.encode())
    assert found is not None and found.name == "a"
    assert creds.by_token(TOKEN.encode() + b"x") is None
    assert creds.by_token(b"") is None
    ci = creds.by_identity(["DNS:other", "spiffe://t/ci"])
    assert ci is not None and ci.name == "ci"
    assert creds.by_identity(["spiffe://t/other"]) is None
    assert builtin(TOKEN).by_token(TOKEN.encode()) is not None


def test_hash_refuses_short_tokens() -> None:
    assert hash_token(TOKEN + "\n") == HASH
    with pytest.raises(ConfigError, match="token is 5 bytes; use at least 32 random bytes"):
        hash_token("short")


VIEWER = Credential("dash", "viewer")
TEAM_A = Credential("team-a", "operator", {"tenants": frozenset({"a"}),
                                            "pipelines": frozenset({"*"})})
ADMIN = Credential("root", "admin")


def test_policy() -> None:
    for kind in (TENANT, PIPELINE, MODEL, GLOBAL):
        assert denial(VIEWER, READ, kind, "x") is None
        assert denial(ADMIN, WRITE, kind, "x") is None
    assert denial(VIEWER, WRITE, TENANT, "a") == (
        "credential 'dash' (viewer) may not write tenant 'a': viewers only read")
    assert denial(TEAM_A, WRITE, TENANT, "a") is None
    assert denial(TEAM_A, WRITE, PIPELINE, "anything") is None
    assert denial(TEAM_A, WRITE, TENANT, "b") == (
        "credential 'team-a' (operator) may not write tenant 'b': not in its tenants scope")
    assert denial(TEAM_A, WRITE, MODEL, "m") == (
        "credential 'team-a' (operator) may not write model 'm': not in its models scope")
    assert denial(TEAM_A, WRITE, TENANT, "") == (
        "credential 'team-a' (operator) may not write an unnamed tenant: not in its tenants "
        "scope")
    assert denial(TEAM_A, WRITE, GLOBAL, "") == (
        "credential 'team-a' (operator) may not write global settings: only admins may")


def test_the_cli_hashes_generates_and_checks(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from sitsmesh.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO(TOKEN + "\n"))
    assert main(["admin-credentials", "hash"]) == 0
    assert capsys.readouterr().out == f"token_hash: {HASH}\n"
    monkeypatch.setattr("sys.stdin", io.StringIO("short"))
    assert main(["admin-credentials", "hash"]) == 2
    assert "token is 5 bytes" in capsys.readouterr().err

    assert main(["admin-credentials", "generate", "-o", "json"]) == 0
    made = json.loads(capsys.readouterr().out)
    assert hash_token(made["token"]) == made["token_hash"]
    assert len(made["token"]) >= 43  # 32 random bytes, base64url

    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(_doc()))
    assert main(["admin-credentials", "check", str(path)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "NAME    ROLE      PROOF  SCOPES", "team-a  operator  token  tenants=a"]
    path.write_text(json.dumps(_doc(role="root")))
    assert main(["admin-credentials", "check", str(path)]) == 2
    assert "unknown role 'root'" in capsys.readouterr().err


class _Caller:
    """What AdminAccess reads of a call: its metadata, peer and TLS context; `abort`
    records the status, as grpc.aio does by raising."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.status: tuple[object, str] | None = None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),)

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def set_code(self, code: object) -> None:
        self.status = (code, "")

    def set_details(self, details: str) -> None:
        assert self.status is not None
        self.status = (self.status[0], details)


def test_what_the_credential_alone_decides_is_decided_before_the_yaml_is_read() -> None:
    tokens = {"viewer": "v" * 40, "admin": "r" * 40, "operator": "o" * 40}
    creds = CredentialSet([
        Credential("dash", "viewer", token_digest=_digest(tokens["viewer"])),
        Credential("root", "admin", token_digest=_digest(tokens["admin"])),
        Credential("ops", "operator", {"tenants": frozenset({"a"})},
                   token_digest=_digest(tokens["operator"]))], "test")
    looked: list[str] = []

    async def lookup(text: str) -> str:
        looked.append(text)
        return "p"

    # The YAML lookup replaced by one that records being asked: the parse this watches.
    access = AdminAccess(creds, {VIA_YAML: lookup})

    async def handler(request: object, context: object) -> str:
        return "done"

    guarded = access.guard("ApplyPipeline", handler)
    request = admin_pb2.ApplyPipelineRequest(yaml="name: p\n" + "x" * 1000)
    outcomes = {}
    for role, token in tokens.items():
        caller = _Caller(token)
        try:
            outcomes[role] = asyncio.run(guarded(request, caller))
        except Refused:
            outcomes[role] = caller.status[1] if caller.status else ""
    assert outcomes["admin"] == "done"
    assert "viewers only read" in outcomes["viewer"]
    # An operator with no pipelines scope: refused by the credential alone too.
    assert "not in its pipelines scope" in outcomes["operator"]
    assert looked == []


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def test_an_operator_s_pipeline_yaml_is_parsed_once_per_call() -> None:
    creds = CredentialSet([Credential("ops", "operator", {"pipelines": frozenset({"p"})},
                                      token_digest=_digest("o" * 40))], "test")
    seen: list[object] = []

    async def handler(request: admin_pb2.ApplyPipelineRequest, context: object) -> str:
        seen.append(parsed(request.yaml))
        seen.append(parsed(request.yaml + " "))
        return "done"

    guarded = AdminAccess(creds, {}).guard("ApplyPipeline", handler)
    assert asyncio.run(guarded(admin_pb2.ApplyPipelineRequest(yaml="name: p\n"),
                               _Caller("o" * 40))) == "done"
    assert seen == [{"name": "p"}, NOT_PARSED]
