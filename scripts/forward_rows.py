"""What one native forward costs by its row count: the price of a verify row (speculative decoding).

A drafting step verifies 1 + L rows of one sequence where a plain step decodes one, so its forward's cost
against the one-row forward bounds what drafts can gain at one stream. This times ``HostForward.forward``
alone (no scheduling, sampling or view building) on one sequence's chunk of ``rows`` tokens at a fixed
position, for each row count and thread count, interleaved, and prints the median of each.

    python scripts/forward_rows.py [--model models/ds4v-tiny] [--rows 1 2 3 5 8 16] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import ds4serve  # noqa: F401  (before torch: its OpenMP spin advice)
import torch

from ds4serve.cache import SeqChunk
from ds4serve.llm import LLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=Path("models/ds4v-tiny"))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 5, 8, 16])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--position", type=int, default=200, help="where the chunk starts (its context length)")
    ap.add_argument("--calls", type=int, default=200, help="timed calls per case and round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(args.model, max_seqs=1, warmup=False)
    ex = llm.core.executor
    if ex.host is None:
        raise SystemExit("the native host forward does not run here (it is what this script times)")
    end = args.position + max(args.rows)
    if end > llm.max_model_len or not ex.cache.reserve({0: end}):
        raise SystemExit(f"cannot hold {end} positions in one slot; lower --position or --rows")
    vocab = llm.core.cfg.vocab_size
    views = {r: ex._view([SeqChunk(0, args.position, tuple((7 * i) % (vocab - 10) + 3 for i in range(r)),
                                   ex.cache.block_table(0))]) for r in args.rows}
    times: dict[tuple[int, int], list[float]] = {(t, r): [] for t in args.threads for r in args.rows}
    for _ in range(args.rounds):
        for t in args.threads:
            torch.set_num_threads(t)
            for r in args.rows:
                for _ in range(10):  # warm: caches, the pool's threads
                    ex.host.forward(views[r])
                for _ in range(args.calls):
                    t0 = time.perf_counter()
                    ex.host.forward(views[r])
                    times[(t, r)].append(time.perf_counter() - t0)
    print(f"{args.model}: native forward of one sequence's chunk at position {args.position}, median us")
    print("| threads | " + " | ".join(f"{r} rows" for r in args.rows) + " |")
    print("|---:|" + "---:|" * len(args.rows))
    for t in args.threads:
        print(f"| {t} | " + " | ".join(f"{statistics.median(times[(t, r)]) * 1e6:.0f}" for r in args.rows) + " |")


if __name__ == "__main__":
    main()
