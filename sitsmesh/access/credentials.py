"""Named admin credentials from a YAML file: a role, scopes for operators, and either the
hash of a bearer token or an mTLS identity. Tokens themselves are never stored."""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from sitsmesh.errors import ConfigError

ROLES = ("viewer", "operator", "admin")
SCOPE_KINDS = ("tenants", "pipelines", "models")
HASH_PREFIX = "sha256:"
# Tokens are hashed with one fast SHA-256, which is only safe for random tokens: a
# brute force of 256 random bits is out of reach, a password's would not be.
MIN_TOKEN_BYTES = 32
BUILTIN_NAME = "admin"
_HASH = re.compile(r"sha256:[0-9a-f]{64}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,62}")
_KEYS = ("name", "role", "token_hash", "mtls_identity", "scopes")
GLOB_CHARS = frozenset("*?[")


def within(pattern: str, scope: str) -> bool:
    """Whether every name `pattern` (an fnmatch glob, or a plain name) can match is matched
    by the scope entry `scope`: the entry is '*'; or both are identical; or `pattern` is a
    plain name the entry matches; or the entry is a literal prefix and one trailing '*'
    and `pattern` starts with that prefix. Conservative: nothing else is within."""
    if scope in ("*", pattern):
        return True
    if GLOB_CHARS.isdisjoint(pattern):
        return fnmatch.fnmatchcase(pattern, scope)
    head = scope[:-1]
    return scope.endswith("*") and GLOB_CHARS.isdisjoint(head) and pattern.startswith(head)


@dataclass(frozen=True, slots=True)
class Credential:
    name: str
    role: str
    scopes: Mapping[str, frozenset[str]] = field(default_factory=dict)
    token_digest: bytes = b""
    identity: str = ""

    def covers(self, scope: str, name: str) -> bool:
        """Whether `name` lies within one of this credential's `scope` entries (tenants,
        pipelines, models: names, '*', or prefix globs such as 'team-a-*')."""
        return any(within(name, entry) for entry in self.scopes.get(scope, ()))


class CredentialSet:
    """One immutable snapshot of the file; a reload builds a new one and swaps it in."""

    __slots__ = ("_identities", "_tokens", "by_name", "source")

    def __init__(self, credentials: Iterable[Credential], source: str) -> None:
        self.source = source
        self.by_name = {c.name: c for c in credentials}
        self._tokens = tuple(c for c in self.by_name.values() if c.token_digest)
        self._identities = {c.identity: c for c in self.by_name.values() if c.identity}

    def by_token(self, token: bytes) -> Credential | None:
        digest = hashlib.sha256(token).digest()
        found = None
        # Every hash is compared, in constant time each, so the time taken tells an
        # attacker neither how much of a hash matched nor which entry did.
        for credential in self._tokens:
            if hmac.compare_digest(digest, credential.token_digest):
                found = credential
        return found

    def by_identity(self, identities: Iterable[str]) -> Credential | None:
        """The credential mapped to the first of the peer's identities that has one."""
        for identity in identities:
            credential = self._identities.get(identity)
            if credential is not None:
                return credential
        return None


def hash_token(token: str) -> str:
    """The `token_hash` line for a token; refuses tokens too short for a fast hash."""
    raw = token.strip().encode()
    if len(raw) < MIN_TOKEN_BYTES:
        raise ConfigError(f"token is {len(raw)} bytes; use at least {MIN_TOKEN_BYTES} random "
                          "bytes (`sitsmesh admin-credentials generate` makes one)")
    return HASH_PREFIX + hashlib.sha256(raw).hexdigest()


def new_token() -> str:
    return secrets.token_urlsafe(MIN_TOKEN_BYTES)


def builtin(token: str) -> CredentialSet:
    """The single admin token of old, as the credential `admin`, when no file is given."""
    digest = hashlib.sha256(token.encode()).digest()
    return CredentialSet([Credential(BUILTIN_NAME, "admin", token_digest=digest)],
                         "the admin token")


