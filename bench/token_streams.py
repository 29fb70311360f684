"""Token streams through Envoy with and without sitsmesh's token timing (issue 27).

What it measures: what each way of timing tokens costs the client of a streaming LLM,
and what it costs in CPU: Envoy's ext_proc filter in observability mode, response
bodies STREAMED to sitsmesh's data port (`filters/fragments/ext_proc.yaml`), and
Envoy's own timing filter, whose summary reaches sitsmesh on the access log
(`filters/fragments/token_timing.yaml` with `access_log.yaml`).

Setup, all on 127.0.0.1 free ports, started and stopped by this script, alive for the
whole run:
- a **TokenStage** (`sitsmesh.dev.tokenstage`, OpenAI-compatible SSE chat completions;
  a ThreadingHTTPServer, one thread per stream) in a process of its own, so its threads
  do not share this script's interpreter lock with the client;
- `sitsmesh serve` (harness defaults);
- **plain**: Envoy with no fragment, in front of the stage;
- **ext_proc**: Envoy with the ext_proc fragment, in front of the same stage, copying
  each response chunk to sitsmesh;
- **timing**: Envoy with the token_timing and access_log fragments, in front of the same
  stage: each chunk timed inside Envoy, one access-log entry per stream to sitsmesh
  (plain has no access log, so what timing adds includes the access log's own cost);
- with `--direct` also a **direct** configuration: the client straight to the stage (no
  Envoy), to see what the stage and the client sustain on their own;
- with `--twin` also a **twin**: a second Envoy with no fragment, measured like the
  others; what it "adds" over plain (an A/A comparison) is the resolution of the added
  TTFT on this machine;
- with `--streamed` also a **streamed** configuration: Envoy with the same fragment but
  `observability_mode: false` and response bodies STREAMED, so Envoy waits for
  sitsmesh's answer (an immediate CONTINUE) to the request headers, the response
  headers and every chunk: the mode the fragment does not use, measured beside it.

`--nice N` renices every sitsmesh thread; `--isolate` pins sitsmesh to CPU 1 and the
Envoys, the stage and this client to CPU 0, to see what is left of the added TTFT when
sitsmesh's CPU does not compete with the path a token takes.

Load: one round is `--streams` concurrent streams, each a POST /v1/chat/completions
with `stream: true` asking (per-request stage headers) for `--tokens` tokens, the first
after `--ttft-ms`, then one every `--itl-ms`. Stream i starts at a random offset in
[0, `--ramp-ms`) (seeded) so that the streams' token ticks are not all in phase. The
client is raw asyncio in this process: one HTTP/1.1 connection per stream, opened
before the clock starts; it de-chunks the body, splits SSE events, and stamps each
content token (` t<i>`) as it is read. TTFT = first content token - request written;
ITL = gaps between a stream's content tokens. Every stream must get tokens 0..N-1 in
order, then `[DONE]` and the final chunk, within a bound (TTFT + 4x the nominal stream
time + 10 s); otherwise the run fails (exit 1).

Rounds: after a small warm-up round per configuration (not reported), `--rounds`
rounds; each runs every configuration once, one after the other, in alternating order
(plain, ext_proc, timing in even rounds, the reverse in odd ones; direct first/last), so
slow drift of this noisy 2-core VM hits both alike. Per configuration the tables give
the median over rounds and the range of: client TTFT p50/p99, ITL p50/p99, tokens/s
(all tokens of the round / round wall time, from the first request to the last stream's
end; the nominal figure is in the header), and CPU per 1 000 tokens from
/proc/<pid>/stat utime+stime of every process in each server's process group:
the configuration's Envoy (each Envoy only over its own rounds), sitsmesh (over the
ext_proc and timing rounds, until it has reported every stream; its idle CPU over the plain rounds
is shown for comparison), the stage and this client.

Added TTFT = ext_proc - plain (and timing - plain), per round (same round, adjacent in
time), at p50 and p99: the median and range over rounds, and over all rounds pooled.
The issue's target is <= 1 ms at p99. With 100 streams a round's TTFT p99 (nearest rank) is its
second-largest TTFT, so one round's p99 is the luck of two streams; hence the median
over rounds, and the pooled row (all rounds' streams together).

sitsmesh's own numbers are checked after each ext_proc round: its
`sitsmesh_token_streams_total` must grow by the round's streams (waited for up to 15 s)
and `sitsmesh_output_tokens_total` by exactly the tokens the client got; its mean TTFT
and time per output token (histogram sum/count) are shown beside the client's. After
the run, Envoy's ext_proc stats and any warning or error lines of sitsmesh's and the
Envoys' logs are printed as notes.

No pinning unless `--isolate`: every process may run on either core; the machine's
1-minute load is printed at the start and the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sitsmesh.dev import harness

STAGE_CODE = """
import sys, threading
from sitsmesh.dev.tokenstage import TokenStage
stage = TokenStage(ttft_s=float(sys.argv[1]), itl_s=float(sys.argv[2]),
                   tokens=int(sys.argv[3])).start()
