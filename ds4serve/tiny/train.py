"""``ds4serve tiny train``: train the bundled tiny DS4V model with ds4serve's own model code, on CPU.

The network is the engine's ``DS4ForCausalLM`` + ``VisionEncoder`` (the same modules that serve it),
run on flattened batches through the same ``BatchView`` machinery, with a fresh per-batch state.
Images are drawn, resized and patchified exactly as the server does (``plan_resize`` +
``preprocess``) and expanded into image blocks at their absolute positions, so training and serving
see identical inputs. The loss is cross-entropy on the answer tokens (and EOS) only.

Everything is seeded (weights, data order, tokenizer corpus); ``--threads`` fixes the CPU threads.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from ..cache import ModelState, SeqChunk, StateLayout, build_view
from ..chat import Tokenizer, render_chat
from ..config import ModelConfig
from ..model.decoder import DS4ForCausalLM
from ..model.loader import expected_tensors
from ..model.rope import inverse_frequencies
from ..model.vision import VisionEncoder, expected_vision_tensors
from ..multimodal.layout import image_block
from ..multimodal.records import ImageRows, ImageSpan
from ..multimodal.resize import plan_resize, preprocess
from .data import SIZE, TASKS, TRAIN_TASKS, Example, examples, messages
from .freehand import EASY, FULL, IMAGE_TASKS, free_examples
from .tokenizer_train import train_tokenizer
from .vision_pretrain import pretrain_vision, pretrain_vision_free

log = logging.getLogger(__name__)

TRAIN_SEED, EVAL_SEED, TOKENIZER_SEED = 1, 2, 1234


# HCA at ratio 8, not Flash's 128: the tiny model's prompts are ~100-300 tokens, where ratio 128 would
# emit no compressed row at all and leave the HCA layer untrained. The layers are written the way
# transformers' own DeepseekV4Config states them (``layer_types`` + ``compress_rates``), which takes any
# rate; the official ``compress_ratios`` list would be read as the legacy form, accepting only 0, 4, 128.
LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
               "compressed_sparse_attention"]
COMPRESS_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}

# what AutoTokenizer (and so guidellm's --processor, vLLM, ...) needs besides tokenizer.json
TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<｜begin▁of▁sentence｜>",
    "eos_token": "<｜end▁of▁sentence｜>", "pad_token": "<｜pad｜>", "add_bos_token": True, "add_eos_token": False,
    "clean_up_tokenization_spaces": False, "model_max_length": 2048,
}


def model_config(vocab_size: int) -> dict:
    """A few-million-parameter DS4V: SWA, CSA and HCA layers, hash + routed MoE, a small ViT."""
    return {
        "model_type": "deepseek_v4", "vocab_size": vocab_size, "hidden_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "qk_rope_head_dim": 16,
        "q_lora_rank": 96, "o_groups": 2, "o_lora_rank": 64, "sliding_window": 64,
        "layer_types": LAYER_TYPES, "compress_rates": COMPRESS_RATES, "num_hash_layers": 1,
        "compress_rope_theta": 40000.0,
        "rope_theta": 10000.0, "max_position_embeddings": 2048, "index_n_heads": 4, "index_head_dim": 16,
        "index_topk": 8, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "moe_intermediate_size": 192, "routed_scaling_factor": 1.0, "swiglu_limit": 10.0, "hc_mult": 2,
        "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "bos_token_id": 0, "eos_token_id": 1,
        "image_token_id": 6,
        "vision_n_layers": 2, "vision_dim": 96, "vision_n_heads": 4, "vision_inter_dim": 192,
        "vision_patch_size": 14, "vision_rope_theta": 10000.0, "vision_downsample_ratio": 3,
        "vision_max_n_token": 32, "vision_min_pixels": SIZE * SIZE, "vision_max_wh_ratio": 8,
        "ds4serve_checkpoint": "ds4v-tiny",
    }


@dataclass
class TrainSettings:
    out: Path
    steps: int = 6000
    batch: int = 48
    vision_steps: int = 400  # stage 0: pretrain the vision tower on per-cell labels
    lr: float = 1e-3  # 3e-3 learns counting and sums but never the look-up-a-row-by-shape questions
    warmup: int = 150
    seed: int = 0
    time_limit_s: float | None = None
    init: Path | None = None  # continue from this ds4serve tiny checkpoint: stage 2 only
    robust_steps: int = 1300  # stage 2b: free-hand pictures and reworded questions
    robust_lr: float = 5e-4
    easy_vision_steps: int = 1000  # stage 2a, first part: large shapes near their cells' middles
    free_vision_steps: int = 4000  # stage 2a: the tower learns free-hand pictures from dense labels
    free_share: float = 0.8  # of stage 2's pictures drawn free hand (the rest by the original renderer)
    held_per_task: int = 24  # teacher-forced held-out questions per task and set, checked every ``eval_every``
    log_every: int = 50
    eval_every: int = 500


# ---- data -> tensors ---------------------------------------------------------------------------

@dataclass
class Sample:
    ids: list[int]
    n_prompt: int
    patches: list[torch.Tensor]
    blocks: list
    grids: list[tuple[int, int]]  # (vit_h, vit_w) per image


class Encoder:
    """Example -> token ids with image blocks + patches, exactly as the server prepares them (each
    picture sized by ``plan_resize`` from its own width and height)."""

    def __init__(self, tok: Tokenizer, cfg: ModelConfig):
        self.tok, self.cfg = tok, cfg
        self.geom = self.geometry(SIZE, SIZE)  # the original renderer's pictures

    def geometry(self, width: int, height: int):
        v = self.cfg.vision
        return plan_resize(width, height, patch=v.patch_size, min_pixels=v.min_pixels, max_n_token=v.max_n_token,
                           max_wh_ratio=v.max_wh_ratio, downsample=v.downsample_ratio)

    def prompt(self, ex: Example) -> tuple[list[int], list[torch.Tensor], list, list[tuple[int, int]]]:
        rendered = render_chat(self.tok, messages(ex, ["x"] * len(ex.images)))
        pictures = ex.render_images()
        geoms = [self.geometry(*im.size) for im in pictures]
        out, blocks, cursor = [], [], 0
        for pos, geom in zip(rendered.image_positions, geoms, strict=True):
            out += rendered.ids[cursor:pos]
            blk = image_block(geom.llm_h, geom.llm_w, len(out))
            out += [self.cfg.vocab_size + int(t) for t in blk.types]
            blocks.append(blk)
            cursor = pos + 1
        out += rendered.ids[cursor:]
        patches = [preprocess(im, g, self.cfg.vision.patch_size) for im, g in zip(pictures, geoms)]
        return out, patches, blocks, [(g.vit_h, g.vit_w) for g in geoms]

    def sample(self, ex: Example) -> Sample:
        ids, patches, blocks, grids = self.prompt(ex)
        answer = self.tok.encode_text(ex.answer) + [self.tok.eos_id]
        return Sample(ids + answer, len(ids), patches, blocks, grids)


def encode_images(enc: VisionEncoder, batch: list[Sample]) -> list[torch.Tensor]:
    """Aligner rows of every picture in the batch (in order), one tower pass per distinct grid."""
    flat = [(p, grid) for s in batch for p, grid in zip(s.patches, s.grids)]
    out: list[torch.Tensor | None] = [None] * len(flat)
    by_grid: dict[tuple[int, int], list[int]] = {}
    for i, (_, grid) in enumerate(flat):
        by_grid.setdefault(grid, []).append(i)
    for (vit_h, vit_w), idx in by_grid.items():
        rows = enc.encode_same_grid(torch.stack([flat[i][0] for i in idx]), vit_h, vit_w)
        for j, i in enumerate(idx):
            out[i] = rows[j]
    return out  # type: ignore[return-value]


# ---- model ------------------------------------------------------------------------------------------

def init_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dtype) in sorted((expected_tensors(cfg) | expected_vision_tensors(cfg)).items()):
        if name.endswith("tid2eid"):
            t = torch.stack([torch.randperm(cfg.n_routed_experts, generator=gen)[: shape[1]] for _ in range(shape[0])])
        elif name.endswith(("norm.weight", "layernorm.weight", ".scale", "hc_scale")):
            t = torch.ones(shape)
        elif name.endswith(("bias", ".base", "hc_base", "sinks", "position_bias", "bias_vl")):
            t = torch.zeros(shape)
        else:
            fan_in = shape[-1] if len(shape) > 1 else 1
            std = 0.02 if name.endswith(("embed_tokens.weight", "image_start", "image_pad", "image_newline",
                                         "image_end", ".fn", "hc_fn")) else fan_in**-0.5
            t = torch.randn(shape, generator=gen) * std
        out[name] = t.to(torch.long if not dtype.is_floating_point else torch.float32)
    return out


def build(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> tuple[DS4ForCausalLM, VisionEncoder]:
    lm = DS4ForCausalLM(cfg)
    lm.load_state_dict({k: v for k, v in weights.items() if not k.startswith(("vision.", "aligner."))}, strict=True)
    lm.inv_freq_main = inverse_frequencies(cfg.rope_main, cfg.rope_dim)
    lm.inv_freq_compress = inverse_frequencies(cfg.rope_compress, cfg.rope_dim)
    enc = VisionEncoder(cfg)
    enc.load_state_dict({k: v for k, v in weights.items() if k.startswith(("vision.", "aligner."))}, strict=True)
    for p in list(lm.parameters()) + list(enc.parameters()):
        p.requires_grad_(p.is_floating_point())
    return lm, enc


def forward_loss(lm: DS4ForCausalLM, enc: VisionEncoder, cfg: ModelConfig, layout: StateLayout,
                 batch: list[Sample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean answer-token loss, per-token argmax hits and a per-sample all-correct mask."""
    n = len(batch)
    longest = max(len(s.ids) for s in batch)
    pages = layout.pages_for(longest)
    state = ModelState(layout, n_slots=n, n_pages=n * pages, device="cpu")
    rows = encode_images(enc, batch)
    chunks, k = [], 0
    for i, s in enumerate(batch):
        image_rows, spans = [], []
        for blk in s.blocks:
            perm = torch.tensor(blk.perm)
            image_rows.append(ImageRows(tuple(blk.image_positions), rows[k].index_select(0, perm)))
            spans.append(ImageSpan.of(blk))
            k += 1
        chunks.append(SeqChunk(i, 0, s.ids, list(range(i * pages, (i + 1) * pages)), spans=tuple(spans),
                               image_rows=tuple(image_rows)))
    view = build_view(layout, n, chunks, torch.device("cpu"), max_image_tokens=cfg.vision.max_n_token)
    streams = lm.forward_layers(lm.embed(view), view, state.layers)
    offsets = torch.cumsum(torch.tensor([0] + [len(s.ids) for s in batch[:-1]]), 0)
    pick, targets, owner = [], [], []
    for i, s in enumerate(batch):
        for t in range(s.n_prompt - 1, len(s.ids) - 1):
            pick.append(int(offsets[i]) + t)
            targets.append(s.ids[t + 1])
            owner.append(i)
    logits = lm.logits(streams.index_select(0, torch.tensor(pick)))
    target = torch.tensor(targets)
    loss = F.cross_entropy(logits, target)
    hits = logits.argmax(-1) == target
    misses = torch.zeros(n).index_add_(0, torch.tensor(owner), (~hits).float())
    per_sample = misses == 0
    return loss, hits, per_sample