def load(path: Path) -> CredentialSet:
    """Parse and validate the whole file; raises ConfigError naming the file and entry."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read admin credentials: "
                          f"{exc.strerror or exc}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {str(exc).splitlines()[0]}") from None
    return parse(doc, str(path))


def parse(doc: Any, source: str) -> CredentialSet:
    if not isinstance(doc, dict) or set(doc) != {"credentials"}:
        raise ConfigError(f"{source}: expected a mapping with the one key 'credentials'")
    entries = doc["credentials"]
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{source}: 'credentials' must be a non-empty list")
    seen: dict[str, str] = {}
    credentials: list[Credential] = []
    for index, entry in enumerate(entries):
        credential = _entry(entry, f"{source}: credentials[{index}]")
        where = f"{source}: credentials[{index}] ({credential.name})"
        for key in (f"name {credential.name}", f"token {credential.token_digest.hex()}",
                    f"identity {credential.identity}"):
            if key.endswith(" "):
                continue
            if key in seen:
                what = key.partition(" ")[0]
                raise ConfigError(f"{where}: duplicate {what}, already used by {seen[key]}")
            seen[key] = credential.name
        credentials.append(credential)
    return CredentialSet(credentials, source)


def _entry(entry: Any, where: str) -> Credential:
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: each credential must be a mapping")
    name = entry.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(f"{where}: name must be 1-63 letters, digits, '.', '_', '@' or "
                          f"'-', got {name!r}")
    where = f"{where} ({name})"
    unknown = [str(k) for k in entry if k not in _KEYS]
    if unknown:
        raise ConfigError(f"{where}: unknown key '{unknown[0]}' (expected one of "
                          f"{', '.join(_KEYS)})")
    role = entry.get("role")
    if role not in ROLES:
        raise ConfigError(f"{where}: unknown role {role!r} (expected viewer, operator or "
                          "admin)")
    token_hash, identity = entry.get("token_hash"), entry.get("mtls_identity")
    if (token_hash is None) == (identity is None):
        raise ConfigError(f"{where}: give exactly one of token_hash and mtls_identity")
    digest = b""
    if token_hash is not None:
        if not isinstance(token_hash, str) or not _HASH.fullmatch(token_hash):
            raise ConfigError(f"{where}: token_hash must be 'sha256:' and 64 lowercase hex "
                              "digits (`sitsmesh admin-credentials hash` prints one)")
        digest = bytes.fromhex(token_hash.removeprefix(HASH_PREFIX))
    if identity is not None and (not isinstance(identity, str) or not identity.strip()):
        raise ConfigError(f"{where}: mtls_identity must be a certificate SAN such as "
                          "spiffe://cluster.local/ns/team-a/sa/deployer")
    return Credential(name, role, _scopes(entry.get("scopes"), role, where), digest,
                      identity or "")


def _scopes(raw: Any, role: str, where: str) -> Mapping[str, frozenset[str]]:
    if role != "operator":
        if raw is not None:
            raise ConfigError(f"{where}: scopes apply to operators only; a {role} "
                              f"{'reads' if role == 'viewer' else 'changes'} everything")
        return {}
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"{where}: an operator needs scopes: some of "
                          f"{', '.join(SCOPE_KINDS)}, each a list of names or '*'")
    scopes: dict[str, frozenset[str]] = {}
    for kind, names in raw.items():
        if kind not in SCOPE_KINDS:
            raise ConfigError(f"{where}: unknown scope '{kind}' (expected "
                              f"{', '.join(SCOPE_KINDS)})")
        if (not isinstance(names, list) or not names
                or not all(isinstance(n, str) and n for n in names)):
            raise ConfigError(f"{where}: scopes.{kind} must be a non-empty list of names "
                              "or '*'")
        scopes[kind] = frozenset(names)
    return scopes
