"""``ds4serve bench serve --multi-turn``: chat conversations that grow turn by turn, the traffic a
prefix cache is for.

A chat client resends the whole conversation every turn: the shared system prompt, every earlier
user message and every earlier answer, then the new user message. Without a prefix cache each turn
prefills all of it again, so time to first token grows with the conversation; with one, only the new
tail is prefilled. This bench runs N conversations concurrently (each one's turns in sequence: a
turn is sent when the previous answer has arrived) and reports, per turn index, TTFT (request sent ->
first content or reasoning delta), the prompt tokens the server counted and the cached tokens it
says it reused (``usage.prompt_tokens_details.cached_tokens``; absent counts as 0, and
``cached_reported`` says whether the server sent the field at all). A comparison runs the same
conversations against a cache-on and a cache-off server and reports the last turn's TTFT on both.

Everything the client sends is a pure function of the seed and the run's settings (the answers are
the model's, greedy, so they repeat too), which is what makes two runs comparable: with an exact
cache both servers see the same prompts and give the same answers (``answers_identical``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
import httpx
from tqdm.auto import tqdm

from .serve_bench import Result, _image_url, one_request

# common English words: one token each (with their leading space) in large BPE vocabularies, so a
# system prompt of N words is about N tokens there; smaller vocabularies are calibrated (`/tokenize`)
VOCAB = ("time", "people", "way", "water", "day", "work", "part", "place", "number", "world", "house", "point",
         "hand", "school", "light", "story", "fact", "month", "book", "night", "river", "stone", "garden",
         "engine", "winter", "signal", "market", "planet", "letter", "window", "table", "paper", "music",
         "city", "road", "field", "friend", "answer", "question", "line", "order", "plan", "rule", "note")
SYSTEM_LEAD = "You are a careful assistant. Keep the house notes below in mind and answer briefly."
# questions the bundled tiny model was trained on (ds4serve/tiny/data.py), so its answers make sense;
# any model can answer them
IMAGE_QUESTIONS = ("What colour is the triangle?", "How many shapes are there?", "Which shape is red?",
                   "Where is the circle?")
LETTER_WORDS = ("cat", "dog", "sun", "map", "cup", "box", "pen", "hat", "key", "bird", "fish", "tree")
SAMPLE_IMAGE = Path(__file__).resolve().parents[2] / "models" / "ds4v-tiny" / "sample.png"


@dataclass(frozen=True)
class MultiTurnSpec:
    """What a run sends. ``images`` None: decided by probing the server (``probe_vision``)."""

    conversations: int = 4
    turns: int = 8
    system_tokens: int = 400
    user_words: int = 12
    max_tokens: int = 32
    image_every: int = 3  # every image_every-th turn attaches the image; 0: never
    images: bool | None = None
    image_path: Path | None = None
    seed: int = 0
    # off by default: a model that passes EOS under ignore_eos writes an answer no client can send back
    # (the EOS inside it is not text), so the next turn could not reuse that turn's end
    ignore_eos: bool = False


@dataclass(frozen=True)
class Plan:
    """The client side of every conversation, fixed before the first request (shared by the runs of
    a comparison, so both servers get the same text)."""

    system: str
    system_words: int  # seeded words after the fixed lead
    users: list[list[dict]]  # per conversation, the user message of every turn
    images: bool


@dataclass
class TurnRecord:
    conversation: int
    turn: int  # 1-based
    result: Result


@dataclass
class TurnStats:
    turn: int | None  # None: every turn together
    requests: int
    completed: int
    ttft_ms_p50: float
    ttft_ms_mean: float
    prompt_tokens_mean: float
    cached_tokens_mean: float  # an absent cached_tokens counts as 0
    hit_rate: float  # cached / prompt tokens over the completed requests
    errors: dict[str, int] = field(default_factory=dict)


@dataclass
class MultiTurnReport:
    label: str
    base_url: str
    model: str
    conversations: int
    turns: int
    max_tokens: int
    images: bool
    system_words: int
    duration_s: float
    cached_reported: bool  # whether any answer carried usage.prompt_tokens_details.cached_tokens
    per_turn: list[TurnStats]
    total: TurnStats
    answers: list[list[str]]  # per conversation, the assistant turns as streamed


def system_prompt(seed: int, words: int) -> str:
    """The system prompt every conversation shares: a fixed lead then ``words`` seeded words."""
    if words <= 0:
        return SYSTEM_LEAD
    rng = random.Random(f"system-{seed}")
    return f"{SYSTEM_LEAD} House notes: " + " ".join(rng.choice(VOCAB) for _ in range(words)) + "."


def is_image_turn(turn: int, image_every: int) -> bool:
    return image_every > 0 and turn % image_every == 0


def user_message(seed: int, conversation: int, turn: int, user_words: int, image_url: str | None) -> dict:
    """Turn ``turn`` of ``conversation``: seeded filler words then one question (about the image when
    ``image_url`` is given; the image part first, as the README's examples send it)."""
    rng = random.Random(f"user-{seed}-{conversation}-{turn}")
    filler = " ".join(rng.choice(VOCAB) for _ in range(user_words))
    if image_url is not None:
        question = rng.choice(IMAGE_QUESTIONS)
    elif rng.random() < 0.5:
        a, b = rng.randrange(10), rng.randrange(10)
        question = f"What is {a} + {b}?"
    else:
        question = "Reverse the letters: " + " ".join(rng.choice(LETTER_WORDS))
    text = f"{filler}\n{question}" if filler else question
    if image_url is None:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url}},
                                        {"type": "text", "text": text}]}


