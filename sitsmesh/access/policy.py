"""The decision for one admin call: may this credential do this verb to this resource?

Every role reads everything (a viewer exists to see; operators see the whole mesh they
share, so a team can tell whose pipeline is hurting theirs). Writes: an admin anywhere;
an operator only to the tenants, pipelines and models its scopes name; global settings
(rate-limit config, stage reports, anything unnamed) admin only; a viewer never.
"""

from __future__ import annotations

from sitsmesh.access.credentials import Credential

READ, WRITE = "read", "write"
TENANT, PIPELINE, MODEL, GLOBAL = "tenant", "pipeline", "model", "global"
SCOPE_OF = {TENANT: "tenants", PIPELINE: "pipelines", MODEL: "models"}


def denial(credential: Credential, verb: str, kind: str, name: str) -> str | None:
    """None when allowed; otherwise why not, naming the credential, verb and resource."""
    if credential.role == "admin" or verb == READ:
        return None
    resource = f"{kind} '{name}'" if kind != GLOBAL else "global settings"
    if kind != GLOBAL and not name:
        resource = f"an unnamed {kind}"
    who = f"credential '{credential.name}' ({credential.role})"
    if credential.role == "viewer":
        return f"{who} may not {verb} {resource}: viewers only read"
    scope = SCOPE_OF.get(kind)
    if scope is None:
        return f"{who} may not {verb} {resource}: only admins may"
    if name and credential.covers(scope, name):
        return None
    return f"{who} may not {verb} {resource}: not in its {scope} scope"