# ---- training loop ----------------------------------------------------------------------------------

@dataclass
class Run:
    """What every stage shares: the model, its optimiser's parameters and the held-out sets."""

    settings: TrainSettings
    cfg: ModelConfig
    lm: DS4ForCausalLM
    enc: VisionEncoder
    layout: StateLayout
    prep: Encoder
    params: list
    held: dict[str, tuple[list[Example], list[Sample]]]
    t_start: float


def train(settings: TrainSettings) -> dict:
    """Stage 1 (``steps``, skipped with ``init``): the original recipe on the original renderer's
    pictures. Stage 2 (``robust_steps``): the same tasks with ``free_share`` of the pictures drawn free
    hand and the questions reworded (``freehand``), at a lower learning rate, so the model answers about
    pictures from other hands while it keeps what stage 1 taught."""
    t_start = time.time()
    random.seed(settings.seed)
    torch.manual_seed(settings.seed)
    out = Path(settings.out)
    tok, cfg = write_folder(out, settings.init)
    weights = load_file(str(settings.init / "model.safetensors")) if settings.init else init_weights(cfg, settings.seed)
    lm, enc = build(cfg, weights)
    prep = Encoder(tok, cfg)
    summary = previous_summary(settings.init)
    if not settings.init:
        summary["vision_pretraining_accuracy"] = pretrain_vision(enc, cfg, prep.geom, settings.vision_steps,
                                                                 settings.seed + 7)
    params = [p for p in list(lm.parameters()) + list(enc.parameters()) if p.requires_grad]
    summary["params"] = sum(p.numel() for p in params)
    held_base = examples(EVAL_SEED + 100, len(TASKS) * settings.held_per_task)
    held_free = free_examples(EVAL_SEED + 200, len(IMAGE_TASKS) * settings.held_per_task, IMAGE_TASKS, 1.0)
    held = {"original": (held_base, [prep.sample(e) for e in held_base]),
            "free hand": (held_free, [prep.sample(e) for e in held_free])}
    run = Run(settings, cfg, lm, enc, StateLayout.build(cfg, torch.float32), prep, params, held, t_start)
    logging.getLogger("ds4serve.cache.state").setLevel(logging.WARNING)
    log.info("training ds4v-tiny: %.2fM parameters", summary["params"] / 1e6)
    if not settings.init and settings.steps:
        summary["stages"].append(run_stage(run, "base", settings.steps, settings.lr, 0.0))
    if settings.robust_steps:
        free_vision_stages(run, summary)
        summary["stages"].append(run_stage(run, "robust", settings.robust_steps, settings.robust_lr,
                                           settings.free_share))
    save(out, lm, enc)
    save_sample(out)
    summary["steps"] = sum(st["steps"] for st in summary["stages"])
    summary["elapsed_s"] = sum(st["elapsed_s"] for st in summary["stages"])
    (out / "TRAINING.json").write_text(json.dumps(summary, indent=1))
    return summary


