"""Who may do what on the admin API: named credentials with roles, and the policy that
decides each call. Plain Python, no grpc: the admin transport asks, this answers."""

from sitsmesh.access.credentials import Credential, CredentialSet, builtin, hash_token, load
from sitsmesh.access.policy import (
    GLOBAL,
    MODEL,
    PIPELINE,
    READ,
    SCOPE_OF,
    TENANT,
    WRITE,
    denial,
)

__all__ = ["GLOBAL", "MODEL", "PIPELINE", "READ", "SCOPE_OF", "TENANT", "WRITE", "Credential",
           "CredentialSet", "builtin", "denial", "hash_token", "load"]
