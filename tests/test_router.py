"""Replicas behind a router (issue 30, item 2): the routes vllm-router asks a ds4serve worker for, in
its shapes (``ds4serve/server/router_api.py``), and, when ``vllm-router`` is installed, two replicas of
the bundled model behind the real router (``scripts/replicas.py``): a conversation keeps landing on the
replica that holds its prefix cache, and a replica killed mid-run costs only the requests it held
(they end with an error, never a hang) while every other request, and every later one, is answered.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random
import shutil
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ds4serve.server.inprocess import serve

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "models" / "ds4v-tiny"
KEYS = {"ops": "sk-ops-test"}


def chat(messages: list[dict], **extra) -> dict:
    return {"model": "tiny", "messages": messages, "temperature": 0, **extra}


def conversation(tag: str, turns: int) -> list[dict]:
    """A system message of ~300 tokens (more than one 256-token snapshot interval) unique to ``tag``,
    then ``turns`` user messages (the answers are filled in as they come)."""
    rules = " ".join(f"Rule {i} of {tag}: answer briefly." for i in range(14))
    return [{"role": "system", "content": rules}] + [{"role": "user", "content": f"What is {i} + {i + 2}?"}
                                                     for i in range(turns)]


@pytest.fixture(scope="module")
def srv():
    with serve(BUNDLED, name="tiny", random_weights=False) as s:
        yield s


@pytest.fixture(scope="module")
def keyed():
    with serve(BUNDLED, name="tiny", random_weights=False, api_keys=KEYS) as s:
        yield s


def test_render_gives_the_ids_the_chat_prefills(srv):
    """vLLM's render shape; its ids are the ones /tokenize gives and the chat completion prefills."""
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "5"}, {"role": "user", "content": "And 4 + 4?"}]
    r = httpx.post(srv.base + "/v1/chat/completions/render", json=chat(msgs, max_tokens=7), timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) >= {"request_id", "model", "token_ids", "features", "sampling_params"}
    assert body["model"] == "tiny" and body["features"] is None and body["sampling_params"]["max_tokens"] == 7
    ids = body["token_ids"]
    assert all(isinstance(t, int) for t in ids) and len(ids) > 10
    tok = httpx.post(srv.base + "/tokenize", json={"model": "tiny", "messages": msgs}, timeout=30).json()
    assert ids == tok["tokens"]
    done = httpx.post(srv.base + "/v1/chat/completions", json=chat(msgs, max_tokens=1), timeout=30).json()
    assert done["usage"]["prompt_tokens"] == len(ids)
    # a later turn's ids start with the earlier turn's: the prefix a router's tree matches on
    short = httpx.post(srv.base + "/v1/chat/completions/render", json=chat(msgs[:2]), timeout=30).json()["token_ids"]
    assert ids[:len(short) - 1] == short[:-1]


