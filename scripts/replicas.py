"""Start N ``ds4serve serve`` replicas behind vllm-router on one machine; Ctrl-C stops them all.

    pip install vllm-router                       # the router: a wheel with a Rust binary
    python scripts/replicas.py                    # 2 replicas of the bundled model, router on :8000
    python scripts/replicas.py -n 3 --port 9000 --serve-args "--max-seqs 32"
    python scripts/replicas.py --policy round_robin   # the same, routed without regard to prefixes
    python scripts/replicas.py --bench-rounds 5       # multi-turn bench: one server vs cache_aware vs round_robin
    python scripts/replicas.py --bench-rounds 3 --bench-policies cache_aware,consistent_hash,round_robin

Clients talk to the router (``http://127.0.0.1:PORT/v1``) exactly as to one server. The default
policy, ``cache_aware``, keeps a prefix tree per replica of the prompts it sent there, keyed on the
token ids each replica renders for a request (``POST /v1/chat/completions/render``,
``ds4serve/server/router_api.py``), and sends a request to the replica holding its longest prefix
unless the load is too uneven: a conversation keeps landing on the replica whose prefix cache holds
its history. (The router does not tokenize requests with images; it matches those on their text, so
a conversation may change replicas once, at its first image.) It balances load only past
``--balance-abs-threshold`` requests of difference (64 by default), so conversations sharing a long
system prompt all go to one replica until then. Pass ``--router-args "--cache-threshold X"`` with X
between the system prompt's share of a first turn and a second turn's cached share (0.6 in the README's
bench): new conversations then go to the replica with the smallest tree and later turns stay home;
``--balance-abs-threshold 1`` spreads them too, but moves turns for load. The replicas listen on the
ports after the router's (``--port`` + 1, + 2, ...).

``consistent_hash`` is the other policy with affinity: it hashes a session key onto a ring of the
replicas, the first of the headers ``X-Session-ID``, ``X-User-ID``, ``X-Tenant-ID``, ``X-Request-ID``...
or the body's ``session_params.session_id`` / ``user``, and without one the whole request body, which
changes every turn (no affinity). It needs clients that send such a key (the multi-turn bench sends
``X-Session-ID`` per conversation), never moves a conversation for load, and spreads conversations by
hash whatever prefix they share; ``cache_aware`` needs nothing from the client.

Why vllm-router (and not sglang-router): both wheels forward the OpenAI routes to HTTP workers and
both have a cache-aware policy, but vllm-router's asks the worker itself for the prompt's token ids
(vLLM's render and ``/tokenize`` routes, which ds4serve serves in vLLM's shapes), so its tree matches
what the prefix cache matches, and it passes the other routes through; sglang-router matches on the
request text, probes SGLang's own discovery routes (``/server_info``, ``/model_info``...), answers
``/tokenize`` itself instead of forwarding it, and its ``--backend openai`` mode takes one upstream
only.

A replica that dies mid-run: the streams it was sending are cut (the client sees the body end
early), a non-streamed request it held is retried by the router on another replica or answered 500,
nothing hangs; new requests, later turns of its conversations included, go to the replicas left (the
router's circuit breaker and its health checks, every ``--health-interval`` s). The launcher says
which replica exited and keeps the others serving until Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random", "consistent_hash")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def router_binary(given: str | None = None) -> str:
    """The ``vllm-router`` launcher: ``given``, else the one beside this Python, else on PATH."""
    if given:
        return given
    beside = Path(sys.executable).with_name("vllm-router")
    if beside.exists():
        return str(beside)
    found = shutil.which("vllm-router")
    if found is None:
        raise SystemExit("vllm-router is not installed: run `pip install vllm-router` (or pass --router PATH)")
    return found


def _answers(url: str, ok_below: int = 300) -> bool:
    """Whether ``url`` answers with a status under ``ok_below``."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status < ok_below
    except urllib.error.HTTPError as exc:
        return exc.code < ok_below
    except OSError:
        return False