print("PORT", stage.port, flush=True)
threading.Event().wait()
"""
_CLK_TCK = os.sysconf("SC_CLK_TCK")
BODY = (b'{"model": "stage", "messages": [{"role": "user", "content": "hi"}], '
        b'"stream": true}')
TOKEN_MARK = b'"content": " t'


# The configurations whose Envoy copies each chunk to sitsmesh.
OBSERVED = ("ext_proc", "streamed", "timing")  # sitsmesh reports these rounds' streams


class BenchError(Exception):
    pass


def group_cpu(pgid: int) -> float:
    """CPU seconds (user+system) of every live process in a process group."""
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:
                total += (int(fields[11]) + int(fields[12])) / _CLK_TCK
    return total


def group_tasks(pgid: int) -> list[int]:
    """Every thread of every live process in a process group."""
    tids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                tids += [int(t.name) for t in (stat.parent / "task").iterdir()]
    return tids


def place(pgid: int, cpus: set[int] | None, nice: int | None) -> None:
    """Pin (and renice) every thread of a process group: both are per thread on Linux,
    and threads started later inherit them from the thread that starts them."""
    for tid in group_tasks(pgid):
        with contextlib.suppress(OSError):
            if cpus is not None:
                os.sched_setaffinity(tid, cpus)
            if nice is not None:
                os.setpriority(os.PRIO_PROCESS, tid, nice)


def streamed_envoy(work: Path, data_addr: str, upstream_port: int) -> harness.Envoy:
    """Envoy with the ext_proc fragment switched from observability mode to STREAMED
    response bodies that wait for sitsmesh's answer (CONTINUE, at once) to each chunk,
    and to the request headers."""
    from sitsmesh.dev import envoyconf

    listen, admin = harness.free_port(), harness.free_port()
    bootstrap = harness.REPO / "filters" / "local" / "bootstrap.yaml"
    rendered = envoyconf.render(bootstrap, harness.envoy_values(data_addr, upstream_port,
                                                                listen, admin),
                                ["ext_proc"])
    hcm = envoyconf.http_connection_manager(rendered, bootstrap)
    [ext_proc] = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
    ext_proc["typed_config"]["observability_mode"] = False
    ext_proc["typed_config"]["processing_mode"]["response_body_mode"] = "STREAMED"
    config = envoyconf.write(rendered, work / "envoy.yaml")
    return harness.launch_envoy(config, listen, admin, work / "envoy.log")


def pct(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def load1() -> float:
    return os.getloadavg()[0]


# --------------------------------------------------------------------------- client

@dataclass
class Stream:
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    end: float = 0.0
    error: str = ""


async def one_stream(port: int, args: argparse.Namespace, tokens: int, delay: float,
                     bound: float) -> Stream:
    result = Stream()
    await asyncio.sleep(delay)
    try:
        await asyncio.wait_for(_read_stream(port, args, tokens, result), bound)
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError,
            BenchError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    except TimeoutError:
        result.error = f"not done within {bound:.1f} s ({result.tokens} tokens)"
    return result


async def _read_stream(port: int, args: argparse.Namespace, tokens: int,
                       result: Stream) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        request = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
                   f"content-type: application/json\r\ncontent-length: {len(BODY)}\r\n"
                   f"x-stage-tokens: {tokens}\r\nx-stage-ttft-ms: {args.ttft_ms}\r\n"
                   f"x-stage-itl-ms: {args.itl_ms}\r\nconnection: close\r\n\r\n"
                   ).encode() + BODY
        sent = time.monotonic()
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        status = head.split(b"\r\n", 1)[0]
        if b" 200 " not in status + b" ":
            raise BenchError(f"status {status.decode(errors='replace')}")
        if b"transfer-encoding: chunked" not in head.lower():
            raise BenchError("response not chunked")
        pending = b""
        last = 0.0
        done = False
        while True:
            size_line = await reader.readline()
            size = int(size_line.split(b";")[0].strip() or b"x", 16)
            if size == 0:
                await reader.readuntil(b"\r\n")  # no trailers
                break
            data = (await reader.readexactly(size + 2))[:-2]
            now = time.monotonic()
            pending += data
            *events, pending = pending.split(b"\n\n")
            for event in events:
                at = event.find(TOKEN_MARK)
                if at >= 0:
                    start = at + len(TOKEN_MARK)
                    index = int(event[start:event.index(b'"', start)])
                    if index != result.tokens:
                        raise BenchError(f"token {index} where {result.tokens} was due")
                    if index == 0:
                        result.ttft = now - sent
                    else:
                        result.gaps.append(now - last)
                    last = now
                    result.tokens += 1
                elif event == b"data: [DONE]":
                    done = True
        result.end = time.monotonic()
        if not done or result.tokens != tokens:
            raise BenchError(f"{result.tokens} of {tokens} tokens, [DONE] {done}")
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


# --------------------------------------------------------------------------- rounds

@dataclass
class Config:
    name: str
    port: int
    pgid: int | None  # its Envoy's process group, None for direct


@dataclass
class Round:
    config: str
    index: int
    streams: list[Stream]
    wall_s: float
    cpu: dict[str, float]  # role -> CPU seconds over the round
    sitsmesh: dict[str, float] = field(default_factory=dict)  # metric deltas
    settle_s: float = 0.0  # after the last stream's end until sitsmesh reported all

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.streams)

    def ttfts(self) -> list[float]:
        return [s.ttft for s in self.streams]

    def gaps(self) -> list[float]:
        return [g for s in self.streams for g in s.gaps]

    def per_1k(self, role: str) -> float:
        return self.cpu.get(role, 0.0) / self.tokens * 1000


SITSMESH_METRICS = {
    "tokens": "sitsmesh_output_tokens_total",
    "streams": "sitsmesh_token_streams_total",
    "stalls": "sitsmesh_token_stalls_total",
    "ttft_sum": "gen_ai_server_time_to_first_token_seconds_sum",
    "ttft_count": "gen_ai_server_time_to_first_token_seconds_count",
    "tpot_sum": "gen_ai_server_time_per_output_token_seconds_sum",
    "tpot_count": "gen_ai_server_time_per_output_token_seconds_count",
}


def sitsmesh_counters(node: harness.Sitsmesh) -> dict[str, float]:
    """Each metric summed over its label sets."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {name: key for key, name in SITSMESH_METRICS.items()}
    out = dict.fromkeys(SITSMESH_METRICS, 0.0)
    for family in text_string_to_metric_families(node.metrics()):
        for sample in family.samples:
            if sample.name in wanted:
                out[wanted[sample.name]] += float(sample.value)
    return out