def plan_conversations(spec: MultiTurnSpec, system_words: int, image_url: str | None) -> Plan:
    """Every conversation's user turns; ``image_url`` None sends text only."""
    users = [[user_message(spec.seed, c, t, spec.user_words,
                           image_url if is_image_turn(t, spec.image_every) else None)
              for t in range(1, spec.turns + 1)] for c in range(spec.conversations)]
    return Plan(system_prompt(spec.seed, system_words), system_words, users, image_url is not None)


def build_messages(system: str, users: list[dict], answers: list[str]) -> list[dict]:
    """What a chat client sends for the turn after ``answers``: the system prompt, then each user
    message followed by the model's answer to it, then the newest user message."""
    if len(users) != len(answers) + 1:
        raise ValueError(f"{len(users)} user turns need {len(users) - 1} answers, got {len(answers)}")
    messages = [{"role": "system", "content": system}]
    for user, answer in zip(users, answers):
        messages += [user, {"role": "assistant", "content": answer}]
    return messages + [users[-1]]


def request_body(model: str, messages: list[dict], max_tokens: int, ignore_eos: bool) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def turn_stats(turn: int | None, records: list[TurnRecord]) -> TurnStats:
    """The figures of one turn index (or of all, ``turn`` None) over the conversations."""
    ok = [r.result for r in records if r.result.ok]
    ttft = [1000 * r.ttft for r in ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    nan = float("nan")
    return TurnStats(turn=turn, requests=len(records), completed=len(ok),
                     ttft_ms_p50=statistics.median(ttft) if ttft else nan,
                     ttft_ms_mean=statistics.fmean(ttft) if ttft else nan,
                     prompt_tokens_mean=prompt / len(ok) if ok else nan,
                     cached_tokens_mean=cached / len(ok) if ok else nan,
                     hit_rate=cached / prompt if prompt else nan,
                     errors=dict(Counter(r.result.error for r in records if not r.result.ok)))


def per_turn(records: list[TurnRecord], turns: int) -> list[TurnStats]:
    return [turn_stats(t, [r for r in records if r.turn == t]) for t in range(1, turns + 1)]


def answers_of(records: list[TurnRecord], conversations: int) -> list[list[str]]:
    out: list[list[str]] = [[] for _ in range(conversations)]
    for r in sorted(records, key=lambda r: (r.conversation, r.turn)):
        if r.result.ok:
            out[r.conversation].append(r.result.text)
    return out


async def run_conversation(client: httpx.AsyncClient, url: str, headers: dict, model: str, plan: Plan,
                           conversation: int, spec: MultiTurnSpec, bar: tqdm | None = None) -> list[TurnRecord]:
    """One conversation, turn after turn; it stops at its first failed turn (there is no answer to
    carry into the next one)."""
    answers: list[str] = []
    records = []
    users = plan.users[conversation]
    # the conversation's id, as a chat client with sessions sends it: vllm-router's consistent_hash
    # policy keys on this header (without one it hashes the whole body, which changes every turn)
    headers = {**headers, "X-Session-ID": f"multiturn-{spec.seed}-{conversation}"}
    for turn in range(1, len(users) + 1):
        body = request_body(model, build_messages(plan.system, users[:turn], answers), spec.max_tokens,
                            spec.ignore_eos)
        result = await one_request(client, url, body, headers, count_reasoning=True)
        records.append(TurnRecord(conversation, turn, result))
        if bar is not None:
            bar.update()
        if not result.ok:
            break
        answers.append(result.text)
    return records


async def run_conversations(base: str, model: str, plan: Plan, spec: MultiTurnSpec, api_key: str | None,
                            progress: bool = False) -> tuple[list[TurnRecord], float]:
    """All conversations at once; (records, wall time)."""
    url = base.rstrip("/") + "/chat/completions"
    headers = _headers(api_key)
    bar = tqdm(total=len(plan.users) * spec.turns, desc="multi-turn", disable=not progress, leave=False)
    limits = httpx.Limits(max_connections=len(plan.users) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter()
        runs = await asyncio.gather(*(run_conversation(client, url, headers, model, plan, c, spec, bar)
                                      for c in range(len(plan.users))))
        duration = time.perf_counter() - t0
    bar.close()
    return [r for run in runs for r in run], duration


def _headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def api_base(url: str) -> str:
    """The ``/v1`` URL of a server given as its root or its ``/v1`` URL."""
    base = url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


def image_data_url(spec: MultiTurnSpec) -> str:
    """The image every image turn attaches: ``spec.image_path``, else the bundled model's sample.png
    (a picture it knows), else (an installed package without it) a seeded generated picture."""
    path = spec.image_path or SAMPLE_IMAGE
    if spec.image_path is None and not path.exists():
        return _image_url(random.Random(spec.seed))
    kind = "jpeg" if path.suffix.lower() in (".jpg", ".jpeg") else path.suffix.lower().lstrip(".") or "png"
    return f"data:image/{kind};base64," + base64.b64encode(path.read_bytes()).decode()


def probe_system_words(root: str, model: str, spec: MultiTurnSpec, headers: dict) -> int:
    """Words of system prompt that make about ``spec.system_tokens`` tokens for this server's
    tokenizer: one ``/tokenize`` call (ds4serve's and vLLM's shape) on a prompt of that many words,
    scaled; one word per token where the server has no such route."""
    target = spec.system_tokens
    if target <= 0:
        return 0
    try:
        r = httpx.post(root + "/tokenize", json={"model": model, "prompt": system_prompt(spec.seed, target)},
                       headers=headers, timeout=60)
        count = int(r.json()["count"]) if r.status_code == 200 else 0
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        count = 0
    return max(1, round(target * target / count)) if count > 0 else target


def probe_vision(root: str, model: str, image_url: str, headers: dict) -> bool:
    """Whether the server takes images, asked without generating (``/tokenize`` with an image part,
    so no cache is warmed): 200 yes, 400/422 no (a text model refuses image parts); a server that
    cannot say gets images (``--no-images`` turns them off)."""
    msg = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url}},
                                       {"type": "text", "text": "?"}]}
    try:
        r = httpx.post(root + "/tokenize", json={"model": model, "messages": [msg]}, headers=headers, timeout=60)
    except httpx.HTTPError:
        return True
    if r.status_code in (400, 422):
        print(f"images off: the server refused an image part ({r.text[:200]})")
        return False
    return True


