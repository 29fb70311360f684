"""What the sync and async clients share: connection options, call metadata, the error."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.field_mask_pb2 import FieldMask

DEFAULT_TIMEOUT_S = 10.0


class AdminError(Exception):
    """Any failed admin call: the gRPC status code and the server's message."""

    def __init__(self, code: grpc.StatusCode, message: str, method: str = "") -> None:
        super().__init__(f"{method + ': ' if method else ''}{code.name}: {message}")
        self.code = code
        self.message = message
        self.method = method


def error_from(exc: grpc.RpcError, method: str) -> AdminError:
    # grpc.RpcError itself declares neither; the errors raised by calls (sync and aio) have both.
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else None
    return AdminError(code or grpc.StatusCode.UNKNOWN, str(details or ""), method)


@dataclass(frozen=True, slots=True)
class Tls:
    """TLS to the admin API. `ca_file`: the CA bundle that signed the server's certificate
    (the system's when None); `cert_file`/`key_file`: a client certificate, when the server
    wants mTLS; `server_name`: the name to verify when it differs from the target's host."""

    ca_file: str | Path | None = None
    cert_file: str | Path | None = None
    key_file: str | Path | None = None
    server_name: str = ""

    def credentials(self) -> grpc.ChannelCredentials:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together")

        def read(path: str | Path | None) -> bytes | None:
            return Path(path).read_bytes() if path is not None else None

        return grpc.ssl_channel_credentials(root_certificates=read(self.ca_file),
                                            private_key=read(self.key_file),
                                            certificate_chain=read(self.cert_file))

    def options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    if not token:
        raise ValueError("the admin API wants a bearer token")
    return (("authorization", f"Bearer {token}"),)


def mask(fields: tuple[str, ...] | list[str]) -> FieldMask | None:
    """A read mask naming `fields`; None (every field) when there are none."""
    return FieldMask(paths=list(fields)) if fields else None
