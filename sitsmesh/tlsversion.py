"""The oldest TLS version this process's gRPC connections accept (`tls_min_version`).

grpcio's Python API has no TLS version knob: gRPC core keeps the minimum version on
its SSL credentials (`set_min_tls_version`, "for testing purposes only, until plumbed
to wrapped languages") and the cygrpc layer never calls it. What the C core does read
is GRPC_SSL_CIPHER_SUITES, the cipher list it gives BoringSSL for TLS 1.2 and below;
TLS 1.3's suites are fixed in BoringSSL and not taken from that list. So "1.3" sets
the list to one PSK suite: BoringSSL only selects a PSK suite when a PSK callback is
installed, which gRPC never does, so a TLS 1.2 handshake finds no shared cipher and
fails, either way round, while TLS 1.3 negotiates as before (the suites TLS 1.3 uses
are unchanged). tests/security/test_tls_version.py proves both sides with Python's ssl
module and a real server.

The variable is read once, when grpc is first imported, and applies to every gRPC
connection of the process: both of `serve`'s ports and its gRPC clients (OTLP, Triton).
Hence this module imports no grpc, and `require` must run before anything does.
"""

from __future__ import annotations

import os
import sys

from sitsmesh.errors import ConfigError

VERSIONS = ("1.2", "1.3")
CIPHER_SUITES_ENV = "GRPC_SSL_CIPHER_SUITES"
# A TLS 1.2 suite nobody can agree on without a pre-shared key (see above).
TLS12_NOTHING = "ECDHE-PSK-CHACHA20-POLY1305"


def require(version: str, where: str) -> None:
    """Make this process's gRPC refuse TLS below `version` ("1.2" changes nothing).
    `where` names the setting in errors. Raises ConfigError when that cannot be
    guaranteed: the variable already holds another list, or grpc is already loaded."""
    if version == "1.2":
        return
    if version != "1.3":
        raise ConfigError(f"{where}: must be one of {', '.join(VERSIONS)}; got {version!r}")
    current = os.environ.get(CIPHER_SUITES_ENV)
    if current == TLS12_NOTHING:
        return
    if current:
        raise ConfigError(f"{where} 1.3: {CIPHER_SUITES_ENV} is set ({current!r}), and "
                          "TLS 1.3 is enforced through that variable; unset it")
    if "grpc" in sys.modules:
        # Too late to take effect: refuse rather than serve TLS 1.2 while saying 1.3.
        raise ConfigError(f"{where} 1.3: gRPC was loaded before the setting was read; "
                          f"set {CIPHER_SUITES_ENV}={TLS12_NOTHING} in the environment")
    os.environ[CIPHER_SUITES_ENV] = TLS12_NOTHING
