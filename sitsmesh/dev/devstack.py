"""`sitsmesh dev` (what `make run` starts): sitsmesh, a demo upstream and Envoy in front,
and a Triton server with the lazy demo model for hot swaps.

Everything binds to 127.0.0.1. Ctrl-C stops Envoy first, then sitsmesh drains,
then Triton stops.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from sitsmesh.dev import envoyconf
from sitsmesh.dev.tokenstage import TokenStage


@dataclass(frozen=True, slots=True)
class DevPorts:
    listen: int = 10000
    envoy_admin: int = 9901
    upstream: int = 18080
    data_addr: str = "127.0.0.1:50051"
    triton_http: int = 18000
    triton_grpc: int = 18001
    triton_metrics: int = 18002


DEMO_MODEL = "lazy"
TRITON_CLUSTER = "triton"
TOKENS_CLUSTER = "tokens"
# The demo model as a one-stage pipeline, so backpressure has something to watch.
DEMO_PIPELINE = f"""name: {DEMO_MODEL}
models: ["{DEMO_MODEL}"]
stages:
  - name: model
    match: {{upstream_cluster: {TRITON_CLUSTER}}}
    sla_p99_ms: 250
    triton_model: {DEMO_MODEL}
"""
DEMO_THRESHOLDS = """stages:
  model: {parallelism: 1, queue_capacity: 32}
"""
# The token stage as a pipeline, so `chain show chat` has its TTFT and time per token.
# Its stall threshold is learned (tokens/stalls.py); `stall_ms: 300` would set it.
CHAT_PIPELINE = f"""name: chat
stages:
  - name: llm
    match: {{upstream_cluster: {TOKENS_CLUSTER}}}
