"""A tenant, its key and gRPC frames of ModelInferRequests, for the unit tests of the
per-message checks of gRPC streams."""

from __future__ import annotations

from sitsmesh.authz.admission import Admission, AdmissionPolicy
from sitsmesh.authz.check import Authorizer, AuthzSettings, AuthzSnapshot
from sitsmesh.authz.model import ApiKey, Tenant, digest, new_key

KEY_ID, KEY = new_key()
ACME = Tenant("acme", ("llama-*",))
PATH = "/inference.GRPCInferenceService/ModelStreamInfer"


def acme_authorizer() -> Authorizer:
    keys = {KEY_ID: ApiKey(KEY_ID, "acme", digest(KEY), 0.0)}
    return Authorizer(AuthzSnapshot({"acme": ACME}, keys), AuthzSettings(),
                      Admission(AdmissionPolicy({"acme": 10}), hold_s=5), clock=lambda: 1.0)


def frame_of(model: str, padding: int = 0) -> bytes:
    """A gRPC frame of a ModelInferRequest: model_name (1), id (3, a string)."""
    name = model.encode()
    body = b"\x0a" + bytes([len(name)]) + name
    if padding:
        body += b"\x1a" + varint(padding) + b"x" * padding
    return b"\x00" + len(body).to_bytes(4, "big") + body


def varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
