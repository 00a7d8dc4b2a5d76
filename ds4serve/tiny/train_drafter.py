"""``ds4serve tiny train-drafter``: a DSpark drafter for the bundled tiny model, by self-distillation.

Why this exists: the DSpark path (``model/dspark.py``, the engine's capture and verification) only
shows a speed-up with a drafter that agrees with its target, and the real ones ship only with the
large checkpoints. This trains one for ``models/ds4v-tiny`` in the release layout (``mtp.<s>.*``
names, ``dspark_*`` config keys), scaled down, on CPU in minutes.

Recipe (spec ds4-speculative §3.8, §4):

* **Data**: sequences the frozen target itself writes, greedy and sampled (T = 1), from two prompt
  families: the text tasks of ``tiny/data.py`` (math, reversal) through the chat template, and the
  shape ``ds4serve bench spec`` decodes (a seeded random phrase repeated, continued with ignore_eos;
  other seeds than the bench's). Generation runs through the engine (``LLM``).
* **Labels**: one teacher-forced torch pass of the target per sequence gives, at every position, the
  HC-mean outputs of the target layers (what the engine captures, ``capture.py``) and the target's
  distribution ``p`` of the next token.
* **Examples**: an anchor at position ``a`` (the token the target committed there); the ring holds the
  captured rows of positions ``a - window .. a - 1``; the block ``[anchor, noise x (B-1)]`` at
  ``a .. a+B-1``; slot ``k`` is scored against ``p`` at row ``a + k`` (it predicts ``a + k + 1``). The
  Markov head's predecessor is teacher-forced: the target's own token at ``a + k`` (the draft a
  greedy verifier accepts is exactly that token, so this is the state drafting is in while it is right).
* **Loss** per slot ``k`` (1-based), weight ``exp(-(k-1)/4)``: ``0.1 CE(p, q) + 0.9 TV(p, q)`` with
  ``TV = 1/2 |q - p|_1``, plus ``BCE(confidence, 1 - TV)`` (the analytic acceptance, detached). The
  target, its embedding and its head are frozen (the drafter shares them).

The stages run through ``dspark.stage_block``, the very function the engine drafts with, so a trained
tensor means the same thing in training and serving. Everything is seeded; with ``time_limit_s`` the
step count (and so the result) depends on the machine's speed.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from ..cache import ModelState, SeqChunk, StateLayout, build_view
from ..chat import Tokenizer, render_chat
from ..config import ModelConfig
from ..model.dspark import SharedHead, capture_mean, stage_block
from ..model.dspark_weights import DSparkConfig
from ..model.loader import load_model
from ..model.mhc import hc_head
from ..model.norms import rms_norm
from ..model.rope import apply_rope, inverse_frequencies, rotations
from .data import examples, messages

NOISE_TOKEN = 7  # <｜pad｜>: never produced by the target, so a noise slot is never mistaken for text
TEXT_TASKS = ("math", "reverse")
FILES_TO_LINK = ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@dataclass
class DrafterSettings:
    """Defaults: one stage (the drafter's eager forward costs more than the tiny target's whole step,
    so every stage counts), block 5, the last three of four layers captured, 2 small experts (top 1),
    Markov rank 32; half the sequences greedy, half sampled at T = 1."""

    model: Path
    out: Path
    steps: int = 5000
    batch: int = 64
    lr: float = 3e-3
    seed: int = 0
    time_limit_s: float | None = None
    stages: int = 1
    block: int = 5
    target_layers: tuple[int, ...] = (1, 2, 3)
    markov_rank: int = 32
    experts: int = 2
    active_experts: int = 1
    bench_prompts: int = 192
    task_prompts: int = 64
    new_tokens: int = 128
    held_out: int = 256
    log_every: int = 100


@dataclass
class Corpus:
    """Every sequence's rows, flat: ``tokens [N]``, ``captured [N, L*D]``, ``probs [N, V]``; per
    sequence ``(offset, length, first generated position)``."""

    tokens: torch.Tensor
    captured: torch.Tensor
    probs: torch.Tensor
    spans: list[tuple[int, int, int]] = field(default_factory=list)


def drafter_config(s: DrafterSettings) -> dict:
    """The ``dspark_*`` keys this drafter needs in config.json (spec §1)."""
    return {"dspark_block_size": s.block, "dspark_noise_token_id": NOISE_TOKEN,
            "dspark_target_layer_ids": list(s.target_layers), "dspark_markov_rank": s.markov_rank,
            "dspark_n_routed_experts": s.experts, "dspark_n_activated_experts": s.active_experts}


def dspark_config(model: Path, s: DrafterSettings) -> DSparkConfig:
    return DSparkConfig(ModelConfig.from_file(model), s.stages, s.block, NOISE_TOKEN, tuple(s.target_layers),
                        s.markov_rank, s.experts, s.active_experts)


# ---- data ---------------------------------------------------------------------------------------

def bench_shape_prompts(n: int, vocab: int, seed: int, length: int = 240) -> list[list[int]]:
    """Prompts shaped like ``bench spec``'s: a random phrase (ids >= 100) repeated to ``length``. The
    phrase length varies around the bench's 60 so the drafter learns to copy, not one offset."""
    out = []
    for i in range(n):
        rnd = random.Random(seed * 7919 + i)
        phrase = rnd.choice((60, 60, 40, 50, 56))
        words = [rnd.randrange(100, vocab) for _ in range(phrase)]
        out.append((words * (length // phrase + 1))[:length])
    return out


def task_prompts(model: Path, n: int, seed: int) -> list[list[int]]:
    tok = Tokenizer(model)
    return [render_chat(tok, messages(ex)).ids for ex in examples(seed, n, TEXT_TASKS)]


def generate_sequences(model: Path, s: DrafterSettings, seed: int) -> list[tuple[list[int], int]]:
    """``(prompt + continuation, prompt length)``: every prompt continued greedily and sampled (T = 1)."""
    from ..llm import LLM  # the engine, only to write the data

    cfg = ModelConfig.from_file(model)
    prompts = bench_shape_prompts(s.bench_prompts, cfg.vocab_size, seed) + task_prompts(model, s.task_prompts, seed)
    llm = LLM(model, max_seqs=32, max_model_len=512)
    out = []
    for temperature in (0.0, 1.0):
        gens = llm.generate(prompts, max_tokens=s.new_tokens, temperature=temperature, seed=seed, ignore_eos=True)
        out += [(list(p) + list(g), len(p)) for p, g in zip(prompts, gens)]
    return out


@torch.no_grad()
def teacher_pass(lm, cfg: ModelConfig, seqs: list[list[int]], layers: tuple[int, ...]):
    """One torch forward of ``seqs``: per sequence the captured rows ``[T, L*D]`` (HC-mean outputs of
    ``layers``, ``capture_mean``) and the target's next-token distribution ``[T, V]``."""
    layout = StateLayout.build(cfg, torch.float32)
    n, pages = len(seqs), layout.pages_for(max(len(q) for q in seqs))
    state = ModelState(layout, n_slots=n, n_pages=n * pages, device="cpu")
    chunks = [SeqChunk(i, 0, q, list(range(i * pages, (i + 1) * pages))) for i, q in enumerate(seqs)]
    view = build_view(layout, n, chunks, torch.device("cpu"))
    rope = lm.rope_tables(view)
    streams, cursor, caps = lm.embed(view), 0, []
    for layer in layers:
        streams = lm.forward_layers(streams, view, state.layers, cursor, layer + 1, rope)
        caps.append(capture_mean(streams))
        cursor = layer + 1
    streams = lm.forward_layers(streams, view, state.layers, cursor, None, rope)
    probs = torch.softmax(lm.logits(streams), dim=-1)
    return torch.cat(caps, dim=1), probs


def build_corpus(lm, cfg: ModelConfig, seqs: list[tuple[list[int], int]], layers: tuple[int, ...]) -> Corpus:
    toks, caps, probs, spans, off = [], [], [], [], 0
    for i in range(0, len(seqs), 8):
        part = seqs[i:i + 8]
        cap, prob = teacher_pass(lm, cfg, [q for q, _ in part], layers)
        toks += [torch.tensor(q) for q, _ in part]
        caps.append(cap)
        probs.append(prob)
        for q, n_prompt in part:
            spans.append((off, len(q), n_prompt))
            off += len(q)
    return Corpus(torch.cat(toks), torch.cat(caps), torch.cat(probs), spans)


# ---- the drafter's parameters and forward --------------------------------------------------------

def init_params(dc: DSparkConfig, seed: int) -> list[dict[str, torch.Tensor]]:
    """Fresh stage tensors (stacked experts, as ``load_dspark`` hands them to the forward)."""
    from ..model.dspark_weights import expected_stage_tensors

    gen = torch.Generator().manual_seed(seed)
    stages = []
    for s in range(dc.n_stages):
        st = {}
        for suffix, (shape, _) in expected_stage_tensors(dc, s).items():
            if ".experts." in suffix and "shared" not in suffix:
                continue
            st[suffix] = _init_value(suffix, shape, gen)
        c = dc.trunk
        i, d, e = c.moe_intermediate_size, c.hidden_size, dc.n_routed_experts
        st["experts.gate_up"] = torch.randn(e, 2 * i, d, generator=gen) * d**-0.5
        st["experts.down"] = torch.randn(e, d, i, generator=gen) * i**-0.5
        stages.append({k: v.requires_grad_(True) for k, v in st.items()})
    return stages


def _init_value(suffix: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if suffix.endswith("norm.weight") or suffix.endswith("_scale"):
        return torch.ones(shape)
    if suffix.endswith(("_base", "attn_sink", "gate.bias")) or suffix in (
            "markov_head.markov_w2.weight", "confidence_head.proj.weight"):
        return torch.zeros(shape)
    if suffix.endswith("_fn"):
        return torch.randn(shape, generator=gen) * 0.02
    if suffix == "markov_head.markov_w1.weight":
        return torch.randn(shape, generator=gen)
    return torch.randn(shape, generator=gen) * shape[-1] ** -0.5


@dataclass
class Batch:
    ring: torch.Tensor  # [R, W, L*D] captured rows of positions a-W .. a-1
    ring_pos: torch.Tensor  # [R, W]
    ids: torch.Tensor  # [R, B] anchor then noise
    pos: torch.Tensor  # [R, B] a .. a+B-1
    prev: torch.Tensor  # [R, B] the target's tokens at a .. a+B-1 (the Markov predecessors)
    p: torch.Tensor  # [R, B, V] the target's distribution at rows a .. a+B-1


def sample_batch(corpus: Corpus, picks: list[tuple[int, int]], dc: DSparkConfig) -> Batch:
    """Examples at ``picks`` = (sequence, anchor position)."""
    w, b = dc.window, dc.block_size
    start = torch.tensor([corpus.spans[si][0] for si, _ in picks])
    a = torch.tensor([ai for _, ai in picks])
    ring_pos = a.unsqueeze(1) - w + torch.arange(w)
    ring = corpus.captured.index_select(0, (start.unsqueeze(1) + ring_pos.clamp(min=0)).reshape(-1))
    rows = (start + a).unsqueeze(1) + torch.arange(b)
    ids = torch.full((len(picks), b), dc.noise_token_id, dtype=torch.long)
    ids[:, 0] = corpus.tokens.index_select(0, start + a)
    return Batch(ring.view(len(picks), w, -1), ring_pos, ids, a.unsqueeze(1) + torch.arange(b),
                 corpus.tokens[rows], corpus.probs[rows.reshape(-1)].view(len(picks), b, -1))


def forward(params: list[dict[str, torch.Tensor]], dc: DSparkConfig, head: SharedHead, batch: Batch):
    """Teacher-forced drafter logits ``[R, B, V]`` and confidence logits ``[R, B]`` (``dspark.draft``
    with the ring built from ``batch.ring`` and the Markov predecessors given)."""
    c, st0, last = dc.trunk, params[0], params[-1]
    n_req, w, b = batch.ring.shape[0], dc.window, dc.block_size
    freqs = inverse_frequencies(c.rope_main, c.rope_dim)
    main_x = rms_norm(F.linear(batch.ring, st0["main_proj.weight"]), st0["main_norm.weight"], c.rms_norm_eps)
    ring_rot = rotations(batch.ring_pos.clamp(min=0).reshape(-1), freqs)
    rot = rotations(batch.pos.reshape(-1), freqs)
    valid = batch.ring_pos >= 0
    streams = head.embed(batch.ids.reshape(-1)).unsqueeze(1).expand(-1, c.hc_mult, -1).contiguous()
    for st in params:
        kv = rms_norm(F.linear(main_x, st["attn.wkv.weight"]), st["attn.kv_norm.weight"], c.rms_norm_eps)
        kv = apply_rope(kv.reshape(n_req * w, -1), ring_rot).view(n_req, w, -1)
        streams = stage_block(dc, st, streams, kv, valid, rot, batch.ids.reshape(-1))
    h = hc_head(streams, last["hc_head_fn"], last["hc_head_base"], last["hc_head_scale"], c.hc_eps, c.rms_norm_eps)
    base = head.lm_head(rms_norm(h, last["norm.weight"], c.rms_norm_eps)).float().view(n_req, b, -1)
    m = last["markov_head.markov_w1.weight"][batch.prev]  # [R, B, r]
    logits = base + F.linear(m, last["markov_head.markov_w2.weight"])
    conf = F.linear(torch.cat((h.view(n_req, b, -1), m), dim=-1), last["confidence_head.proj.weight"])[..., 0]
    return logits, conf


def loss_terms(logits: torch.Tensor, conf: torch.Tensor, p: torch.Tensor) -> dict[str, torch.Tensor]:
    """Spec §3.8: per slot 0.1 CE + 0.9 TV + 1.0 BCE(confidence, 1 - TV), slot k weighted exp(-(k-1)/4)."""
    logq = torch.log_softmax(logits, dim=-1)
    tv = 0.5 * (logq.exp() - p).abs().sum(dim=-1)  # [R, B]
    ce = -(p * logq).sum(dim=-1)
    bce = F.binary_cross_entropy_with_logits(conf, (1.0 - tv).detach(), reduction="none")
    k = torch.arange(logits.shape[1], dtype=torch.float32)
    wk = torch.exp(-k / 4.0)
    wk = wk / wk.sum()
    per = ((0.1 * ce + 0.9 * tv + bce) * wk).sum(dim=1)
    return {"loss": per.mean(), "tv": tv.mean().detach(), "ce": ce.mean().detach(), "bce": bce.mean().detach()}


def greedy_acceptance(logits: torch.Tensor, p: torch.Tensor) -> float:
    """Mean tokens a greedy verifier commits per block (accepted drafts + its own token): with the
    Markov predecessors teacher-forced, slot k is accepted when every slot <= k has the target's argmax."""
    hit = (logits.argmax(-1) == p.argmax(-1)).long().cumprod(dim=1)
    return 1.0 + float(hit.sum(dim=1).float().mean())


# ---- training ----------------------------------------------------------------------------------

def anchor_picks(corpus: Corpus, seqs: list[int], n: int, block: int, rng: random.Random) -> list[tuple[int, int]]:
    """``n`` (sequence, anchor) pairs: three in four among the generated tokens (where decoding drafts),
    the rest inside the prompt (the first block after prefill, prompts that repeat themselves)."""
    out = []
    for _ in range(n):
        si = rng.choice(seqs)
        _, length, n_prompt = corpus.spans[si]
        lo = n_prompt if rng.random() < 0.75 else 1
        out.append((si, rng.randint(lo, length - block)))
    return out


def fit(params, dc: DSparkConfig, head: SharedHead, corpus: Corpus, s: DrafterSettings, train_seqs: list[int],
        t_start: float) -> dict:
    """AdamW with a short warm-up and a cosine decay over ``s.steps``; stops early at the time limit."""
    flat = [t for st in params for t in st.values()]
    opt = torch.optim.AdamW(flat, lr=s.lr, weight_decay=0.0)
    rng = random.Random(s.seed + 1)
    warm = max(1, s.steps // 50)
    history, step = [], 0
    for step in range(1, s.steps + 1):
        if s.time_limit_s is not None and time.perf_counter() - t_start > s.time_limit_s:
            step -= 1
            break
        lr = s.lr * min(1.0, step / warm) * 0.5 * (1 + math.cos(math.pi * step / s.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        batch = sample_batch(corpus, anchor_picks(corpus, train_seqs, s.batch, dc.block_size, rng), dc)
        terms = loss_terms(*forward(params, dc, head, batch), batch.p)
        opt.zero_grad(set_to_none=True)
        terms["loss"].backward()
        torch.nn.utils.clip_grad_norm_(flat, 1.0)
        opt.step()
        history.append(float(terms["loss"].detach()))
        if s.log_every and step % s.log_every == 0:
            print(f"step {step}: loss {sum(history[-s.log_every:]) / s.log_every:.4f} tv {float(terms['tv']):.3f} "
                  f"({time.perf_counter() - t_start:.0f} s)", flush=True)
    return {"steps": step, "losses": history}


@torch.no_grad()
def evaluate(params, dc: DSparkConfig, head: SharedHead, corpus: Corpus, seqs: list[int], n: int, seed: int) -> dict:
    """Teacher-forced greedy acceptance length and TV on held-out sequences' generated tokens."""
    rng = random.Random(seed + 2)
    picks = []
    for _ in range(n):
        si = rng.choice(seqs)
        _, length, n_prompt = corpus.spans[si]
        picks.append((si, rng.randint(n_prompt, length - dc.block_size)))
    batch = sample_batch(corpus, picks, dc)
    logits, conf = forward(params, dc, head, batch)
    terms = loss_terms(logits, conf, batch.p)
    return {"acceptance_length": greedy_acceptance(logits, batch.p), "tv": float(terms["tv"]),
            "loss": float(terms["loss"])}


def release_tensors(params, dc: DSparkConfig) -> dict[str, torch.Tensor]:
    """The stage tensors under their release names (``mtp.<s>.<suffix>``, experts one by one), fp32."""
    out = {}
    inter = dc.trunk.moe_intermediate_size
    for s, st in enumerate(params):
        for suffix, t in st.items():
            t = t.detach().float().contiguous()
            if suffix == "experts.gate_up":
                for e in range(t.shape[0]):
                    out[f"mtp.{s}.ffn.experts.{e}.w1.weight"] = t[e, :inter].contiguous()
                    out[f"mtp.{s}.ffn.experts.{e}.w3.weight"] = t[e, inter:].contiguous()
            elif suffix == "experts.down":
                for e in range(t.shape[0]):
                    out[f"mtp.{s}.ffn.experts.{e}.w2.weight"] = t[e].contiguous()
            else:
                out[f"mtp.{s}.{suffix}"] = t
    return out


def write_drafter(out: Path, model: Path, params, dc: DSparkConfig, s: DrafterSettings, summary: dict) -> Path:
    """``out/drafter.safetensors`` and ``out/config.json`` = the model's plus the ``dspark_*`` keys.
    When ``out`` is not the model folder, the model's own files are linked in, so ``out`` is a whole
    checkpoint (the engine reads every ``*.safetensors`` of a folder without an index)."""
    out.mkdir(parents=True, exist_ok=True)
    if out.resolve() != model.resolve():
        for name in FILES_TO_LINK:
            if (model / name).exists() and not (out / name).exists():
                (out / name).symlink_to((model / name).resolve())
    save_file(release_tensors(params, dc), str(out / "drafter.safetensors"))
    raw = json.loads((model / "config.json").read_text())
    raw |= drafter_config(s)
    (out / "config.json").write_text(json.dumps(raw, indent=1))
    (out / "drafter_training.json").write_text(json.dumps(summary, indent=1))
    return out


def train_drafter(s: DrafterSettings) -> dict:
    """Data from the target, then the drafter; returns the summary written beside it."""
    torch.manual_seed(s.seed)
    t_start = time.perf_counter()
    dc = dspark_config(s.model, s)
    cfg, lm = load_model(s.model, vision=False, progress=False)
    for p in lm.parameters():
        p.requires_grad_(False)
    seqs = generate_sequences(s.model, s, s.seed + 100)
    corpus = build_corpus(lm, cfg, seqs, tuple(s.target_layers))
    held = [i for i in range(len(seqs)) if i % 8 == 7]
    train_seqs = [i for i in range(len(seqs)) if i % 8 != 7]
    t_data = time.perf_counter() - t_start
    print(f"{len(seqs)} sequences, {corpus.tokens.shape[0]} positions in {t_data:.0f} s", flush=True)
    head = SharedHead.from_target(lm)
    params = init_params(dc, s.seed)
    before = evaluate(params, dc, head, corpus, held, s.held_out, s.seed)
    run = fit(params, dc, head, corpus, s, train_seqs, t_start)
    after = evaluate(params, dc, head, corpus, held, s.held_out, s.seed)
    summary = {"steps": run["steps"], "elapsed_s": time.perf_counter() - t_start, "data_s": t_data,
               "sequences": len(seqs), "held_out_before": before, "held_out_after": after,
               "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(s).items()},
               "final_loss": sum(run["losses"][-50:]) / max(1, len(run["losses"][-50:]))}
    write_drafter(s.out, s.model, params, dc, s, summary)
    print(f"held-out greedy acceptance length {before['acceptance_length']:.2f} -> {after['acceptance_length']:.2f} "
          f"(tv {before['tv']:.3f} -> {after['tv']:.3f}); wrote {s.out / 'drafter.safetensors'}", flush=True)
    return summary