"""


def _start_triton(run_dir: Path, ports: DevPorts) -> subprocess.Popen[bytes] | None:
    """Triton (explicit model control) serving v1 of the demo model; None if not installed."""
    from sitsmesh.dev import demo_model, triton

    try:
        install = triton.find_tritonserver()
    except RuntimeError as exc:
        print(f"sitsmesh dev: no Triton ({exc}); model swaps are off", file=sys.stderr)
        return None
    repo = run_dir / "models"
    demo_model.write_lazy_model(repo, DEMO_MODEL, [1, 2, 3], context_ms=400, service_ms=2)
    backends = triton.prepare_backend_dir(install, run_dir / "triton")
    argv = triton.triton_argv(install, backends, repo, http_port=ports.triton_http,
                              grpc_port=ports.triton_grpc, metrics_port=ports.triton_metrics)
    log = (run_dir / "triton.log").open("wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                            env=triton.triton_env(install), start_new_session=True)
    log.close()
    import tritonclient.grpc as triton_grpc
    from tritonclient.utils import InferenceServerException

    try:
        _wait_ready(f"http://127.0.0.1:{ports.triton_http}/v2/health/live", proc,
                    "tritonserver")
        client = triton_grpc.InferenceServerClient(f"127.0.0.1:{ports.triton_grpc}")
        try:
            client.load_model(DEMO_MODEL)  # its config.pbtxt serves v1; swaps move it on
        finally:
            client.close()
    except (SystemExit, InferenceServerException) as exc:
        # The rest of the stack is still worth running; say why swaps are off.
        proc.kill()
        proc.wait(10)
        print(f"sitsmesh dev: Triton did not start ({exc}); see {run_dir}/triton.log. "
              "Model swaps are off", file=sys.stderr)
        return None
    return proc


class _DemoUpstream(BaseHTTPRequestHandler):
    """Answers every request with what it received, so headers Envoy adds are visible."""

    def _reply(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        if length:
            self.rfile.read(length)
        body = json.dumps({"upstream": "demo", "method": self.command, "path": self.path,
                           "headers": dict(self.headers.items())}, indent=2).encode() + b"\n"
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _reply

    def log_message(self, format: str, *args: Any) -> None:
        del format, args


def _wait_ready(url: str, proc: subprocess.Popen[bytes], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"sitsmesh dev: {what} exited with {proc.returncode}")
        try:
            # The URL is built here from loopback constants, never from input.
            with urllib.request.urlopen(url, timeout=1):  # noqa: S310
                return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"sitsmesh dev: {what} not ready after {timeout}s")


def _admin_flags(serve_args: list[str]) -> list[str]:
    admin = []
    for flag in ("--admin-addr", "--state-dir"):
        if flag in serve_args:
            value = serve_args[serve_args.index(flag) + 1]
            admin += ["--admin" if flag == "--admin-addr" else flag, value]
    return admin


def _demo_pipeline(bin_dir: Path, run_dir: Path, serve_args: list[str], *,
                   triton: bool) -> None:
    """The token stage's pipeline, and with Triton the demo model's pipeline and
    thresholds, through the admin API like any SRE."""
    cli, admin = str(bin_dir / "sitsmesh"), _admin_flags(serve_args)
    (run_dir / "chat.yaml").write_text(CHAT_PIPELINE)
    (run_dir / "pipeline.yaml").write_text(DEMO_PIPELINE)
    (run_dir / "thresholds.yaml").write_text(DEMO_THRESHOLDS)
    steps = [["pipelines", "apply", str(run_dir / "chat.yaml")]]
    if triton:
        steps += [["pipelines", "apply", str(run_dir / "pipeline.yaml")],
                  ["thresholds", "set", DEMO_MODEL, str(run_dir / "thresholds.yaml")]]
    for args in steps:
        done = subprocess.run([cli, *args, *admin], capture_output=True, text=True,
                              check=False)
        if done.returncode != 0:
            raise SystemExit(f"sitsmesh dev: {' '.join(args[:2])} failed: "
                             f"{done.stderr.strip()}")


def _demo_key(bin_dir: Path, serve_args: list[str]) -> str:
    """A 'demo' tenant allowed every model and priority, and a fresh key for it (state
    persists: the tenant exists on later runs)."""
    admin = _admin_flags(serve_args)
    cli = str(bin_dir / "sitsmesh")
    for _ in range(20):
        created = subprocess.run([cli, "tenants", "create", "demo", "--models", "*",
                                  "--max-priority", "9", *admin],
                                 capture_output=True, text=True, check=False)
        if created.returncode == 0 or "ALREADY_EXISTS" in created.stderr:
            break
        time.sleep(0.25)  # the admin API may still be settling: say why only if it stays
    else:
        raise SystemExit(f"sitsmesh dev: cannot create the demo tenant: "
                         f"{created.stderr.strip()}")
    made = subprocess.run([cli, "apikeys", "create", "--tenant", "demo", "--name", "make-run",
                           "--output", "json", *admin], capture_output=True, text=True,
                          check=False)
    if made.returncode != 0:
        raise SystemExit(f"sitsmesh dev: cannot create a demo key: {made.stderr.strip()}")
    key: str = json.loads(made.stdout)["key"]
    return key


def _bootstrap(filters_dir: Path, ports: DevPorts, admission: str, rlqs_addr: str,
               tokens_port: int) -> dict[str, Any]:
    values = envoyconf.local_values(sitsmesh_addr=ports.data_addr, upstream_port=ports.upstream,
                                    listen_port=ports.listen, envoy_admin_port=ports.envoy_admin)
    limits = "rate_limit_quota" if admission == "rlqs" else "ratelimit"
    bootstrap = envoyconf.render(filters_dir / "local" / "bootstrap.yaml", values,
                                 fragments=["ext_authz", limits, "token_timing",
                                            "access_log", "metrics_service"])
    if rlqs_addr:
        envoyconf.use_rlqs_addr(bootstrap, rlqs_addr)
    # No route timeout on a streaming route: it would bound the whole generation.
    envoyconf.add_route(bootstrap, name=TOKENS_CLUSTER, prefix="/v1/chat/",
                        host="127.0.0.1", port=tokens_port, timeout="0s")
    return bootstrap


def main(run_dir: Path, filters_dir: Path, ports: DevPorts, serve_args: list[str], *,
         admission: str = "calls", rlqs_addr: str = "") -> int:
    """`admission` rlqs: Envoy's rate_limit_quota filter in place of its ratelimit filter,
    and sitsmesh assigning the quotas (Check then only counts for the controller);
    `rlqs_addr`: from sitsmesh's RLQS process, there."""
    run_dir.mkdir(parents=True, exist_ok=True)
    bin_dir = Path(sys.executable).parent
    upstream = ThreadingHTTPServer(("127.0.0.1", ports.upstream), _DemoUpstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()

    serve_args = ["--admission", admission, *serve_args]
    if rlqs_addr:
        serve_args += ["--rlqs-addr", rlqs_addr]
    # A streaming LLM stage: its tokens timed in Envoy (token_timing), reported to
    # sitsmesh on the access log.
    tokens = TokenStage(ttft_s=0.3, itl_s=0.05, tokens=24).start()
    bootstrap = _bootstrap(filters_dir, ports, admission, rlqs_addr, tokens.port)
    triton = _start_triton(run_dir, ports)
    if triton is not None:
        # The demo model's requests go to Triton, through the same filters.
        envoyconf.add_route(bootstrap, name=TRITON_CLUSTER,
                            prefix=f"/v2/models/{DEMO_MODEL}/", host="127.0.0.1",
                            port=ports.triton_http)
    config = envoyconf.write(bootstrap, run_dir / "envoy.yaml")
    triton_args = ([] if triton is None else [
        "--triton-url", f"127.0.0.1:{ports.triton_grpc}",
        "--triton-metrics-url", f"http://127.0.0.1:{ports.triton_metrics}/metrics"])
    # Embedded defaults: SQLite state in the default state dir, memory stores.
    sitsmesh = subprocess.Popen([str(bin_dir / "sitsmesh"), "serve",
                                 "--data-addr", ports.data_addr, "--log-format", "console",
                                 "--drain-seconds", "1", "--ratelimit-config",
                                 str(filters_dir / "local" / "ratelimit"), *triton_args,
                                 *serve_args],
                                # Own session: Ctrl-C reaches only us, and we stop
                                # the children in order.
                                start_new_session=True)
    envoy_log = (run_dir / "envoy.log").open("wb")
    envoy = subprocess.Popen([str(bin_dir / "envoy"), "-c", str(config),
                              "--disable-hot-restart", "--log-level", "warn"],
                             stdout=envoy_log, stderr=subprocess.STDOUT, start_new_session=True)
    stopping = False

    def stop(signum: int, frame: Any) -> None:
        nonlocal stopping
        del signum, frame
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        _wait_ready(f"http://127.0.0.1:{ports.envoy_admin}/ready", envoy, "envoy")
        time.sleep(1.5)  # let sitsmesh print its start-up lines first
        key = _demo_key(bin_dir, serve_args)
        _demo_pipeline(bin_dir, run_dir, serve_args, triton=triton is not None)
        hints = [
            (f"curl -s -d '{{}}' -H 'x-api-key: {key}' "
             f"http://127.0.0.1:{ports.listen}/v2/models/demo/infer",
             "via Envoy to the demo upstream"),
            (f"curl -si -d '{{}}' http://127.0.0.1:{ports.listen}/v2/models/demo/infer | head -1",
             "no key: 401"),
            (".venv/bin/sitsmesh status", "admin API, token from the state dir"),
            (f"curl -si -d '{{}}' -H 'x-api-key: {key}' -H 'x-user: alice' "
             f"http://127.0.0.1:{ports.listen}/v2/models/demo/infer | head -5",
             "6th in a minute gets 429")
            if admission != "rlqs" else
            (f"for i in 1 2 3 4; do curl -s -o /dev/null -w '%{{http_code}} ' -d '{{}}' "
             f"-H 'x-api-key: {key}' http://127.0.0.1:{ports.listen}/v2/models/demo/infer; done",
             "RLQS: tenant demo's 30 a minute, enforced in Envoy: 429s"),
            (f".venv/bin/sitsmesh health --addr {ports.data_addr}",
             "gRPC health of the data plane"),
            (f"curl -N -H 'x-api-key: {key}' -d '{{\"model\":\"tiny\",\"stream\":true,"
             f"\"messages\":[{{\"role\":\"user\",\"content\":\"hi\"}}]}}' "
             f"http://127.0.0.1:{ports.listen}/v1/chat/completions",
             "a token stream through Envoy, timed in Envoy, reported to sitsmesh"),
            (".venv/bin/sitsmesh chain show chat",
             "TTFT and time per token of the chat pipeline's llm stage"),
            ("curl -s http://127.0.0.1:9464/metrics | grep -E 'gen_ai_server|token'",
             "time to first token, time per token, tokens"),
            ("curl -s http://127.0.0.1:9464/metrics | grep sitsmesh_", "Prometheus metrics"),
            (f"curl -s http://127.0.0.1:{ports.envoy_admin}/clusters | grep sitsmesh_data",
             "Envoy's view of sitsmesh"),
        ]
        if triton is not None:
            hints += [
                (".venv/bin/sitsmesh models list", "Triton's models and versions"),
                (f".venv/bin/sitsmesh models swap {DEMO_MODEL} --to 2",
                 "hot swap: load, warm, verify, promote, drain, retire"),
                (f"curl -s -H 'x-api-key: {key}' -H 'x-priority: 9' -X POST "
                 f"http://127.0.0.1:{ports.listen}/v2/models/{DEMO_MODEL}/infer -d "
                 f"'{{\"inputs\":[{{\"name\":\"INPUT0\",\"shape\":[4],"
                 f"\"datatype\":\"FP32\",\"data\":[1,2,3,4]}}]}}'",
                 "via Envoy to Triton (pipeline 'lazy')"),
                (f".venv/bin/sitsmesh pressure watch {DEMO_MODEL}",
                 "backpressure, live"),
            ]
        width = max(len(cmd) for cmd, _ in hints)
        print(f"\nsitsmesh is running with Envoy in front (Envoy log: {run_dir}/envoy.log). Try:")
        for cmd, what in hints:
            print(f"  {cmd:<{width}}  # {what}")
        print("Ctrl-C stops everything.\n", flush=True)
        while not stopping and sitsmesh.poll() is None and envoy.poll() is None:
            time.sleep(0.2)
    finally:
        # Envoy first: no new traffic while sitsmesh drains; Triton last: swaps end first.
        for proc in (envoy, sitsmesh, *([triton] if triton is not None else [])):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        envoy_log.close()
        upstream.shutdown()
    return 0 if sitsmesh.returncode in (0, None) else 1