def run_round(config: Config, index: int, args: argparse.Namespace, streams: int,
              tokens: int, pgids: dict[str, int], node: harness.Sitsmesh) -> Round:
    rng = random.Random(args.seed + index)
    nominal = args.ttft_ms / 1000 + tokens * args.itl_ms / 1000
    bound = 4 * nominal + 10
    observed = config.name in OBSERVED
    before = sitsmesh_counters(node) if observed else {}
    cpu_before = {role: group_cpu(pgid) for role, pgid in pgids.items()}
    client_before = time.process_time()

    async def all_streams() -> list[Stream]:
        delays = [rng.uniform(0, args.ramp_ms / 1000) for _ in range(streams)]
        return list(await asyncio.gather(*(one_stream(config.port, args, tokens, d, bound)
                                           for d in delays)))

    began = time.monotonic()
    done = asyncio.run(all_streams())
    wall = max((s.end for s in done if s.end), default=time.monotonic()) - began
    client_cpu = time.process_time() - client_before
    failed = [s.error for s in done if s.error]
    if failed:
        raise BenchError(f"{config.name} round {index}: {len(failed)} of {streams} streams "
                         f"failed, e.g. {failed[:3]}")
    result = Round(config.name, index, done, wall, {})
    if observed:
        ended = time.monotonic()
        deadline = ended + 15
        while True:
            after = sitsmesh_counters(node)
            if after["streams"] - before["streams"] >= streams or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        result.settle_s = time.monotonic() - ended
        result.sitsmesh = {k: after[k] - before[k] for k in SITSMESH_METRICS}
        if result.sitsmesh["streams"] != streams:
            raise BenchError(f"{config.name} round {index}: sitsmesh reported "
                             f"{result.sitsmesh['streams']:g} streams of {streams}")
        if result.sitsmesh["tokens"] != result.tokens:
            raise BenchError(f"{config.name} round {index}: sitsmesh counted "
                             f"{result.sitsmesh['tokens']:g} tokens, the client got "
                             f"{result.tokens}")
    result.cpu = {role: group_cpu(pgid) - cpu_before[role] for role, pgid in pgids.items()}
    result.cpu["client"] = client_cpu
    return result