def free_vision_stages(run: Run, summary: dict) -> None:
    """Stage 2a, a curriculum: the tower first on large shapes near their cells' middles (``EASY``),
    then on the whole free-hand distribution. On the full distribution alone the tiny tower's shape-kind
    accuracy stayed at 26-40% for thousands of steps; after the easy part it kept rising."""
    st = run.settings
    for name, steps, where, seed in (("free-hand vision (easy)", st.easy_vision_steps, EASY, st.seed + 13),
                                     ("free-hand vision", st.free_vision_steps, FULL, st.seed + 11)):
        if not steps:
            continue
        t0 = time.time()
        stats = pretrain_vision_free(run.enc, run.cfg, run.prep.geometry, steps, seed, where=where)
        summary["stages"].append({"name": name, "steps": steps, "elapsed_s": time.time() - t0, "final": stats})


def write_folder(out: Path, init: Path | None) -> tuple[Tokenizer, ModelConfig]:
    """Tokenizer (trained, seeded: the same every time), config and tokenizer config into ``out``;
    continuing from ``init`` requires that checkpoint to have been trained with the same tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    hf_tok = train_tokenizer(TOKENIZER_SEED)
    if init and json.loads(hf_tok.to_str()) != json.loads((init / "tokenizer.json").read_text()):
        raise ValueError(f"{init} was trained with another tokenizer; continue from a ds4serve tiny model")
    hf_tok.save(str(out / "tokenizer.json"))
    tok = Tokenizer(out)
    config = model_config(tok.vocab_size + (-tok.vocab_size) % 8)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=1, ensure_ascii=False))
    return tok, ModelConfig.from_dict(config)


def previous_summary(init: Path | None) -> dict:
    """The training record to extend: ``init``'s stage 1 (older records, one flat history, read as
    stage 1), or a fresh one."""
    previous = init / "TRAINING.json" if init else None
    if previous is None or not previous.exists():
        return {"params": 0, "stages": []}
    summary = json.loads(previous.read_text())
    summary.setdefault("stages", [{"name": "base", "steps": summary.get("steps"), "elapsed_s": summary.get("elapsed_s"),
                                   "history": summary.pop("history", [])}])
    summary["stages"] = [st for st in summary["stages"] if st["name"] == "base"]
    return summary


def batch_examples(seed: int, n: int, free_share: float) -> list[Example]:
    """Stage 1 keeps the original data stream exactly (``examples``), so its recipe is unchanged."""
    return free_examples(seed, n, TRAIN_TASKS, free_share) if free_share else examples(seed, n, TRAIN_TASKS)


def run_stage(run: Run, name: str, steps: int, peak_lr: float, free_share: float) -> dict:
    """Warm-up then cosine decay to 0 over ``steps``; teacher-forced held-out checks every ``eval_every``."""
    st, t0 = run.settings, time.time()
    opt = torch.optim.AdamW(run.params, lr=peak_lr, betas=(0.9, 0.98), weight_decay=0.01)
    rng = random.Random(TRAIN_SEED if name == "base" else TRAIN_SEED + 10)
    history, step, loss = [], 0, torch.zeros(())
    while step < steps:
        if st.time_limit_s and time.time() - run.t_start > st.time_limit_s:
            log.info("time limit reached at %s step %d", name, step)
            break
        batch = [run.prep.sample(ex) for ex in batch_examples(rng.randrange(2**31), st.batch, free_share)]
        lr = peak_lr * min(1.0, (step + 1) / st.warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for g in opt.param_groups:
            g["lr"] = lr
        loss, hits, _ = forward_loss(run.lm, run.enc, run.cfg, run.layout, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(run.params, 1.0)
        opt.step()
        step += 1
        if step % st.log_every == 0 or step == 1:
            log.info("%s step %d  loss %.4f  token acc %.3f  lr %.2e  %.0fs", name, step, loss.item(),
                     hits.float().mean().item(), lr, time.time() - run.t_start)
        if step % st.eval_every == 0 or step == steps:
            history.append({"step": step, "loss": loss.item(), "elapsed_s": time.time() - t0, **held_out(run)})
    if not history or history[-1]["step"] != step:
        history.append({"step": step, "loss": loss.item(), "elapsed_s": time.time() - t0, **held_out(run)})
    return {"name": name, "steps": step, "lr": peak_lr, "free_share": free_share, "elapsed_s": time.time() - t0,
            "history": history}


def held_out(run: Run) -> dict:
    """Teacher-forced exact match per held-out set and task (logged; the real eval is ``tiny eval``)."""
    out = {}
    for set_name, (exs, samples) in run.held.items():
        ok = evaluate_teacher_forced(run.lm, run.enc, run.cfg, run.layout, samples)
        tasks = sorted({e.task for e in exs}, key=lambda t: (TASKS + ("describe",)).index(t))
        per_task = {t: sum(o for o, e in zip(ok, exs) if e.task == t) / sum(e.task == t for e in exs) for t in tasks}
        out[set_name] = {"exact": sum(ok) / len(ok), "per_task": per_task}
        log.info("held-out %s exact match (teacher-forced) %.3f  %s", set_name, sum(ok) / len(ok),
                 " ".join(f"{t}={a:.2f}" for t, a in per_task.items()))
    return out


@torch.no_grad()
def evaluate_teacher_forced(lm, enc, cfg, layout, samples: list[Sample]) -> list[bool]:
    """Per sample: is every answer token the argmax given the right prefix (= greedy exact match)."""
    ok: list[bool] = []
    for i in range(0, len(samples), 48):
        ok += forward_loss(lm, enc, cfg, layout, samples[i:i + 48])[2].tolist()
    return ok


SAMPLE_SCENE = [("circle", "red", 0), ("triangle", "green", 2), ("square", "blue", 7)]


def save_sample(out: Path) -> None:
    """The README's sample picture and the right answer to its question (not the model's answer)."""
    from .data import Shape, draw

    draw([Shape(k, c, cell) for k, c, cell in SAMPLE_SCENE]).save(out / "sample.png")
    (out / "sample_answer.txt").write_text("green\n")  # What colour is the triangle?


def save(out: Path, lm: DS4ForCausalLM, enc: VisionEncoder) -> None:
    tensors = {k: v.detach().contiguous() for k, v in lm.state_dict().items()}
    tensors.update({k: v.detach().contiguous() for k, v in enc.state_dict().items()})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "producer": "ds4serve tiny train"})
    log.info("saved %s (%.1f MB)", out, (out / "model.safetensors").stat().st_size / 1e6)


__all__ = ["TASKS", "TrainSettings", "train"]