def test_render_refuses_what_the_chat_route_refuses(srv):
    r = httpx.post(srv.base + "/v1/chat/completions/render", json={**chat([{"role": "user", "content": "hi"}]),
                                                                    "model": "other"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(srv.base + "/v1/chat/completions/render", json={"model": "tiny"}, timeout=30)
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]


def _loads(base: str) -> tuple[dict, dict]:
    return httpx.get(base + "/get_load", timeout=10).json(), httpx.get(base + "/load", timeout=10).json()


def test_load_counts_the_requests_a_replica_holds(srv):
    """SGLang's /get_load (``load``, what vllm-router reads) and vLLM's /load: 0 idle, 1 while one
    request streams, 0 again after it."""
    idle, idle_v = _loads(srv.base)
    assert idle["load"] == 0 and idle_v == {"server_load": 0}
    assert idle["pages_total"] > 0 and 0.0 <= idle["cache_usage"] <= 1.0
    body = chat([{"role": "user", "content": "Count."}], max_tokens=400, ignore_eos=True, stream=True)
    with httpx.stream("POST", srv.base + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        busy, busy_v = _loads(srv.base)
        assert busy["load"] == 1 and busy_v == {"server_load": 1}
        assert busy["num_reqs"] + busy["num_waiting_reqs"] == 1 and busy["pages_in_use"] > 0
        assert any(line == "data: [DONE]" for line in lines)
    deadline = time.monotonic() + 10  # the engine retires the request a moment after its last frame
    while _loads(srv.base)[0]["load"] and time.monotonic() < deadline:
        time.sleep(0.05)
    after, after_v = _loads(srv.base)
    assert after["load"] == 0 and after_v == {"server_load": 0}


def test_model_and_server_info(srv):
    info = httpx.get(srv.base + "/get_model_info", timeout=10).json()
    assert info["model_path"] == "tiny" and info["is_generation"] is True and info["max_model_len"] > 0
    server = httpx.get(srv.base + "/get_server_info", timeout=10).json()
    assert server["dp_size"] == 1 and server["served_model_name"] == "tiny" and server["prefix_cache_enabled"]


def test_keys_guard_what_names_the_model(keyed):
    """render (under /v1) and the info routes need a key; the load routes carry counts only, as
    /health carries a status, so a router without a key can still balance."""
    auth = {"Authorization": f"Bearer {KEYS['ops']}"}
    render = chat([{"role": "user", "content": "hi"}])
    for method, path, body in (("POST", "/v1/chat/completions/render", render), ("GET", "/get_model_info", None),
                               ("GET", "/get_server_info", None)):
        r = httpx.request(method, keyed.base + path, json=body, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        assert httpx.request(method, keyed.base + path, json=body, headers=auth, timeout=30).status_code == 200
    for path in ("/get_load", "/load", "/health"):
        assert httpx.get(keyed.base + path, timeout=10).status_code == 200, path


# ---- two replicas behind the real vllm-router ----------------------------------------------------

def _replicas_module():
    spec = importlib.util.spec_from_file_location("replicas_script", ROOT / "scripts" / "replicas.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def _free_block(n: int) -> int:
    """A port p with p .. p+n all free on loopback (the router and its replicas)."""
    rng = random.Random()  # unseeded on purpose: two test runs at once must not try the same ports
    for _ in range(200):
        base = rng.randrange(20000, 60000)
        socks = []
        try:
            for p in range(base, base + n + 1):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no block of free ports")


ROUTER = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
needs_router = pytest.mark.skipif(not Path(ROUTER).exists(), reason="vllm-router is not installed "
                                  "(pip install vllm-router)")


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    mod = _replicas_module()
    reps = mod.Replicas(n=2, port=_free_block(2), policy="cache_aware", router=ROUTER, health_interval_s=1,
                        serve_args=["--served-model-name", "tiny", "--max-seqs", "8"],
                        log_dir=tmp_path_factory.mktemp("replicas-logs"))
    with reps:
        yield reps


def _prompt_tokens(url: str) -> float:
    """The replica's ``ds4serve_prompt_tokens_total``: which replica served a request is the one whose
    count moved (the test sends one request at a time)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == "ds4serve_prompt_tokens"
               for s in f.samples if s.name.endswith("_total"))


@needs_router
def test_router_keeps_a_conversation_on_its_cache(replicas):
    """Three conversations, interleaved turn by turn through the router: every turn after the first
    lands on the replica that served the conversation's first turn and reuses its prefix there."""
    convs = {tag: conversation(tag, 4) for tag in ("alpha", "beta", "gamma")}
    history: dict[str, list[dict]] = {tag: [m[0]] for tag, m in convs.items()}
    home: dict[str, int] = {}
    for turn in range(4):
        for tag, msgs in convs.items():
            history[tag].append(msgs[1 + turn])
            before = [_prompt_tokens(u) for u in replicas.replica_urls]
            r = httpx.post(replicas.router_url + "/v1/chat/completions", json=chat(history[tag], max_tokens=8),
                           timeout=60)
            assert r.status_code == 200, r.text
            served = [i for i, u in enumerate(replicas.replica_urls) if _prompt_tokens(u) != before[i]]
            assert len(served) == 1
            answer = r.json()["choices"][0]["message"]["content"]
            history[tag].append({"role": "assistant", "content": answer})
            cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            if turn == 0:
                home[tag] = served[0]
            else:
                assert served[0] == home[tag], f"{tag} turn {turn + 1} left its replica"
                assert cached > 0, f"{tag} turn {turn + 1} reused nothing"


def unrelated(i: int) -> dict:
    """A user message of ~150 words of its own: no replica holds a prefix of another's."""
    words = random.Random(i).choices(("red", "blue", "cat", "tree", "river", "stone", "music", "lamp"), k=150)
    return {"role": "user", "content": f"{i} " + " ".join(words)}


async def _long_request(client: httpx.AsyncClient, url: str, i: int, stream: bool) -> str:
    """``ok``, or how it failed (a cut stream, an error status or frame, a transport error)."""
    # unrelated prompts: the router spreads them by load and tree size
    body = chat([unrelated(i)], max_tokens=600, ignore_eos=True, stream=stream)
    try:
        if not stream:
            r = await client.post(url + "/v1/chat/completions", json=body)
            return "ok" if r.status_code == 200 else f"status {r.status_code}"
        done = False
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return f"status {r.status_code}"
            async for line in r.aiter_lines():
                if line.startswith("data: {") and "error" in json.loads(line[6:]):
                    return "error frame"
                done = done or line == "data: [DONE]"
        return "ok" if done else "cut"
    except httpx.HTTPError as exc:
        return f"transport {type(exc).__name__}"


async def _wait_held(urls: list[str], n: int, timeout_s: float = 30) -> list[int]:
    """Poll each replica's /get_load until together they hold ``n`` requests; their shares."""
    async with httpx.AsyncClient(timeout=5) as c:
        deadline = time.monotonic() + timeout_s
        while True:
            held = [(await c.get(u + "/get_load")).json()["load"] for u in urls]
            if sum(held) >= n or time.monotonic() > deadline:
                return held
            await asyncio.sleep(0.05)


async def _kill_mid_run(replicas) -> tuple[list[str], list[int], int, float, list[str]]:
    n = 6
    async with httpx.AsyncClient(timeout=120) as client:
        tasks = [asyncio.create_task(_long_request(client, replicas.router_url, i, stream=i % 2 == 0))
                 for i in range(n)]
        held = await _wait_held(replicas.replica_urls, n)
        victim = max(range(len(held)), key=held.__getitem__)
        replicas.kill_replica(victim)
        t0 = time.monotonic()
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), timeout=90)  # never a hang
        elapsed = time.monotonic() - t0
        # each conversation goes on, those whose prefix the router saw go to the dead replica among them
        follow = [[unrelated(i), {"role": "assistant", "content": "Done."}, {"role": "user", "content": "Again?"}]
                  for i in range(n)]
        after = await asyncio.gather(*(client.post(replicas.router_url + "/v1/chat/completions",
                                                   json=chat(m, max_tokens=8)) for m in follow))
        return outcomes, held, victim, elapsed, [str(r.status_code) for r in after]


@needs_router
def test_a_killed_replica_costs_only_its_requests(replicas):
    """SIGKILL the replica holding the most of six long requests mid-run (both replicas hold some): at
    most the requests it held fail (a cut stream or an error status; the router retries non-streamed
    ones on the replica left, so those may still be answered), each within the run's time, not a
    hang; the others finish, and every request sent afterwards is answered by the replica left, the
    next turns of the conversations the dead replica held included."""
    outcomes, held, victim, elapsed, after = asyncio.run(_kill_mid_run(replicas))
    failed = [o for o in outcomes if o != "ok"]
    assert sum(held) == len(outcomes) and min(held) >= 1, held  # both replicas were serving
    assert len(failed) <= held[victim], (outcomes, held)
    assert all(o == "cut" or o.startswith(("status 5", "transport", "error frame")) for o in failed), failed
    assert elapsed < 90
    assert after == ["200"] * 6, after
    assert len(replicas.exited()) == 1


@pytest.fixture(scope="module")
def hashed(tmp_path_factory):
    """Two replicas behind vllm-router's consistent_hash policy (affinity by a session key)."""
    mod = _replicas_module()
    reps = mod.Replicas(n=2, port=_free_block(2), policy="consistent_hash", router=ROUTER, health_interval_s=1,
                        serve_args=["--served-model-name", "tiny", "--max-seqs", "8"],
                        log_dir=tmp_path_factory.mktemp("hashed-logs"))
    with reps:
        yield reps


@needs_router
def test_consistent_hash_keeps_a_bench_conversation_by_its_session_header(hashed):
    """The multi-turn bench sends each conversation's ``X-Session-ID``; consistent_hash keys on it, so
    conversations spread over both replicas while all turns of one land on the same replica and every
    turn after the first reuses the previous turn's prefix there. (This router build sends requests
    without such a header, a body ``user`` field included, all to one replica: affinity without
    spread.) One conversation at a time, so the replica whose prompt-token count moved is the one
    that served it. The hash ring is built on the replicas' URLs, whose ports are free ones picked at
    random, so which replica gets which conversation varies; 12 conversations all hashed to one
    replica happens once in 2,048 runs."""
    from ds4serve.bench import multiturn as mt

    spec = mt.MultiTurnSpec(conversations=12, turns=2, system_tokens=300, user_words=20, max_tokens=8,
                            images=False, seed=5)
    plan = mt.prepare(hashed.router_url, "tiny", spec, None)

    async def one(c: int) -> list:
        async with httpx.AsyncClient(timeout=60) as client:
            return await mt.run_conversation(client, hashed.router_url + "/v1/chat/completions", {}, "tiny",
                                             plan, c, spec)

    homes = set()
    for c in range(spec.conversations):
        before = [_prompt_tokens(u) for u in hashed.replica_urls]
        records = asyncio.run(one(c))
        moved = [i for i, u in enumerate(hashed.replica_urls) if _prompt_tokens(u) != before[i]]
        assert [r.result.ok for r in records] == [True] * spec.turns, [r.result.error for r in records]
        assert len(moved) == 1, f"conversation {c} was served by replicas {moved}"
        homes.add(moved[0])
        # the previous prompt's whole 256-token snapshot intervals (its last token, the generation
        # prompt's end, may render differently once the answer follows it)
        for prev, cur in zip(records, records[1:]):
            assert cur.result.cached_tokens >= (prev.result.prompt_tokens - 1) // 256 * 256 > 0, (c, cur.turn)
    assert homes == {0, 1}, "every conversation went to one replica: the session header was not used"


def test_bench_table_ratios_against_one_server_and_round_robin():
    """The `--bench-rounds` table: medians over rounds, each arm's TTFT over one server's and over
    round robin's, uncached tokens, the failed requests summed over rounds, all turns' TTFT."""
    mod = _replicas_module()
    assert [t[0] for t in mod.bench_targets(2, ["cache_aware", "round_robin"])] == [
        "one server", "2 replicas, cache_aware", "2 replicas, round_robin"]
    rows = {"one server": [{"ttft_ms": 100.0, "cached": 900.0, "prompt": 1000.0, "errors": 0, "ttft_all_ms": 50.0},
                           {"ttft_ms": 300.0, "cached": 900.0, "prompt": 1000.0, "errors": 0, "ttft_all_ms": 70.0},
                           {"ttft_ms": 200.0, "cached": 900.0, "prompt": 1000.0, "errors": 0, "ttft_all_ms": 90.0}],
            "2 replicas, cache_aware": [{"ttft_ms": 250.0, "cached": 900.0, "prompt": 1000.0, "errors": 1,
                                         "ttft_all_ms": 80.0}],
            "2 replicas, round_robin": [{"ttft_ms": 1000.0, "cached": 400.0, "prompt": 1000.0, "errors": 2,
                                         "ttft_all_ms": 400.0}]}
    lines = mod.bench_table(rows).splitlines()
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in lines[2:]}
    assert cells["one server"] == ["200 (100-300)", "1.00", "0.20", "900 of 1000", "100", "0", "70"]
    assert cells["2 replicas, cache_aware"] == ["250 (250-250)", "1.25", "0.25", "900 of 1000", "100", "1", "80"]
    assert cells["2 replicas, round_robin"] == ["1000 (1000-1000)", "5.00", "1.00", "400 of 1000", "600", "2", "400"]