# --------------------------------------------------------------------------- tables

def ms(value: float) -> str:
    return f"{value * 1000:.2f}"


def spread(values: Sequence[float], fmt: Callable[[float], str] = ms) -> str:
    return (f"{fmt(statistics.median(values))} ({fmt(min(values))} to {fmt(max(values))})"
            if values else "-")


def round_line(r: Round) -> str:
    ttfts, gaps = r.ttfts(), r.gaps()
    s = r.sitsmesh
    own = (f"{s['ttft_sum'] / s['ttft_count'] * 1000:.2f} / "
           f"{s['tpot_sum'] / s['tpot_count'] * 1000:.2f}"
           if s.get("ttft_count") and s.get("tpot_count") else "-")
    sitsmesh = f"{r.per_1k('sitsmesh') * 1000:.1f}" if r.config in OBSERVED else (
        f"({r.per_1k('sitsmesh') * 1000:.1f} idle)")
    envoy = f"{r.per_1k(r.config) * 1000:.1f}" if r.config in r.cpu else "-"
    settle = f"{r.settle_s * 1000:.0f}" if r.config in OBSERVED else "-"
    return (f"| {r.index} | {r.config} | {ms(pct(ttfts, 50))} | {ms(pct(ttfts, 99))} | "
            f"{ms(pct(gaps, 50))} | {ms(pct(gaps, 99))} | {ms(max(gaps))} | "
            f"{r.tokens / r.wall_s:.0f} | {envoy} | {sitsmesh} | "
            f"{r.per_1k('stage') * 1000:.1f} | {r.per_1k('client') * 1000:.1f} | "
            f"{own} | {settle} |")