@dataclass
class Replicas:
    """N ``ds4serve serve`` children and one vllm-router child; ``start``/``stop`` or a ``with`` block.

    ``serve_args``: more ``ds4serve serve`` flags for every replica; ``router_args``: more router flags.
    Logs go to ``log_dir`` (one file per process) or, without one, to this process's output."""

    n: int = 2
    port: int = 8000
    policy: str = "cache_aware"
    serve_args: Sequence[str] = ()
    router_args: Sequence[str] = ()
    router: str | None = None
    health_interval_s: int = 2
    log_dir: Path | None = None
    startup_timeout_s: float = 300.0
    with_router: bool = True  # False: the replicas alone (one plain server when n is 1)
    procs: list[subprocess.Popen] = field(default_factory=list, init=False)
    router_proc: subprocess.Popen | None = field(default=None, init=False)

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """Where clients go: the router, or the first replica when there is none."""
        return self.router_url if self.with_router else self.replica_urls[0]

    @property
    def replica_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.port + 1 + i}" for i in range(self.n)]

    def _spawn(self, cmd: list[str], name: str) -> subprocess.Popen:
        # a process group of its own: the terminal's Ctrl-C reaches this launcher only, which then stops
        # every child in order (router first, so no request is sent to a replica already stopping)
        if self.log_dir is None:
            return subprocess.Popen(cmd, start_new_session=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"{name}.log", "ab") as out:  # the child keeps its own copy of the file
            return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def replica_cmd(self, i: int) -> list[str]:
        port = self.port + 1 + i
        return [sys.executable, "-m", "ds4serve.cli", "serve", "--port", str(port), *self.serve_args]

    def router_cmd(self) -> list[str]:
        return [router_binary(self.router), "--worker-urls", *self.replica_urls, "--policy", self.policy,
                "--host", "127.0.0.1", "--port", str(self.port), "--prometheus-port", str(free_port()),
                "--health-check-interval-secs", str(self.health_interval_s), "--health-failure-threshold", "1",
                "--health-check-timeout-secs", "2", "--log-level", "warning", *self.router_args]

    def _wait(self, url: str, proc: subprocess.Popen, what: str, ok_below: int = 300) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while not _answers(url, ok_below):
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited during start-up (status {proc.returncode}); see its log")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not answer {url} within {self.startup_timeout_s:.0f} s")
            time.sleep(0.2)

    def start(self) -> Replicas:
        """Replicas first (all loading at once), each waited for on /health; then the router, waited
        for until its /v1/models goes through to a replica (a 401 from a replica with API keys counts:
        the route works, the launcher just holds no key)."""
        if self.policy not in ROUTER_POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; one of {', '.join(ROUTER_POLICIES)}")
        try:
            self.procs = [self._spawn(self.replica_cmd(i), f"replica-{self.port + 1 + i}") for i in range(self.n)]
            for i, (url, proc) in enumerate(zip(self.replica_urls, self.procs)):
                self._wait(url + "/health", proc, f"replica {i} ({url})")
            if not self.with_router:
                return self
            self.router_proc = self._spawn(self.router_cmd(), f"router-{self.port}")
            self._wait(self.router_url + "/v1/models", self.router_proc, f"the router ({self.router_url})",
                       ok_below=500)
        except BaseException:
            self.stop()
            raise
        return self

    def kill_replica(self, i: int) -> None:
        """SIGKILL replica ``i`` (a crash, not a shutdown: nothing is answered on its way out)."""
        self.procs[i].kill()
        self.procs[i].wait(timeout=30)

    def exited(self) -> list[int]:
        """Indices of replicas that are no longer running."""
        return [i for i, p in enumerate(self.procs) if p.poll() is not None]

    def stop(self) -> None:
        """The router first, then the replicas together (SIGTERM: each answers its waiting clients, then
        exits; one still running after 30 s is killed)."""
        for group in ([self.router_proc] if self.router_proc else [], self.procs):
            for proc in group:
                if proc.poll() is None:
                    proc.terminate()
            for proc in group:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=30)

    def __enter__(self) -> Replicas:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


ONE_SERVER = "one server"


def bench_targets(n: int, policies: Sequence[str]) -> list[tuple[str, int, str | None]]:
    """`--bench-rounds`: the same multi-turn conversations against one plain server, then against
    ``n`` replicas behind the router under each policy: (label, replicas, policy or None)."""
    return [(ONE_SERVER, 1, None)] + [(f"{n} replicas, {p}", n, p) for p in policies]


