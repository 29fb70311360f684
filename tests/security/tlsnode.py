"""Start `sitsmesh serve` with TLS listeners and talk to it over TLS (the harness's own
wait speaks plaintext, so these tests wait for TLS health themselves)."""

from __future__ import annotations

from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sitsmesh.dev import harness
from tests.security.pki import Pair

SERVING = health_pb2.HealthCheckResponse.SERVING


def channel(addr: str, ca: Path | None = None, client: Pair | None = None) -> grpc.Channel:
    """Plaintext without `ca`; TLS trusting `ca` with it, presenting `client` if given."""
    if ca is None:
        return grpc.insecure_channel(addr)
    creds = grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes(),
        private_key=client.key.read_bytes() if client else None,
        certificate_chain=client.cert.read_bytes() if client else None)
    return grpc.secure_channel(addr, creds)


def health(addr: str, ca: Path | None = None, client: Pair | None = None) -> int | None:
    with channel(addr, ca, client) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                        timeout=2)
        except grpc.RpcError:
            return None
    status: int = reply.status
    return status


def start(tmp: Path, *extra: str, data: tuple[Path | None, Pair | None] = (None, None),
          admin: tuple[Path | None, Pair | None] = (None, None),
          env: dict[str, str] | None = None, name: str = "sitsmesh",
          data_addr: str = "") -> harness.Sitsmesh:
    """`serve` with `extra` flags, returned once both servers answer health over the
    transport `data` / `admin` describe: (CA to trust or None for plaintext, client pair).
    `data_addr`: a fixed data address (to restart on the same one)."""
    fixed = ("--data-addr", data_addr) if data_addr else ()
    node = harness.start_sitsmesh(tmp, *extra, *fixed, env=env, wait=False, name=name)
    node.data_addr = data_addr or node.data_addr

    def up() -> bool:
        if node.proc.poll() is not None:
            raise RuntimeError(f"sitsmesh exited {node.proc.returncode}:\n{node.output()}")
        return bool(health(node.data_addr, *data) == SERVING
                    and health(node.admin_addr, *admin) == SERVING)

    try:
        harness.wait_until(up, 30, f"sitsmesh over TLS on {node.data_addr}")
    except BaseException:
        node.kill()
        raise
    return node
