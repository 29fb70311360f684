"""Check latency from a well-behaved caller while the admin API takes large writes
(issue 26): idle, then with viewers sending 3.9 MB ApplyPipeline calls (refused) and an
operator sending 3.9 MB (refused by size) and 0.96 MB (parsed, refused by content)
ones, side by side in one `sitsmesh serve`. Prints a markdown table; exits 1 when a Check fails.

    .venv/bin/python bench/admin_isolation.py [--seconds 10] [--viewers 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
from envoy.service.auth.v3 import attribute_context_pb2, external_auth_pb2, external_auth_pb2_grpc

from sitsmesh.access.credentials import hash_token
from sitsmesh.admin.v1 import admin_pb2, admin_pb2_grpc
from sitsmesh.dev import harness

ROOT, TEAM_A, VIEWER = "r" * 40, "a" * 40, "v" * 40
HUGE = "name: pipe-a\nmodels:\n" + "".join(f"- m{i:07d}\n" for i in range(355_000))
# Parsed, then refused by content (models outside team-a's scope): the parse and the
# judgement are what this measures, not a 60 000-glob pipeline being served.
LARGE = "name: pipe-a\nmodels:\n" + "".join(f"- other-{i:07d}\n" for i in range(60_000))


def _meta(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _measure(node: harness.Sitsmesh, request: external_auth_pb2.CheckRequest,
             seconds: float) -> list[float]:
    waits = []
    with grpc.insecure_channel(node.data_addr) as channel:
        stub = external_auth_pb2_grpc.AuthorizationStub(channel)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            began = time.monotonic()
            if stub.Check(request, timeout=60).status.code != 0:
                raise SystemExit("a Check was refused")
            waits.append(time.monotonic() - began)
            time.sleep(0.01)
    return waits


def _row(name: str, waits: list[float], writes: int) -> str:
    ms = sorted(w * 1000 for w in waits)
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    return (f"| {name} | {len(ms)} | {statistics.median(ms):.1f} | {p99:.1f} | "
            f"{ms[-1]:.1f} | {writes} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--viewers", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        creds = Path(tmp) / "credentials.yaml"
        creds.write_text(json.dumps({"credentials": [
            {"name": "root", "role": "admin", "token_hash": hash_token(ROOT)},
            {"name": "team-a", "role": "operator", "token_hash": hash_token(TEAM_A),
             "scopes": {"tenants": ["team-a"], "pipelines": ["pipe-a"],
                        "models": ["team-a-*"]}},
            {"name": "dashboards", "role": "viewer", "token_hash": hash_token(VIEWER)}]}))
        node = harness.start_sitsmesh(Path(tmp), "--admin-credentials", str(creds))
        try:
            with grpc.insecure_channel(node.admin_addr) as channel:
                admin = admin_pb2_grpc.AdminServiceStub(channel)
                admin.CreateTenant(admin_pb2.CreateTenantRequest(tenant=admin_pb2.Tenant(
                    name="team-a", models=["team-a-llm"])), metadata=_meta(ROOT), timeout=5)
                key = admin.CreateApiKey(admin_pb2.CreateApiKeyRequest(tenant="team-a"),
                                         metadata=_meta(ROOT), timeout=5).secret
            ctx = attribute_context_pb2.AttributeContext
            check = external_auth_pb2.CheckRequest(attributes=ctx(request=ctx.Request(
                http=ctx.HttpRequest(method="POST", path="/v2/models/team-a-llm/infer",
                                     headers={"x-api-key": key}))))
            idle = _measure(node, check, args.seconds)
            stop = threading.Event()
            sent = [0]

            def send(token: str, text: str) -> None:
                with grpc.insecure_channel(node.admin_addr) as channel:
                    stub = admin_pb2_grpc.AdminServiceStub(channel)
                    while not stop.is_set():
                        with contextlib.suppress(grpc.RpcError):
                            stub.ApplyPipeline(admin_pb2.ApplyPipelineRequest(yaml=text),
                                               metadata=_meta(token), timeout=120)
                        sent[0] += 1

            senders = [threading.Thread(target=send, args=(VIEWER, HUGE))
                       for _ in range(args.viewers)]
            senders += [threading.Thread(target=send, args=(TEAM_A, HUGE)),
                        threading.Thread(target=send, args=(TEAM_A, LARGE))]
            for sender in senders:
                sender.start()
            try:
                loaded = _measure(node, check, args.seconds)
            finally:
                stop.set()
                for sender in senders:
                    sender.join(180)
        finally:
            node.kill()
    print("| Check while | checks | p50 ms | p99 ms | max ms | admin writes |")
    print("|---|---|---|---|---|---|")
    print(_row("idle", idle, 0))
    print(_row(f"{args.viewers} viewers 3.9 MB + operator 3.9 MB and 0.96 MB", loaded,
               sent[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