def first_model(base: str, headers: dict) -> str:
    return httpx.get(base + "/models", headers=headers, timeout=30).json()["data"][0]["id"]


def prepare(base_url: str, model: str | None, spec: MultiTurnSpec, api_key: str | None) -> Plan:
    """The plan of a run, sized against the first server (the conversations of a comparison are
    planned once so both servers get the same text)."""
    base, headers = api_base(base_url), _headers(api_key)
    root = base[: -len("/v1")]
    model = model or first_model(base, headers)
    url = image_data_url(spec)
    images = spec.images if spec.images is not None else probe_vision(root, model, url, headers)
    images = images and spec.image_every > 0
    return plan_conversations(spec, probe_system_words(root, model, spec, headers), url if images else None)


def run_target(label: str, base_url: str, model: str | None, plan: Plan, spec: MultiTurnSpec,
               api_key: str | None, progress: bool = True) -> MultiTurnReport:
    """The plan's conversations against one server."""
    base = api_base(base_url)
    model = model or first_model(base, _headers(api_key))
    records, duration = asyncio.run(run_conversations(base, model, plan, spec, api_key, progress))
    oks = [r.result for r in records if r.result.ok]
    return MultiTurnReport(label=label, base_url=base, model=model, conversations=len(plan.users),
                           turns=spec.turns, max_tokens=spec.max_tokens, images=plan.images,
                           system_words=plan.system_words,
                           duration_s=duration, cached_reported=any(r.cached_tokens is not None for r in oks),
                           per_turn=per_turn(records, spec.turns), total=turn_stats(None, records),
                           answers=answers_of(records, len(plan.users)))


@dataclass
class Comparison:
    """Cache on against cache off on the same conversations; ratios are off / on (above 1: the
    cache made the first token come sooner)."""

    turn: int  # the last turn, where a conversation is longest
    ttft_ms_p50_on: float
    ttft_ms_p50_off: float
    ratio_p50: float
    ttft_ms_mean_on: float
    ttft_ms_mean_off: float
    ratio_mean: float
    per_turn: list[dict]  # turn, p50 on / off, ratio
    prompt_tokens_equal: bool  # both servers counted the same prompts at every turn
    answers_identical: bool  # greedy answers equal turn for turn (an exact cache changes nothing)


