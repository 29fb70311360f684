"""`sitsmesh dev` (what `make run` starts) serves, and `sitsmesh status` says SERVING."""

from __future__ import annotations

import json
import signal
import urllib.request
from pathlib import Path

from sitsmesh.dev import harness


def test_dev_stack_serves_through_envoy_and_status_is_serving_and_swaps(
        tmp_path: Path) -> None:
    listen, envoy_admin, upstream = harness.free_port(), harness.free_port(), harness.free_port()
    data, admin, metrics = (f"127.0.0.1:{harness.free_port()}" for _ in range(3))
    state = tmp_path / "state"
    triton_ports = [harness.free_port() for _ in range(3)]
    node = harness.spawn(
        [harness.SITSMESH, "dev", "--run-dir", str(tmp_path / "run"),
         "--listen-port", str(listen), "--envoy-admin-port", str(envoy_admin),
         "--upstream-port", str(upstream), "--data-addr", data,
         "--triton-ports", ",".join(map(str, triton_ports)),
         "--", "--admin-addr", admin, "--metrics-addr", metrics, "--state-dir", str(state)],
        tmp_path / "dev.log")
    try:
        harness.wait_until(lambda: "Ctrl-C stops everything" in node.output(), 40,
                           "sitsmesh dev to print its hints")
        key = next(line.split("x-api-key: ")[1].split("'")[0]
                   for line in node.output().splitlines() if "x-api-key: smk_" in line)
        # Inference routes take POST only (README, Request-path policy).
        req = urllib.request.Request(f"http://127.0.0.1:{listen}/v2/models/demo/infer",
                                     headers={"x-api-key": key}, data=b"{}", method="POST")
        with urllib.request.urlopen(req, timeout=5) as resp:
            assert json.loads(resp.read())["upstream"] == "demo"
        # README "Token streams": the `curl -N` stream through Envoy, then its TTFT and
        # time per token on the chat pipeline's llm stage in `chain show chat`.
        chat = urllib.request.Request(
            f"http://127.0.0.1:{listen}/v1/chat/completions", method="POST",
            headers={"x-api-key": key}, data=json.dumps({
                "model": "tiny", "stream": True,
                "messages": [{"role": "user", "content": "hi"}]}).encode())
        with urllib.request.urlopen(chat, timeout=10) as resp:
            events = [line for line in resp if line.startswith(b"data: ")]
        assert events[-1] == b"data: [DONE]\n" and len(events) == 24 + 3

        def streamed() -> dict[str, float]:
            shown = harness.run_cli("chain", "show", "chat", "-o", "json", "--admin", admin,
                                    "--state-dir", str(state))
            assert shown.returncode == 0, shown.stderr
            [llm] = json.loads(shown.stdout)["stages"]
            tokens: dict[str, float] = llm.get("tokens", {})
            return tokens

        harness.wait_until(lambda: streamed().get("streams") == 1, 10, "the stream timed")
        timed = streamed()
        assert timed["output_tokens"] == 24
        assert timed["ttft_p50_ms"] > 0 and timed["tpot_p50_ms"] > 0
        status = harness.run_cli("status", "--admin", admin, "--state-dir", str(state))
        assert status.returncode == 0, status.stderr
        assert "SERVING" in status.stdout
        # The demo Triton is wired in: its model is listed and swaps to v2 with warmup.
        models = harness.run_cli("models", "list", "--admin", admin, "--state-dir", str(state))
        assert models.returncode == 0, models.stderr
        assert models.stdout.split("\n")[1].split() == ["default", "lazy", "1", "READY"]
        # Envoy routes the demo model to Triton through ext_authz, and its pipeline is
        # under the backpressure controller.
        infer = urllib.request.Request(
            f"http://127.0.0.1:{listen}/v2/models/lazy/infer", method="POST",
            headers={"x-api-key": key, "x-priority": "9"},
            data=json.dumps({"inputs": [{"name": "INPUT0", "shape": [4], "datatype": "FP32",
                                         "data": [1, 2, 3, 4]}]}).encode())
        with urllib.request.urlopen(infer, timeout=10) as resp:
            assert json.loads(resp.read())["outputs"][0]["data"] == [1, 2, 3, 4]
        watched = harness.run_cli("pressure", "watch", "lazy", "--count", "1", "--output",
                                  "json", "--admin", admin, "--state-dir", str(state))
        assert watched.returncode == 0, watched.stderr
        assert json.loads(watched.stdout)["pipelines"][0]["pipeline"] == "lazy"
        swap = harness.run_cli("models", "swap", "lazy", "--to", "2", "--admin", admin,
                               "--state-dir", str(state), timeout=120)
        assert swap.returncode == 0, swap.stdout + swap.stderr
        assert "lazy v1 -> v2 on default: SUCCEEDED" in swap.stdout
        assert node.stop(signal.SIGINT) == 0
        assert "stopped" in node.output()
    finally:
        # SIGINT, not SIGKILL: `sitsmesh dev` runs Envoy, sitsmesh and Triton in sessions
        # of their own and stops them itself; killed, it would leave them running.
        node.stop(signal.SIGINT, 60)
