"""What joining token streams to latency chains costs (issue 27 item 2), in process.

A: the chain assembler alone, two hops per request (a guard and an LLM stage).
B: the same with the token join attached and both hops' stream reports fed to it (half
of the requests report before their chain closes, half after).
C: B's pipeline, but a second pipeline that never streams: its chains pass the join with
   two dict look-ups (the price every non-streaming chain pays).
Rounds interleaved (order rotated each round), medians reported, CPU time per request.
Then the memory of reports waiting for their chain, per request, with tracemalloc.

    .venv/bin/python bench/token_join.py --rounds 5 --requests 20000
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc
from collections.abc import Callable

from sitsmesh.chains.assembler import Assembler, Hop
from sitsmesh.chains.pipeline import Pipeline, Stage
from sitsmesh.chains.tokenjoin import TokenJoin
from sitsmesh.tokens.timing import End, StreamSummary

CHAT = Pipeline("chat", (Stage("guard", "upstream_cluster", "guard"),
                         Stage("llm", "upstream_cluster", "llm")))
PLAIN = Pipeline("plain", (Stage("pre", "upstream_cluster", "pre"),
                           Stage("model", "upstream_cluster", "model")))
SUMMARY = StreamSummary(0.15, 0.02, 0.03, 256, 50.0, (), 0, End.COMPLETE)


def _hops(rid: str, t: float, first: str, second: str) -> tuple[Hop, Hop]:
    return (Hop(rid, t, 6.0, upstream_cluster=first),
            Hop(rid, t + 0.01, 5.9, upstream_cluster=second))


def run(kind: str, requests: int) -> float:
    """CPU µs per request."""
    assembler = Assembler({"chat": CHAT, "plain": PLAIN})
    join = None
    if kind != "A":
        join = TokenJoin()
        assembler.on_close = join.closed
        join.report("warm", "chat", "llm", SUMMARY)  # the pipeline streams
    ids = [f"req-{kind}-{i:08d}" for i in range(requests)]
    start = time.process_time()
    for i, rid in enumerate(ids):
        if kind == "C":
            for hop in _hops(rid, float(i), "pre", "model"):
                assembler.add(hop)
            continue
        guard, llm = _hops(rid, float(i), "guard", "llm")
        if join is not None and i % 2:
            join.report(rid, "chat", "llm", SUMMARY)
            join.report(rid, "chat", "guard", SUMMARY)
        assembler.add(guard)
        assembler.add(llm)
        if join is not None and not i % 2:
            join.report(rid, "chat", "llm", SUMMARY)
            join.report(rid, "chat", "guard", SUMMARY)
    spent = time.process_time() - start
    if join is not None and kind == "B":
        assert join.joined == requests, (join.joined, join.waiting())
    return spent / requests * 1e6


def pending_bytes(count: int) -> float:
    """Bytes per request of reports waiting for their chain (two stages each)."""
    join = TokenJoin(max_pending=count)
    ids = [f"req-{i:08d}" for i in range(count)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for rid in ids:
        join.report(rid, "chat", "llm", SUMMARY)
        join.report(rid, "chat", "guard", SUMMARY)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=20_000)
    args = parser.parse_args()
    kinds = ["A", "B", "C"]
    results: dict[str, list[float]] = {k: [] for k in kinds}
    run("A", 2000)  # warm-up
    for r in range(args.rounds):
        for kind in kinds[r % 3:] + kinds[:r % 3]:
            results[kind].append(run(kind, args.requests))
    base = statistics.median(results["A"])
    names: dict[str, str] = {"A": "assembler alone (streaming pipeline)",
                             "B": "+ token join, both hops' reports joined",
                             "C": "+ token join, a pipeline that never streams"}
    print("| run | CPU µs/request, median | ratio vs A | rounds |")
    print("|---|---:|---:|---|")
    fmt: Callable[[float], str] = lambda v: f"{v:.1f}"  # noqa: E731
    for kind in kinds:
        median = statistics.median(results[kind])
        print(f"| {names[kind]} | {median:.1f} | {median / base:.2f} | "
              f"{', '.join(map(fmt, results[kind]))} |")
    print(f"\nreports waiting for their chain: {pending_bytes(20_000):.0f} bytes per request "
          f"(two stages), 20 000 requests")


if __name__ == "__main__":
    main()
