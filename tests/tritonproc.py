"""Run a real tritonserver (from the nvidia-pytriton wheel) for tests: loopback only,
explicit model control, restartable on the same ports.

The server runs in its own session (see harness.spawn), so teardown kills it and
its python backend stubs even when a test failed half-way.
"""

from __future__ import annotations

import contextlib
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from sitsmesh.triton import launcher
from tests import harness


def live(http_port: int, timeout: float = 0.5) -> bool:
    url = f"http://127.0.0.1:{http_port}/v2/health/live"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


class TritonServer:
    """One tritonserver over `model_repo`; its three ports stay the same across restarts."""

    def __init__(self, workdir: Path, model_repo: Path, extra: tuple[str, ...] = ()) -> None:
        # Fails loudly: a silent skip would hide that CI stopped testing against Triton.
        self.install = launcher.find_tritonserver()
        self.workdir = workdir
        self.model_repo = model_repo
        self.extra = extra
        self.http_port = harness.free_port()
        self.grpc_port = harness.free_port()
        self.metrics_port = harness.free_port()
        self.proc: harness.Proc | None = None
        self._starts = 0

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.proc.poll() is None

    @property
    def log_path(self) -> Path | None:
        return self.proc.log_path if self.proc is not None else None

    def output(self) -> str:
        return self.proc.output() if self.proc is not None else ""

    def metrics(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=5) as resp:
            body: bytes = resp.read()
        return body.decode()

    def start(self, timeout: float = 30) -> None:
        if self.running:
            raise RuntimeError(f"tritonserver already running on {self.grpc_url}")
        self.workdir.mkdir(parents=True, exist_ok=True)
        backends = launcher.prepare_backend_dir(self.install, self.workdir)
        argv = launcher.triton_argv(self.install, backends, self.model_repo,
                                    http_port=self.http_port, grpc_port=self.grpc_port,
                                    metrics_port=self.metrics_port, extra=self.extra)
        self._starts += 1
        proc = harness.spawn(argv, self.workdir / f"triton-{self._starts}.log",
                             env=launcher.triton_env(self.install))
        self.proc = proc

        def up() -> bool:
            if proc.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited {proc.proc.returncode}:\n"
                                   f"{proc.output()}")
            return live(self.http_port)

        try:
            harness.wait_until(up, timeout, f"tritonserver on {self.http_url}")
        except BaseException:
            proc.kill()
            raise

    def stop(self, timeout: float = 20) -> int | None:
        """Graceful: SIGTERM and the exit code; then the process group is killed regardless."""
        if self.proc is None:
            return None
        return self.proc.stop(signal.SIGTERM, timeout)

    def kill(self) -> None:
        """Abrupt, like a crash: SIGKILL to the process group (server and stubs)."""
        if self.proc is not None:
            self.proc.kill()

    def restart(self, timeout: float = 30) -> None:
        self.kill()
        self.start(timeout)


@contextlib.contextmanager
def triton_server(workdir: Path, model_repo: Path) -> Iterator[TritonServer]:
    server = TritonServer(workdir, model_repo)
    server.start()
    try:
        yield server
    finally:
        server.kill()
