"""Hot swap on a real Triton under constant load: a naive load vs `sitsmesh models swap`.

Everything is started (and stopped) by this script on free 127.0.0.1 ports,
in a temporary directory:

- one `tritonserver` from the nvidia-pytriton wheel (sitsmesh/dev/triton.py),
  explicit model control, over a model repository of the lazy python-backend
  demo model (sitsmesh.dev.demo_model): the first request an instance
  executes after its load sleeps `--context-ms` (standing in for a CUDA
  context and kernel build), every later one `--service-ms`. One instance per
  version, CPU;
- one `sitsmesh serve --triton-url ... --triton-metrics-url ...` (state dir in
  the temporary directory).

Every swap gets a model of its own, `lazy_<method>_<round>` with versions 1
and 2, so every swap starts from the same state: v1 loaded from the
repository's config.pbtxt (no `model_warmup`) and serving alone. (On one
shared model, a naive load after a sitsmesh swap would drop the warmup
sitsmesh added to the config, and Triton would reload the old version, cold,
under traffic.) For each swap:

1. load the model (v1), start the load: `--callers` threads, each a
   tests/tritonload.py BackgroundLoad sending unversioned requests one at a
   time with `--interval-ms` between them, each its own gRPC connection.
   The default, 4 callers with 40 ms pauses (about 70 requests/s), keeps the
   single instance about half busy, so the steady p50 is close to the
   service time. With 5 ms pauses one instance is saturated and the steady
   p50 is mostly queueing, which makes a fresh instance look fast;
2. once every caller got an answer, wait `--settle-s` (past v1's own cold
   first request) and then `--steady-s`: the steady window;
3. swap v1 -> v2, timed on the wall clock from this script:
   - **naive**: what an operator does by hand with tritonclient:
     `load_model(name, config=<v1 and v2, no model_warmup>)` then
     `load_model(name, config=<v2 only>)` to retire v1
     (demo_model.config_json builds both configs);
   - **sitsmesh**: `sitsmesh models swap <name> --to 2 --output json` through
     the CLI (precheck, preflight (none configured), load with warmup,
     verify, promote, drain, retire); the JSON record must say `succeeded`;
4. keep the load for `--tail-s` after the swap ended, stop it, check that v2
   alone is READY, unload the model.

Per swap, over the background requests (a request belongs to the window it
started in):

- steady p50: p50 of the v1 answers in the `--steady-s` before the swap;
- first request: latency of the first request (by start time) that v2
  answered, and its ratio to the steady p50;
- p99 and max over the swap window: from the swap's start to `--tail-s`
  after its end, every request;
- requests in that window slower than 2x the steady p50 (how many paid
  for a cold start: with several callers, the requests queued behind the
  first one on a cold instance wait as long);
- failed requests in that window (any error, e.g. a model not ready);
- swap duration: wall time of the two loads (naive) or of the CLI call
  (sitsmesh; the record's own started_at..ended_at is shown beside it);
- traffic moved: from the swap's start to the first request v2 answered.

Rounds interleave the methods (order rotated each round). The summary gives
medians per method and whether sitsmesh meets the targets in every swap:
first request <= 1.5x the steady p50, and zero failed requests. The targets
are reported, not enforced. The exit status is 1 if Triton or sitsmesh fails
to start, a swap does not end with v2 alone READY (a sitsmesh swap must also
report `succeeded`), or a caller stops before the window ends.

    .venv/bin/python bench/swap_triton.py [--rounds 3] [--context-ms 400] [--service-ms 5]
        [--callers 4] [--interval-ms 40]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tritonclient.grpc as triton_grpc
from google.protobuf.timestamp_pb2 import Timestamp
from tritonclient.utils import InferenceServerException

from sitsmesh.dev import demo_model, harness
from sitsmesh.dev.triton import TritonServer
from sitsmesh.dev.tritonload import BackgroundLoad, Outcome

NAIVE = "naive"
SITSMESH = "sitsmesh"
METHODS = (NAIVE, SITSMESH)
OLD, NEW = 1, 2
FIRST_RATIO_TARGET = 1.5
SLOW_RATIO = 2.0


class BenchError(Exception):
    """Triton or sitsmesh could not be started, or a swap did not end as it must."""


@dataclass
class SwapResult:
    method: str
    round: int
    model: str
    steady_p50_ms: float
    first_ms: float
    p99_ms: float
    max_ms: float
    window_requests: int
    failures: int
    slow: int  # requests in the window over SLOW_RATIO x the steady p50
    duration_s: float
    moved_s: float  # from the swap's start to the first request v2 answered
    detail: str = ""  # sitsmesh: the record's duration and phase times
    errors: list[str] = field(default_factory=list)  # failed requests' error texts

    @property
    def ratio(self) -> float:
        return self.first_ms / self.steady_p50_ms


def nearest_rank(values: Sequence[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(pct / 100 * len(ordered)) - 1)]


def started(o: Outcome) -> float:
    return o.at - o.seconds


# --------------------------------------------------------------------------- the swaps

def ready_versions(client: Any, model: str) -> list[int]:
    index = client.get_model_repository_index()
    return sorted(int(m.version) for m in index.models
                  if m.name == model and m.state == "READY" and m.version)


def naive_swap(client: Any, model: str) -> str:
    t0 = time.monotonic()
    client.load_model(model, config=demo_model.config_json(model, [OLD, NEW]))
    t1 = time.monotonic()
    client.load_model(model, config=demo_model.config_json(model, [NEW]))
    return (f"load [1, 2] {t1 - t0:.2f} s, load [2] {time.monotonic() - t1:.2f} s "
            "(no model_warmup)")


def _seconds(stamp: str) -> float:
    ts = Timestamp()
    ts.FromJsonString(stamp)
    return float(ts.ToNanoseconds()) / 1e9


def sitsmesh_swap(node: harness.Sitsmesh, model: str, timeout: float) -> str:
    result = node.cli("models", "swap", model, "--to", str(NEW), "--output", "json",
                      timeout=timeout)
    try:
        doc = json.loads(result.stdout) if result.stdout.strip() else {}
    except json.JSONDecodeError:
        doc = {}
    if result.returncode != 0 or doc.get("state") != "succeeded":
        raise BenchError(f"sitsmesh swap of {model} exited {result.returncode}, state "
                         f"{doc.get('state')!r}, error {doc.get('error')!r}\n"
                         f"stderr: {result.stderr.strip()[-2000:]}")
    total = _seconds(doc["ended_at"]) - _seconds(doc["started_at"])
    phases = ", ".join(
        f"{s['phase']} {_seconds(s['ended_at']) - _seconds(s['started_at']):.2f}"
        for s in doc.get("steps", []) if "ended_at" in s and s.get("state") != "skipped")
    return f"record {total:.2f} s ({phases})"


def run_swap(method: str, rnd: int, client: Any, triton: TritonServer,
             node: harness.Sitsmesh, args: argparse.Namespace) -> SwapResult:
    model = f"lazy_{method}_{rnd}"
    client.load_model(model)  # config.pbtxt: v1 only, no warmup
    if ready_versions(client, model) != [OLD]:
        raise BenchError(f"{model}: v1 did not become READY alone")
    loads = [BackgroundLoad(triton.grpc_url, model, interval_s=args.interval_ms / 1000,
                            max_seconds=args.swap_timeout + 60)
             for _ in range(args.callers)]
    try:
        for load in loads:
            load.__enter__()
        for load in loads:
            load.wait_for(1, timeout=30)
        time.sleep(args.settle_s + args.steady_s)
        swap_start = time.time()
        if method == NAIVE:
            detail = naive_swap(client, model)
        else:
            detail = sitsmesh_swap(node, model, args.swap_timeout)
        swap_end = time.time()
        time.sleep(args.tail_s + 0.2)
    finally:
        for load in loads:
            load.stop()
        if sys.exc_info()[0] is not None:
            with contextlib.suppress(InferenceServerException):
                client.unload_model(model)
    window_end = swap_end + args.tail_s
    for i, load in enumerate(loads):
        if not load.outcomes or load.outcomes[-1].at < window_end:
            raise BenchError(f"{model}: caller {i} stopped before the window ended")
    outcomes = sorted((o for load in loads for o in load.outcomes), key=started)
    ready = ready_versions(client, model)
    if ready != [NEW]:
        raise BenchError(f"{model}: after the {method} swap READY versions are {ready}, not [2]")
    client.unload_model(model)

    steady = [o.seconds * 1000 for o in outcomes if o.version == OLD
              and swap_start - args.steady_s <= started(o) < swap_start]
    window = [o for o in outcomes if swap_start <= started(o) <= window_end]
    on_new = [o for o in outcomes if o.version == NEW]
    if not steady or not window or not on_new:
        raise BenchError(f"{model}: no requests in the steady window, the swap window or on v2")
    failed = [o for o in window if o.error]
    late = [o for o in outcomes if o.error and o not in failed]
    return SwapResult(
        method=method, round=rnd, model=model,
        steady_p50_ms=statistics.median(steady),
        first_ms=on_new[0].seconds * 1000,
        p99_ms=nearest_rank([o.seconds * 1000 for o in window], 99),
        max_ms=max(o.seconds * 1000 for o in window),
        window_requests=len(window), failures=len(failed),
        duration_s=swap_end - swap_start, moved_s=started(on_new[0]) - swap_start,
        slow=sum(o.seconds * 1000 > SLOW_RATIO * statistics.median(steady) for o in window),
        detail=detail,
        errors=[o.error for o in failed] + [f"(outside the window) {o.error}" for o in late])


# --------------------------------------------------------------------------- tables

def per_swap_table(results: Sequence[SwapResult]) -> str:
    lines = ["| round | method | steady p50 (ms) | first request (ms) | first / steady p50 "
             "| p99 window (ms) | max window (ms) | requests in window "
             f"| over {SLOW_RATIO:g}x steady p50 | failed "
             "| swap duration (s) | traffic moved after (s) |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r.round} | {r.method} | {r.steady_p50_ms:.1f} | {r.first_ms:.1f} "
                     f"| {r.ratio:.2f} | {r.p99_ms:.1f} | {r.max_ms:.1f} "
                     f"| {r.window_requests} | {r.slow} | {r.failures} | {r.duration_s:.2f} "
                     f"| {r.moved_s:.2f} |")
    return "\n".join(lines)


def summary_table(results: Sequence[SwapResult]) -> str:
    lines = ["| method | swaps | median steady p50 (ms) | median first request (ms) "
             "| median first / steady p50 | median p99 window (ms) | failed (all swaps) "
             "| median swap duration (s) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for method in METHODS:
        rs = [r for r in results if r.method == method]
        if not rs:
            lines.append(f"| {method} | 0 | n/a | n/a | n/a | n/a | n/a | n/a |")
            continue

        def med(get: Callable[[SwapResult], float], rs: list[SwapResult] = rs) -> float:
            return statistics.median(get(r) for r in rs)

        lines.append(f"| {method} | {len(rs)} | {med(lambda r: r.steady_p50_ms):.1f} "
                     f"| {med(lambda r: r.first_ms):.1f} | {med(lambda r: r.ratio):.2f} "
                     f"| {med(lambda r: r.p99_ms):.1f} | {sum(r.failures for r in rs)} "
                     f"| {med(lambda r: r.duration_s):.2f} |")
    return "\n".join(lines)


def targets(results: Sequence[SwapResult], rounds: int) -> list[str]:
    rs = [r for r in results if r.method == SITSMESH]
    first_ok = sum(r.ratio <= FIRST_RATIO_TARGET for r in rs)
    fail_ok = sum(r.failures == 0 for r in rs)

    def verdict(ok: int) -> str:
        return "met" if rs and ok == rounds else "**not met**"

    return [f"- sitsmesh first request <= {FIRST_RATIO_TARGET}x steady p50: "
            f"{verdict(first_ok)} ({first_ok}/{rounds} swaps; ratios "
            f"{', '.join(f'{r.ratio:.2f}' for r in rs) or '-'})",
            f"- sitsmesh zero failed requests: {verdict(fail_ok)} ({fail_ok}/{rounds} swaps; "
            f"failures {', '.join(str(r.failures) for r in rs) or '-'})"]


# --------------------------------------------------------------------------- main

def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds; each does one naive and one sitsmesh swap (default 3)")
    p.add_argument("--context-ms", type=float, default=400.0,
                   help="the lazy model's first request after a load (default 400)")
    p.add_argument("--service-ms", type=float, default=5.0,
                   help="the lazy model's later requests (default 5)")
    p.add_argument("--callers", type=int, default=4,
                   help="concurrent callers of the background load (default 4)")
    p.add_argument("--interval-ms", type=float, default=40.0,
                   help="each caller's pause between requests (default 40)")
    p.add_argument("--settle-s", type=float, default=1.0,
                   help="load before the steady window, past v1's cold start (default 1)")
    p.add_argument("--steady-s", type=float, default=2.0,
                   help="steady window before each swap (default 2)")
    p.add_argument("--tail-s", type=float, default=1.0,
                   help="the swap window runs this long past the swap's end (default 1)")
    p.add_argument("--swap-timeout", type=float, default=120.0,
                   help="seconds allowed per swap (default 120)")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.callers < 1:
        p.error("--rounds and --callers must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    results: list[SwapResult] = []
    errors: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-swap-") as tmp_name:
        tmp = Path(tmp_name)
        repo = tmp / "models"
        for rnd in range(1, args.rounds + 1):
            for method in METHODS:
                demo_model.write_lazy_model(repo, f"lazy_{method}_{rnd}", [OLD, NEW],
                                            context_ms=args.context_ms,
                                            service_ms=args.service_ms)
        triton: TritonServer | None = None
        node: harness.Sitsmesh | None = None
        client: Any = None
        version = "?"
        try:
            try:
                triton = TritonServer(tmp / "triton", repo)
                triton.start(timeout=60)
                node = harness.start_sitsmesh(tmp, "--triton-url", triton.grpc_url,
                                              "--triton-metrics-url", triton.metrics_url)
            except (RuntimeError, TimeoutError) as exc:
                raise BenchError(f"setup: {exc}") from exc
            client = triton_grpc.InferenceServerClient(triton.grpc_url)
            version = str(client.get_server_metadata().version)
            for rnd in range(1, args.rounds + 1):
                shift = (rnd - 1) % len(METHODS)
                for method in METHODS[shift:] + METHODS[:shift]:
                    try:
                        res = run_swap(method, rnd, client, triton, node, args)
                    except (BenchError, TimeoutError, InferenceServerException) as exc:
                        errors.append(f"round {rnd} {method}: {exc}")
                        print(f"round {rnd}/{args.rounds}  {method:<8} FAILED: {exc}",
                              file=sys.stderr, flush=True)
                        if not (triton.running and node.proc.poll() is None):
                            raise BenchError("Triton or sitsmesh is gone") from exc
                        continue
                    results.append(res)
                    print(f"round {rnd}/{args.rounds}  {method:<8} steady p50 "
                          f"{res.steady_p50_ms:6.1f} ms  first {res.first_ms:6.1f} ms  "
                          f"p99 {res.p99_ms:6.1f} ms  failed {res.failures}  "
                          f"swap {res.duration_s:5.2f} s  {res.detail}",
                          file=sys.stderr, flush=True)
        except BenchError as exc:
            errors.append(str(exc))
        finally:
            if client is not None:
                client.close()
            if node is not None:
                node.stop(timeout=20)
            if triton is not None:
                triton.kill()
        if errors:
            for what, proc in (("sitsmesh", node), ("tritonserver", triton)):
                tail = "\n".join(proc.output().splitlines()[-15:]) if proc else ""
                if tail:
                    errors.append(f"--- last output of {what} ---\n{tail}")

    print(f"\nTriton hot swap, naive vs sitsmesh: tritonserver {version} (nvidia-pytriton), "
          f"lazy python-backend model (context {args.context_ms:g} ms, service "
          f"{args.service_ms:g} ms, 1 CPU instance), {args.callers} callers x "
          f"{args.interval_ms:g} ms pause, {args.rounds} rounds, {os.cpu_count()} CPUs, "
          f"{time.monotonic() - t0:.0f} s\n")
    print(per_swap_table(results))
    print()
    print(summary_table(results))
    print()
    print("\n".join(targets(results, args.rounds)))
    notes = [f"- round {r.round} {r.method}: {r.detail}" for r in results if r.detail]
    notes += [f"- round {r.round} {r.method} failed request: {e}"
              for r in results for e in r.errors[:5]]
    if notes:
        print("\nNotes:\n")
        print("\n".join(notes))
    if errors:
        print("\nFAILED:", file=sys.stderr)
        for err in errors:
            print(f"  {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
