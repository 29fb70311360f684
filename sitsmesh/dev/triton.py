"""A local tritonserver from the nvidia-pytriton wheel, for `make run`, tests and benchmarks.

The wheel ships the server binary, the python backend and one backend stub per
Python version, but not in the layout tritonserver expects: the stub for the
running Python has to sit next to libtriton_python.so. `prepare_backend_dir`
builds that layout under a work directory, leaving the installed wheel untouched.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import sys
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from sitsmesh.dev import harness

_INSTALL_HINT = "pip install 'sitsmesh[triton]'"
STUB_NAME = "triton_python_backend_stub"


@dataclass(frozen=True, slots=True)
class TritonInstall:
    """Where the pieces of one installed nvidia-pytriton wheel are."""

    binary: Path
    backends_dir: Path
    stub: Path
    libs_dir: Path


def find_tritonserver() -> TritonInstall:
    """Locate tritonserver, its backends, the stub for this Python and the bundled libs."""
    # find_spec does not import pytriton, which would pull in its whole client stack.
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"nvidia-pytriton is not installed: {_INSTALL_HINT}")
    package = Path(next(iter(spec.submodule_search_locations)))
    dist = package / "tritonserver"
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    install = TritonInstall(
        binary=dist / "bin" / "tritonserver",
        backends_dir=dist / "backends",
        stub=dist / "python_backend_stubs" / py / STUB_NAME,
        # auditwheel puts the server's shared libraries beside the package, not inside it.
        libs_dir=package.parent / "nvidia_pytriton.libs",
    )
    wanted = {
        "tritonserver binary": install.binary,
        "python backend": install.backends_dir / "python" / "libtriton_python.so",
        f"python backend stub for Python {py}": install.stub,
        "bundled libraries": install.libs_dir,
    }
    missing = [f"{what} ({path})" for what, path in wanted.items() if not path.exists()]
    if missing:
        raise RuntimeError(f"nvidia-pytriton at {package} is incomplete, missing: "
                           f"{', '.join(missing)}; reinstall it: {_INSTALL_HINT}")
    return install


def prepare_backend_dir(install: TritonInstall, workdir: Path) -> Path:
    """A --backend-directory whose python backend has this Python's stub beside it.

    Every entry is a symlink into the wheel, so this is cheap and idempotent.
    """
    backends = workdir / "backends"
    for backend in sorted(install.backends_dir.iterdir()):
        if not backend.is_dir() or backend.name == "__pycache__":
            continue
        target = backends / backend.name
        target.mkdir(parents=True, exist_ok=True)
        for item in backend.iterdir():
            if item.name != "__pycache__":
                _symlink(item, target / item.name)
    _symlink(install.stub, backends / "python" / STUB_NAME)
    return backends


def _symlink(source: Path, link: Path) -> None:
    if link.is_symlink() or link.exists():
        if link.is_symlink() and link.readlink() == source:
            return
        if link.is_dir() and not link.is_symlink():
            shutil.rmtree(link)
        else:
            link.unlink()
    link.symlink_to(source)


def triton_argv(install: TritonInstall, backend_dir: Path, model_repo: Path, *, http_port: int,
                grpc_port: int, metrics_port: int, extra: Iterable[str] = ()) -> list[str]:
    """The command line: loopback only, explicit model control, nothing loaded at start.

    The ports are keyword-only: three ints in a row are too easy to swap.
    """
    return [
        str(install.binary),
        f"--model-repository={model_repo}",
        # sitsmesh decides what is loaded and which versions serve.
        "--model-control-mode=explicit",
        "--http-address=127.0.0.1", f"--http-port={http_port}",
        "--grpc-address=127.0.0.1", f"--grpc-port={grpc_port}",
        "--metrics-address=127.0.0.1", f"--metrics-port={metrics_port}",
        "--allow-metrics=true",
        # No GPU here; GPU metrics only add NVML warnings.
        "--allow-gpu-metrics=false",
        f"--backend-directory={backend_dir}",
        # Tests and `make run` stop it often; the default 30 s would stall every teardown.
        "--exit-timeout-secs=5",
        "--log-verbose=0",
        *extra,
    ]


def triton_env(install: TritonInstall) -> dict[str, str]:
    """os.environ plus what tritonserver and the python backend stub need to find."""
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = _prepend(str(install.libs_dir), env.get("LD_LIBRARY_PATH"))
    # The stub runs model.py with the first `python` it finds: make it ours, with numpy.
    # Its interpreter is isolated, so PYTHON* variables set here never reach model code.
    env["PATH"] = _prepend(str(Path(sys.executable).parent), env.get("PATH"))
    return env


def _prepend(entry: str, current: str | None) -> str:
    return f"{entry}{os.pathsep}{current}" if current else entry


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
        self.install = find_tritonserver()
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
        with urllib.request.urlopen(self.metrics_url, timeout=5) as resp:  # noqa: S310
            body: bytes = resp.read()
        return body.decode()

    def start(self, timeout: float = 30) -> None:
        if self.running:
            raise RuntimeError(f"tritonserver already running on {self.grpc_url}")
        self.workdir.mkdir(parents=True, exist_ok=True)
        backends = prepare_backend_dir(self.install, self.workdir)
        argv = triton_argv(self.install, backends, self.model_repo,
                                    http_port=self.http_port, grpc_port=self.grpc_port,
                                    metrics_port=self.metrics_port, extra=self.extra)
        self._starts += 1
        proc = harness.spawn(argv, self.workdir / f"triton-{self._starts}.log",
                             env=triton_env(self.install))
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