def _ratio(off: float, on: float) -> float:
    return off / on if on > 0 else float("nan")


def compare(on: MultiTurnReport, off: MultiTurnReport) -> Comparison:
    last_on, last_off = on.per_turn[-1], off.per_turn[-1]
    rows = [{"turn": a.turn, "ttft_ms_p50_on": a.ttft_ms_p50, "ttft_ms_p50_off": b.ttft_ms_p50,
             "ratio_p50": _ratio(b.ttft_ms_p50, a.ttft_ms_p50)} for a, b in zip(on.per_turn, off.per_turn)]
    return Comparison(turn=last_on.turn or on.turns, ttft_ms_p50_on=last_on.ttft_ms_p50,
                      ttft_ms_p50_off=last_off.ttft_ms_p50, ratio_p50=_ratio(last_off.ttft_ms_p50, last_on.ttft_ms_p50),
                      ttft_ms_mean_on=last_on.ttft_ms_mean, ttft_ms_mean_off=last_off.ttft_ms_mean,
                      ratio_mean=_ratio(last_off.ttft_ms_mean, last_on.ttft_ms_mean), per_turn=rows,
                      prompt_tokens_equal=[a.prompt_tokens_mean for a in on.per_turn]
                      == [b.prompt_tokens_mean for b in off.per_turn],
                      answers_identical=on.answers == off.answers)


def markdown(report: MultiTurnReport) -> str:
    rows = ["| turn | req | ok | TTFT p50 ms | TTFT mean ms | prompt tok mean | cached tok mean | hit rate | errors |",
            "|" + "---|" * 9]
    for s in [*report.per_turn, report.total]:
        rows.append(f"| {s.turn or 'all'} | {s.requests} | {s.completed} | {s.ttft_ms_p50:.0f} | "
                    f"{s.ttft_ms_mean:.0f} | {s.prompt_tokens_mean:.1f} | {s.cached_tokens_mean:.1f} | "
                    f"{s.hit_rate:.1%} | {s.errors or '-'} |")
    return "\n".join(rows)


def markdown_comparison(cmp: Comparison) -> str:
    yes = {True: "yes", False: "no"}
    rows = ["| turn | TTFT p50 ms cache on | TTFT p50 ms cache off | off / on |", "|---|---|---|---|"]
    rows += [f"| {r['turn']} | {r['ttft_ms_p50_on']:.0f} | {r['ttft_ms_p50_off']:.0f} | {r['ratio_p50']:.2f}x |"
             for r in cmp.per_turn]
    rows.append(f"\nturn {cmp.turn}: TTFT p50 {cmp.ttft_ms_p50_on:.0f} ms with the cache, "
                f"{cmp.ttft_ms_p50_off:.0f} ms without ({cmp.ratio_p50:.2f}x; mean {cmp.ratio_mean:.2f}x); "
                f"same prompts: {yes[cmp.prompt_tokens_equal]}; same answers: {yes[cmp.answers_identical]}")
    return "\n".join(rows)


Target = tuple[str, Callable[[], AbstractContextManager[str]]]  # a label and what yields the server's URL


def url_target(label: str, url: str) -> Target:
    return label, lambda: contextlib.nullcontext(url)


def run(targets: list[Target], spec: MultiTurnSpec, model: str | None, out_dir: Path,
        api_key: str | None = None, progress: bool = True) -> tuple[list[MultiTurnReport], Comparison | None]:
    """Each target in turn (a launched server lives only for its own run), the first two compared
    when there are two; writes ``bench_multiturn.json`` and ``.md`` into ``out_dir`` and prints the
    tables."""
    plan, reports = None, []
    for label, open_target in targets:
        with open_target() as base_url:
            plan = plan or prepare(base_url, model, spec, api_key)
            reports.append(run_target(label, base_url, model, plan, spec, api_key, progress))
    cmp = compare(reports[0], reports[1]) if len(reports) == 2 else None
    tables = [f"## {r.label}: {r.model} at {r.base_url}, {r.conversations} conversations x {r.turns} turns, "
              f"{r.system_words}-word system prompt, images {'on' if r.images else 'off'}, max_tokens {r.max_tokens}"
              f"{'' if r.cached_reported else ' (the server reports no cached_tokens)'}\n\n{markdown(r)}"
              for r in reports]
    if cmp is not None:
        tables.append("## cache on vs off\n\n" + markdown_comparison(cmp))
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {"runs": [asdict(r) for r in reports], "comparison": asdict(cmp) if cmp else None}
    (out_dir / "bench_multiturn.json").write_text(json.dumps(doc, indent=1))
    (out_dir / "bench_multiturn.md").write_text("\n\n".join(tables) + "\n")
    print("\n\n".join(tables))
    print(f"wrote {out_dir / 'bench_multiturn.json'} and .md")
    return reports, cmp
