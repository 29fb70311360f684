"""Real local processes for the integration tests and the benchmarks: `sitsmesh serve`,
Envoy, and a small HTTP upstream, each on free loopback ports.

Each runs in its own session so teardown can kill the whole group, even when
the caller failed half-way. Like `sitsmesh dev`, it runs from a source checkout:
Envoy's configs come from the checkout's filters/.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sitsmesh.admin.v1 import admin_pb2, admin_pb2_grpc
from sitsmesh.dev import envoyconf

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SITSMESH = str(BIN / "sitsmesh")
ENVOY = str(BIN / "envoy")


# Below Linux's ephemeral range (32768-60999): a port the OS hands out for "any free
# port" can meanwhile become the source port of some process's outgoing connection
# (Envoy's health checks, say) before the server meant for it binds.
_PORTS = (20000, 32000)


def port_range() -> tuple[int, int]:
    """Under pytest-xdist each worker draws from its own slice: two workers that pick the
    same free port before either binds it would collide, and neither could see it.
    Processes a worker starts inherit its variables, and so its slice."""
    low, high = _PORTS
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and worker[2:].isdigit() and count.isdigit() and int(count) > 1:
        size = (high - low) // int(count)
        low += int(worker[2:]) % int(count) * size
        return low, low + size
    return low, high
_issued: set[int] = set()


def free_port() -> int:
    """A loopback port nothing listens on, outside the ephemeral range, not handed out
    before by this process."""
    for _ in range(200):
        port = random.randrange(*port_range())  # noqa: S311 - a port, not a secret
        if port in _issued:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _issued.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        fallback: int = s.getsockname()[1]
        return fallback


def wait_until(predicate: Any, timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def health_status(addr: str, service: str = "", timeout: float = 1.0) -> int | None:
    """The gRPC health status, or None when the server does not answer."""
    with grpc.insecure_channel(addr) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError:
            return None
    status: int = reply.status
    return status


@dataclass
class Proc:
    """A child process with its combined output in a file."""

    proc: subprocess.Popen[bytes]
    log_path: Path

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def spawn(argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> Proc:
    log = log_path.open("wb")
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                            start_new_session=True, cwd=REPO)
    log.close()
    return Proc(proc, log_path)


@dataclass
class Sitsmesh(Proc):
    data_addr: str = ""
    admin_addr: str = ""
    metrics_addr: str = ""
    state_dir: Path = field(default_factory=Path)

    @property
    def token(self) -> str:
        return (self.state_dir / "admin-token").read_text().strip()

    def admin_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),)

    def cli(self, *args: str, env: dict[str, str] | None = None,
            timeout: float = 20) -> subprocess.CompletedProcess[str]:
        return run_cli(*args, "--admin", self.admin_addr, "--state-dir", str(self.state_dir),
                       env=env, timeout=timeout)

    def pressure(self, pipeline: str) -> admin_pb2.PipelinePressure:
        """One WatchPressure snapshot of `pipeline`: the controller's latest decision."""
        with grpc.insecure_channel(self.admin_addr) as channel:
            stream = admin_pb2_grpc.AdminServiceStub(channel).WatchPressure(
                admin_pb2.WatchPressureRequest(pipeline=pipeline, count=1),
                metadata=self.admin_metadata(), timeout=5)
            [snapshot] = list(stream)
        [decision] = snapshot.pipelines
        return decision

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://{self.metrics_addr}/metrics", timeout=5) as resp:
            body: bytes = resp.read()
        return body.decode()


def run_cli(*args: str, env: dict[str, str] | None = None,
            timeout: float = 20) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SITSMESH_")}
    full_env.update(env or {})
    return subprocess.run([SITSMESH, *args], capture_output=True, text=True, env=full_env,
                          timeout=timeout, check=False, cwd=REPO)


def start_sitsmesh(tmp: Path, *extra: str, env: dict[str, str] | None = None,
                   drain: float = 0.5, wait: bool = True, name: str = "sitsmesh",
                   state_dir: Path | None = None,
                   addrs: tuple[str, str, str] | None = None) -> Sitsmesh:
    """`state_dir` shared by several replicas gives them one admin state; `addrs` (data,
    admin, metrics) restarts a replica where the Envoy in front of it expects it."""
    data, admin, metrics = addrs or tuple(f"127.0.0.1:{free_port()}" for _ in range(3))
    state = state_dir or tmp / f"{name}-state"
    argv = [SITSMESH, "serve", "--data-addr", data, "--admin-addr", admin,
            "--metrics-addr", metrics, "--state-dir", str(state),
            "--drain-seconds", str(drain), "--grace-seconds", "5", "--log-format", "json",
            *extra]
    clean_env = {k: "" for k in os.environ if k.startswith("SITSMESH_")}
    base = spawn(argv, tmp / f"{name}.log", env={**clean_env, **(env or {})})
    node = Sitsmesh(base.proc, base.log_path, data, admin, metrics, state)
    if wait:
        try:
            wait_until(lambda: _serving_or_dead(node), 30, f"sitsmesh on {data}")
        except TimeoutError:
            node.kill()
            raise
        if node.proc.poll() is not None:
            raise RuntimeError(f"sitsmesh exited {node.proc.returncode}:\n{node.output()}")
    return node