def print_tables(rounds: list[Round], configs: list[str], args: argparse.Namespace) -> None:
    # A round lasts from the first request to the last stream's end: the last start
    # (~the ramp), its TTFT and tokens - 1 gaps.
    nominal_s = (args.ramp_ms + args.ttft_ms + (args.tokens - 1) * args.itl_ms) / 1000
    print(f"\n{args.streams} streams x {args.tokens} tokens, TTFT {args.ttft_ms} ms, ITL "
          f"{args.itl_ms} ms, starts over {args.ramp_ms} ms; nominal (tokens/s as measured) ~"
          f"{args.streams * args.tokens / nominal_s:.0f} tokens/s "
          f"({args.streams * 1000 / args.itl_ms:.0f} at full concurrency)\n")
    print("Per round (CPU in ms per 1 000 tokens; sitsmesh's own mean TTFT / time per "
          "token in ms; settle: last stream end to sitsmesh having reported all):\n")
    print("| round | config | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | "
          "ITL max ms | tokens/s | Envoy CPU | sitsmesh CPU | stage CPU | client CPU | "
          "sitsmesh TTFT / TPOT | settle ms |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rounds:
        print(round_line(r))
    print(f"\nPer configuration, median over {args.rounds} rounds (range); CPU in ms per "
          "1 000 tokens:\n")
    print("| config | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | tokens/s | "
          "Envoy CPU | sitsmesh CPU | stage CPU | client CPU |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def cpu_fmt(v: float) -> str:
        return f"{v * 1000:.1f}"

    for name in configs:
        mine = [r for r in rounds if r.config == name]
        envoy = spread([r.per_1k(name) for r in mine], cpu_fmt) if name != "direct" else "-"
        sits = spread([r.per_1k("sitsmesh") for r in mine], cpu_fmt)
        print(f"| {name} | {spread([pct(r.ttfts(), 50) for r in mine])} | "
              f"{spread([pct(r.ttfts(), 99) for r in mine])} | "
              f"{spread([pct(r.gaps(), 50) for r in mine])} | "
              f"{spread([pct(r.gaps(), 99) for r in mine])} | "
              f"{spread([r.tokens / r.wall_s for r in mine], lambda v: f'{v:.0f}')} | "
              f"{envoy} | {sits if name in OBSERVED else f'({sits} idle)'} | "
              f"{spread([r.per_1k('stage') for r in mine], cpu_fmt)} | "
              f"{spread([r.per_1k('client') for r in mine], cpu_fmt)} |")
    plain = {r.index: r for r in rounds if r.config == "plain"}
    for name in [c for c in configs if c in OBSERVED]:
        print_added(plain, {r.index: r for r in rounds if r.config == name}, name)
    if "twin" in configs:
        # A/A: a second Envoy configured as plain, measured the same way. What it
        # "adds" is the bench's own resolution on this machine.
        print_added(plain, {r.index: r for r in rounds if r.config == "twin"}, "twin")


def print_added(plain: dict[int, Round], observed: dict[int, Round], name: str) -> None:
    """What `name` adds to TTFT and ITL over plain, round by round (same round)."""
    print(f"\nAdded by {name} ({name} - plain), ms:\n")
    print("| | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 |")
    print("|---|---:|---:|---:|---:|")
    rows: list[list[float]] = []
    for i in sorted(plain):
        a, b = plain[i], observed[i]
        row = [pct(b.ttfts(), 50) - pct(a.ttfts(), 50), pct(b.ttfts(), 99) - pct(a.ttfts(), 99),
               pct(b.gaps(), 50) - pct(a.gaps(), 50), pct(b.gaps(), 99) - pct(a.gaps(), 99)]
        rows.append(row)
        print(f"| round {i} | " + " | ".join(ms(v) for v in row) + " |")
    print("| median over rounds (range) | "
          + " | ".join(spread([row[k] for row in rows]) for k in range(4)) + " |")
    pooled_a = [t for r in plain.values() for t in r.ttfts()]
    pooled_b = [t for r in observed.values() for t in r.ttfts()]
    print(f"| all rounds pooled | {ms(pct(pooled_b, 50) - pct(pooled_a, 50))} | "
          f"{ms(pct(pooled_b, 99) - pct(pooled_a, 99))} | | |")
    if name == "twin":
        return  # A/A: no target, only the resolution
    verdict = "met" if statistics.median(row[1] for row in rows) <= 0.001 else "missed"
    print(f"\nTarget for {name} (added TTFT p99 <= 1 ms, median over rounds): {verdict}")


BENIGN = ("There is no configured limit to the number of allowed active downstream",)


def bad_line(line: str) -> bool:
    """A warning or error: JSON lines (sitsmesh) by their level, others (Envoy, Python
    tracebacks) by their tag; Envoy's start-up note on connection limits is left out."""
    if any(b in line for b in BENIGN):
        return False
    with contextlib.suppress(ValueError):
        record = json.loads(line)
        if isinstance(record, dict):
            level = str(record.get("level") or record.get("levelname") or "").lower()
            return level in ("warning", "warn", "error", "critical", "exception")
    return any(tag in line for tag in ("[warning]", "[error]", "[critical]", "Traceback"))


def log_notes(procs: dict[str, harness.Proc]) -> list[str]:
    notes = []
    for role, proc in procs.items():
        bad = [line for line in proc.output().splitlines() if bad_line(line)]
        notes.append(f"{role} log: {len(bad)} warning/error lines"
                     + (": " + " | ".join(line[:300] for line in bad[:5]) if bad else ""))
    return notes


# --------------------------------------------------------------------------- main

def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, default=100, help="concurrent streams per round")
    p.add_argument("--tokens", type=int, default=256, help="tokens per stream")
    p.add_argument("--itl-ms", type=float, default=20.0, help="stage's time per token")
    p.add_argument("--ttft-ms", type=float, default=50.0, help="stage's time to first token")
    p.add_argument("--ramp-ms", type=float, default=500.0,
                   help="streams start at random offsets within this")
    p.add_argument("--rounds", type=int, default=5, help="rounds of every configuration")
    p.add_argument("--direct", action="store_true",
                   help="also a configuration straight to the stage (no Envoy)")
    p.add_argument("--streamed", action="store_true",
                   help="also Envoy with the fragment in STREAMED mode instead of "
                        "observability mode: each chunk waits for sitsmesh's CONTINUE")
    p.add_argument("--nice", type=int, default=None,
                   help="renice every sitsmesh thread to this (e.g. 19)")
    p.add_argument("--isolate", action="store_true",
                   help="sitsmesh alone on CPU 1; Envoys, stage and client on CPU 0")
    p.add_argument("--max-streams-per-connection", type=int, default=None,
                   help="sitsmesh's setting (default 16). At 16, a burst of new streams "
                        "over fresh connections has some refused (reset): in STREAMED "
                        "mode the client then gets a 503; run --streamed with 1000")
    p.add_argument("--twin", action="store_true",
                   help="also a second Envoy without the fragment (A/A): what it 'adds' "
                        "over plain is the bench's resolution")
    p.add_argument("--seed", type=int, default=27)
    args = p.parse_args(argv)
    configs = ["plain", "ext_proc", "timing"] + (["streamed"] if args.streamed else []) + (
        ["twin"] if args.twin else [])
    start_load = load1()
    print(f"start {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}, 1-min load "
          f"{start_load:.2f}", file=sys.stderr)
    rounds: list[Round] = []
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="sitsmesh-tokens-") as tmp, \
            contextlib.ExitStack() as stack:
        work = Path(tmp)
        try:
            stage = harness.spawn([sys.executable, "-c", STAGE_CODE, str(args.ttft_ms / 1000),
                                   str(args.itl_ms / 1000), str(args.tokens)],
                                  work / "stage.log")
            stack.callback(stage.kill)
            port_line: list[str] = []

            def stage_port() -> bool:
                if stage.proc.poll() is not None:
                    raise BenchError(f"stage exited: {stage.output()}")
                port_line[:] = [w for w in stage.output().split() if w.isdigit()]
                return bool(port_line)

            harness.wait_until(stage_port, 20, "the stage's port")
            stage_port_n = int(port_line[0])
            node = harness.start_sitsmesh(work, *(
                ["--max-streams-per-connection", str(args.max_streams_per_connection)]
                if args.max_streams_per_connection else []))
            stack.callback(node.kill)
            envoys = {}
            for name, fragments in (("plain", []), ("ext_proc", ["ext_proc"]),
                                    ("timing", ["access_log", "token_timing"])):
                (work / name).mkdir()
                envoys[name] = harness.start_envoy(work / name, node.data_addr, stage_port_n,
                                                   fragments=fragments)
                stack.callback(envoys[name].kill)
            if args.twin:
                (work / "twin").mkdir()
                envoys["twin"] = harness.start_envoy(work / "twin", node.data_addr,
                                                     stage_port_n, fragments=[])
                stack.callback(envoys["twin"].kill)
            if args.streamed:
                (work / "streamed").mkdir()
                envoys["streamed"] = streamed_envoy(work / "streamed", node.data_addr,
                                                    stage_port_n)
                stack.callback(envoys["streamed"].kill)
            by_name = {name: Config(name, e.listen_port, e.proc.pid)
                       for name, e in envoys.items()}
            if args.direct:
                configs.insert(0, "direct")
                by_name["direct"] = Config("direct", stage_port_n, None)
            pgids = {"sitsmesh": node.proc.pid, "stage": stage.proc.pid,
                     **{n: e.proc.pid for n, e in envoys.items()}}
            if args.isolate:
                for pgid in [stage.proc.pid, *(e.proc.pid for e in envoys.values())]:
                    place(pgid, {0}, None)
                os.sched_setaffinity(0, {0})
            if args.isolate or args.nice is not None:
                place(node.proc.pid, {1} if args.isolate else None, args.nice)
            for name in configs:  # warm-up, not reported
                run_round(by_name[name], -1, args, min(args.streams, 20),
                          min(args.tokens, 32), pgids, node)
            for i in range(args.rounds):
                for name in configs if i % 2 == 0 else configs[::-1]:
                    r = run_round(by_name[name], i, args, args.streams, args.tokens, pgids,
                                  node)
                    rounds.append(r)
                    print(round_line(r), file=sys.stderr)
                    time.sleep(1)
            # In observability mode Envoy closes its side of each ext_proc stream only
            # after deferred_close_timeout (5 s by default): read the stats after that.
            time.sleep(6)
            for name in [c for c in configs if c in ("ext_proc", "streamed")]:
                stats = envoys[name].admin_get("/stats").splitlines()
                ext = [line for line in stats
                       if "ext_proc" in line and not line.endswith(": 0")]
                notes.append(f"{name} Envoy's nonzero ext_proc stats (6 s after the last "
                             "round): " + "; ".join(ext))
            for name in configs:
                stalls = sum(1 for r in rounds if r.config == name
                             for g in r.gaps() if g > 1.0)
                notes.append(f"{name}: client gaps over 1 s: {stalls}")
            for name in [c for c in configs if c in OBSERVED]:
                counted = sum(r.sitsmesh["stalls"] for r in rounds if r.config == name)
                notes.append(f"sitsmesh stalls counted over the {name} rounds: {counted:g}")
            notes += log_notes({"sitsmesh": node, "stage": stage, **envoys})
        except (BenchError, TimeoutError, RuntimeError, OSError) as exc:
            print(f"FAILED: {exc}", file=sys.stderr)
            with contextlib.suppress(NameError):  # what the logs say, where they exist
                for note in log_notes({"sitsmesh": node, **envoys}):
                    print(f"- {note}", file=sys.stderr)
                for name, envoy in envoys.items():
                    bad = [line for line in envoy.admin_get("/stats").splitlines()
                           if any(w in line for w in ("fail", "overflow", "reset", "5xx",
                                                      "timeout", "refused"))
                           and not line.endswith(": 0")]
                    print(f"- {name} Envoy's nonzero failure stats: {'; '.join(bad)}",
                          file=sys.stderr)
            return 1
    end_load = load1()
    print(f"end {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}, 1-min load "
          f"{end_load:.2f}", file=sys.stderr)
    print(f"1-min load: {start_load:.2f} at the start, {end_load:.2f} at the end")
    print_tables(rounds, configs, args)
    print("\nNotes:")
    for note in notes:
        print(f"- {note}")
    total = sum(r.tokens for r in rounds)
    print(f"- every stream got all its tokens: {len(rounds) * args.streams} streams, "
          f"{total} tokens; sitsmesh's token count matched the client's in every ext_proc "
          "and timing round")
    return 0


if __name__ == "__main__":
    sys.exit(main())