def bench_once(fleet: Replicas, seed: int, bench_args: Sequence[str], out: Path) -> dict | None:
    """One ``ds4serve bench serve --multi-turn`` run against ``fleet`` after every replica's prefix
    cache was dropped; the last turn's figures (None when no conversation reached it)."""
    for url in fleet.replica_urls:
        urllib.request.urlopen(urllib.request.Request(url + "/reset_prefix_cache", method="POST"), timeout=60)
    cmd = [sys.executable, "-m", "ds4serve.cli", "--log-level", "WARNING", "bench", "serve", "--multi-turn",
           "--base-url", fleet.url, "--seed", str(seed), "--out", str(out), *bench_args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the bench failed against {fleet.url} (status {done.returncode}): {done.stderr[-2000:]}")
    run = json.loads((out / "bench_multiturn.json").read_text())["runs"][0]
    last = run["per_turn"][-1]
    if not last["completed"]:
        return None
    total = run["total"]
    return {"ttft_ms": last["ttft_ms_p50"], "cached": last["cached_tokens_mean"], "prompt": last["prompt_tokens_mean"],
            "ttft_all_ms": total["ttft_ms_p50"], "errors": total["requests"] - total["completed"]}


def bench_compare(rounds: int, bench_args: Sequence[str], serve_args: Sequence[str], router_args: Sequence[str],
                  port: int, log_dir: Path | None, out: Path, n: int = 2,
                  policies: Sequence[str] = ("cache_aware", "round_robin")) -> str:
    """Start one server and ``n`` replicas behind a router per policy, side by side; run the
    multi-turn bench against each in ``rounds`` interleaved rounds (round r uses seed r: fresh
    conversations, on caches just dropped; every target sees the same load from the other helpers
    of the machine, minute by minute); a markdown table of the last turn's medians."""
    fleets, base = [], port
    for label, count, policy in bench_targets(n, policies):
        fleets.append((label, Replicas(n=count, port=base, policy=policy or "cache_aware",
                                       with_router=policy is not None, serve_args=serve_args,
                                       router_args=router_args, log_dir=log_dir)))
        base += count + 1
    rows: dict[str, list[dict]] = {label: [] for label, _ in fleets}
    with contextlib.ExitStack() as stack:
        for _, fleet in fleets:
            stack.enter_context(fleet)
        for r in range(rounds):
            for i, (label, fleet) in enumerate(fleets):
                got = bench_once(fleet, r, bench_args, out / f"target{i}-round{r}")
                rows[label] += [got] if got else []
                load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"
                print(f"round {r + 1}/{rounds} {label}: {got} (1-min load average {load})", flush=True)
    return bench_table(rows)


def bench_table(rows: dict[str, list[dict]]) -> str:
    med = {label: {k: statistics.median(x.get(k, math.nan) for x in got)
                   for k in ("ttft_ms", "cached", "prompt", "ttft_all_ms")}
           for label, got in rows.items() if got}
    one = med.get(ONE_SERVER)
    rr = next((m for label, m in med.items() if label.endswith(", round_robin")), None)
    lines = ["| target | last-turn TTFT p50 ms (median; min-max over rounds) | x one server | x round_robin "
             "| cached tokens | uncached (prefilled) tokens | failed requests | all turns' TTFT p50 ms |",
             "|---|---|---|---|---|---|---|---|"]
    for label, m in med.items():
        spread = [x["ttft_ms"] for x in rows[label]]
        lines.append(f"| {label} | {m['ttft_ms']:.0f} ({min(spread):.0f}-{max(spread):.0f}) "
                     f"| {m['ttft_ms'] / one['ttft_ms']:.2f} | {m['ttft_ms'] / rr['ttft_ms']:.2f} "
                     f"| {m['cached']:.0f} of {m['prompt']:.0f} | {m['prompt'] - m['cached']:.0f} "
                     f"| {sum(x.get('errors', 0) for x in rows[label])} | {m['ttft_all_ms']:.0f} |"
                     if one and rr else f"| {label} | {m['ttft_ms']:.0f} | | | {m['cached']:.0f} | |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--replicas", type=int, default=2, help="ds4serve serve processes (default 2)")
    p.add_argument("--port", type=int, default=8000,
                   help="the router's port; the replicas take the next N ports (default 8000)")
    p.add_argument("--policy", default="cache_aware", choices=ROUTER_POLICIES,
                   help="the router's policy (default cache_aware: prefix-aware)")
    p.add_argument("--serve-args", default="",
                   help="more `ds4serve serve` flags for every replica, one string (e.g. "
                        "--serve-args='--model path/to/ckpt --max-seqs 32'); default: the bundled model")
    p.add_argument("--router-args", default="", help="more vllm-router flags, one string")
    p.add_argument("--router", default=None, help="the vllm-router executable (default: found beside Python)")
    p.add_argument("--health-interval", type=int, default=2,
                   help="seconds between the router's health checks (how soon a dead replica is dropped)")
    p.add_argument("--log-dir", type=Path, default=None, help="one log file per process here (default: stdout)")
    b = p.add_argument_group("compare (instead of serving: one server vs replicas behind the router)")
    b.add_argument("--bench-rounds", type=int, default=0,
                   help="run `ds4serve bench serve --multi-turn` against one server, 2 cache-aware and 2 "
                        "round-robin replicas (started side by side from --port on), this many interleaved "
                        "rounds, print the last turn's TTFT and cached tokens, and exit")
    b.add_argument("--bench-policies", default="cache_aware,round_robin",
                   help="router policies to compare, comma-separated (e.g. cache_aware,consistent_hash,"
                        "round_robin); each gets its own --replicas replicas")
    b.add_argument("--bench-args", default="", help="more `bench serve --multi-turn` flags, one string "
                   "(e.g. --bench-args='--no-images --conversations 3')")
    b.add_argument("--bench-out", type=Path, default=Path("bench-out/replicas"), help="each run's report here")
    return p


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.replicas < 1:
        print("replicas.py: --replicas must be at least 1", file=sys.stderr)
        return 2
    if args.bench_rounds > 0:
        try:
            policies = [p for p in args.bench_policies.split(",") if p]
            unknown = [p for p in policies if p not in ROUTER_POLICIES]
            if unknown:
                raise RuntimeError(f"unknown --bench-policies {', '.join(unknown)}; "
                                   f"choose from {', '.join(ROUTER_POLICIES)}")
            print(bench_compare(args.bench_rounds, shlex.split(args.bench_args), shlex.split(args.serve_args),
                                shlex.split(args.router_args), args.port, args.log_dir, args.bench_out,
                                n=args.replicas, policies=policies))
        except RuntimeError as exc:
            print(f"replicas.py: {exc}", file=sys.stderr)
            return 1
        return 0
    reps = Replicas(n=args.replicas, port=args.port, policy=args.policy, serve_args=shlex.split(args.serve_args),
                    router_args=shlex.split(args.router_args), router=args.router,
                    health_interval_s=args.health_interval, log_dir=args.log_dir)
    # `kill` stops everything as Ctrl-C does; SIGINT set too, since a shell starts background jobs with
    # it ignored (Python then never raises KeyboardInterrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        reps.start()
    except (RuntimeError, KeyboardInterrupt) as exc:
        print(f"replicas.py: {exc}" if str(exc) else "replicas.py: interrupted during start-up", file=sys.stderr)
        return 1
    print(f"router ({args.policy}) on {reps.router_url}/v1 -> replicas {', '.join(reps.replica_urls)}; "
          "Ctrl-C stops everything", flush=True)
    seen: set[int] = set()
    try:
        while True:
            for i in set(reps.exited()) - seen:
                print(f"replica {i} ({reps.replica_urls[i]}) exited with status {reps.procs[i].returncode}; "
                      "the router sends its traffic to the others", flush=True)
                seen.add(i)
            if reps.router_proc is not None and reps.router_proc.poll() is not None:
                print(f"the router exited (status {reps.router_proc.returncode}); stopping", file=sys.stderr)
                return 1
            if len(seen) == reps.n:
                print("every replica has exited; stopping", file=sys.stderr)
                return 1
            time.sleep(1)
    except KeyboardInterrupt:
        print("stopping the router and the replicas", flush=True)
        return 0
    finally:
        with contextlib.suppress(KeyboardInterrupt):
            reps.stop()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