def _serving_or_dead(node: Sitsmesh) -> bool:
    if node.proc.poll() is not None:
        return True
    return bool(health_status(node.data_addr) == health_pb2.HealthCheckResponse.SERVING
            and health_status(node.admin_addr) == health_pb2.HealthCheckResponse.SERVING)


@dataclass
class Envoy(Proc):
    listen_port: int = 0
    admin_port: int = 0
    config_path: Path = field(default_factory=Path)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.listen_port}{path}"

    def post_status(self, path: str, headers: dict[str, str], body: bytes = b"{}") -> int:
        """POST through the listener; the HTTP status, whatever it is."""
        req = urllib.request.Request(self.url(path), data=body,  # noqa: S310 (http://)
                                     headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:  # noqa: S310
                return int(resp.status)
        except urllib.error.HTTPError as err:
            return err.code

    def admin_get(self, path: str) -> str:
        url = f"http://127.0.0.1:{self.admin_port}{path}"
        with urllib.request.urlopen(url, timeout=5) as resp:
            body: bytes = resp.read()
        return body.decode()

    def cluster_health(self, cluster: str) -> list[str]:
        """health_flags of each host in a cluster, from Envoy's /clusters."""
        prefix = f"{cluster}::"
        return [line.rsplit("::", 1)[1] for line in self.admin_get("/clusters").splitlines()
                if line.startswith(prefix) and "::health_flags::" in line]


def envoy_values(sitsmesh_addr: str, upstream_port: int, listen_port: int,
                 admin_port: int, access_log_flush: str = "0.02s") -> dict[str, object]:
    # A fast health interval: tests watch Envoy notice sitsmesh draining.
    return envoyconf.local_values(sitsmesh_addr=sitsmesh_addr, upstream_port=upstream_port,
                                  listen_port=listen_port, envoy_admin_port=admin_port,
                                  health_interval="0.25s", access_log_flush=access_log_flush)


def start_envoy(tmp: Path, sitsmesh_addr: str, upstream_port: int,
                bootstrap: Path = REPO / "filters" / "local" / "bootstrap.yaml",
                fragments: list[str] | None = None, *,
                access_log_flush: str = "0.02s", replicas: Sequence[str] = (),
                rlqs_addr: str = "",
                edit: Callable[[dict[str, Any]], None] | None = None) -> Envoy:
    """`replicas`: the data addresses of every sitsmesh replica, all endpoints of the
    sitsmesh_data cluster (default: sitsmesh_addr alone); `rlqs_addr`: sitsmesh's RLQS
    process, where the rate_limit_quota fragment then streams; `edit`: changes to the
    rendered bootstrap (envoyconf's route helpers) before Envoy starts."""
    listen, admin = free_port(), free_port()
    values = envoy_values(sitsmesh_addr, upstream_port, listen, admin, access_log_flush)
    rendered = envoyconf.render(bootstrap, values, fragments)
    if replicas:
        envoyconf.set_endpoints(rendered, "sitsmesh_data", replicas)
    if rlqs_addr:
        envoyconf.use_rlqs_addr(rendered, rlqs_addr)
    if edit is not None:
        edit(rendered)
    config = envoyconf.write(rendered, tmp / "envoy.yaml")
    return launch_envoy(config, listen, admin, tmp / "envoy.log")


def launch_envoy(config: Path, listen_port: int, admin_port: int, log_path: Path) -> Envoy:
    """Envoy on a written config, returned once its admin /ready says LIVE."""
    base = spawn([ENVOY, "-c", str(config), "--disable-hot-restart", "--log-level", "warn"],
                 log_path)
    node = Envoy(base.proc, base.log_path, listen_port, admin_port, config)

    def ready() -> bool:
        if node.proc.poll() is not None:
            raise RuntimeError(f"envoy exited {node.proc.returncode}:\n{node.output()}")
        try:
            return node.admin_get("/ready").strip() == "LIVE"
        except OSError:
            return False

    try:
        wait_until(ready, 30, "envoy /ready")
    except BaseException:
        node.kill()
        raise
    return node


class _EchoHandler(BaseHTTPRequestHandler):
    def _reply(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else b""
        payload = json.dumps({"method": self.command, "path": self.path,
                              "headers": {k.lower(): v for k, v in self.headers.items()},
                              "body": body.decode(errors="replace")}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = _reply

    def log_message(self, format: str, *args: Any) -> None:
        del format, args


@contextlib.contextmanager
def serving(server: ThreadingHTTPServer) -> Iterator[int]:
    """Serve from a thread until the block ends; yields the bound port."""
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def echo_upstream() -> Iterator[int]:
    """A real HTTP/1.1 server on loopback that echoes each request as JSON."""
    with serving(ThreadingHTTPServer(("127.0.0.1", 0), _EchoHandler)) as port:
        yield port


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus exposition; 0.0 when it is absent."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0
