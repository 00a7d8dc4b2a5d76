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
from safetensors.torch import save_file

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
from .data import COLOURS, SHAPES, SIZE, TASKS, TRAIN_TASKS, Example, draw, examples, messages, random_scene
from .tokenizer_train import train_tokenizer

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
    log_every: int = 50
    eval_every: int = 500


# ---- data -> tensors ---------------------------------------------------------------------------

@dataclass
class Sample:
    ids: list[int]
    n_prompt: int
    patches: list[torch.Tensor]
    blocks: list


class Encoder:
    """Example -> token ids with image blocks + patches, exactly as the server prepares them."""

    def __init__(self, tok: Tokenizer, cfg: ModelConfig):
        self.tok, self.cfg = tok, cfg
        v = cfg.vision
        self.geom = plan_resize(SIZE, SIZE, patch=v.patch_size, min_pixels=v.min_pixels, max_n_token=v.max_n_token,
                                max_wh_ratio=v.max_wh_ratio, downsample=v.downsample_ratio)

    def prompt(self, ex: Example) -> tuple[list[int], list[torch.Tensor], list]:
        rendered = render_chat(self.tok, messages(ex, ["x"] * len(ex.images)))
        out, blocks, cursor = [], [], 0
        for pos in rendered.image_positions:
            out += rendered.ids[cursor:pos]
            blk = image_block(self.geom.llm_h, self.geom.llm_w, len(out))
            out += [self.cfg.vocab_size + int(t) for t in blk.types]
            blocks.append(blk)
            cursor = pos + 1
        out += rendered.ids[cursor:]
        patches = [preprocess(im, self.geom, self.cfg.vision.patch_size) for im in ex.render_images()]
        return out, patches, blocks

    def sample(self, ex: Example) -> Sample:
        ids, patches, blocks = self.prompt(ex)
        answer = self.tok.encode_text(ex.answer) + [self.tok.eos_id]
        return Sample(ids + answer, len(ids), patches, blocks)


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
                 batch: list[Sample], geom) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean answer-token loss, per-token argmax hits and a per-sample all-correct mask."""
    n = len(batch)
    longest = max(len(s.ids) for s in batch)
    pages = layout.pages_for(longest)
    state = ModelState(layout, n_slots=n, n_pages=n * pages, device="cpu")
    all_patches = [p for s in batch for p in s.patches]
    rows = enc.encode_same_grid(torch.stack(all_patches), geom.vit_h, geom.vit_w) if all_patches else None
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


# ---- stage 0: vision pretraining ---------------------------------------------------------------------

def pretrain_vision(enc: VisionEncoder, cfg: ModelConfig, geom, steps: int, seed: int, batch: int = 32) -> float:
    """Teach the tower what is in each cell before the LM needs it (as VLMs start from a trained
    vision encoder): a linear head on every aligner row predicts the cell's shape kind and colour
    (or "empty"). The head is thrown away; only the tower and aligner keep what they learned.
    Returns the final per-cell accuracy."""
    n_kind, n_col = len(SHAPES) + 1, len(COLOURS) + 1
    head = torch.nn.Linear(cfg.hidden_size, n_kind + n_col)
    params = [p for p in enc.parameters() if p.requires_grad] + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)
    rng = random.Random(seed)
    colours = list(COLOURS)
    acc = 0.0
    for step in range(steps):
        xs, kinds, cols = [], torch.zeros(batch, 9, dtype=torch.long), torch.zeros(batch, 9, dtype=torch.long)
        for b in range(batch):
            scene = random_scene(rng)
            xs.append(preprocess(draw(scene), geom, cfg.vision.patch_size))
            for sh in scene:
                kinds[b, sh.cell] = 1 + SHAPES.index(sh.kind)
                cols[b, sh.cell] = 1 + colours.index(sh.colour)
        logits = head(enc.encode_same_grid(torch.stack(xs), geom.vit_h, geom.vit_w))  # [B, 9 cells, ...]
        loss = F.cross_entropy(logits[..., :n_kind].reshape(-1, n_kind), kinds.reshape(-1)) + \
            F.cross_entropy(logits[..., n_kind:].reshape(-1, n_col), cols.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        acc = ((logits[..., :n_kind].argmax(-1) == kinds) & (logits[..., n_kind:].argmax(-1) == cols)).float().mean()
    log.info("vision pretraining: %d steps, per-cell kind+colour accuracy %.3f", steps, float(acc))
    return float(acc)


# ---- training loop ----------------------------------------------------------------------------------

def train(settings: TrainSettings) -> dict:
    t_start = time.time()
    random.seed(settings.seed)
    torch.manual_seed(settings.seed)
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    hf_tok = train_tokenizer(TOKENIZER_SEED)
    hf_tok.save(str(out / "tokenizer.json"))
    tok = Tokenizer(out)
    vocab = tok.vocab_size + (-tok.vocab_size) % 8
    config = model_config(vocab)
    cfg = ModelConfig.from_dict(config)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=1, ensure_ascii=False))
    lm, enc = build(cfg, init_weights(cfg, settings.seed))
    layout = StateLayout.build(cfg, torch.float32)
    prep = Encoder(tok, cfg)
    vision_acc = pretrain_vision(enc, cfg, prep.geom, settings.vision_steps, settings.seed + 7)
    params = [p for p in list(lm.parameters()) + list(enc.parameters()) if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    log.info("training ds4v-tiny: %.2fM parameters, %d steps x %d examples", n_params / 1e6, settings.steps,
             settings.batch)
    opt = torch.optim.AdamW(params, lr=settings.lr, betas=(0.9, 0.98), weight_decay=0.01)
    held_ex = examples(EVAL_SEED + 100, 7 * 24)
    held = [prep.sample(ex) for ex in held_ex]
    rng = random.Random(TRAIN_SEED)
    history = []
    step = 0
    logging.getLogger("ds4serve.cache.state").setLevel(logging.WARNING)
    while step < settings.steps:
        if settings.time_limit_s and time.time() - t_start > settings.time_limit_s:
            log.info("time limit reached at step %d", step)
            break
        batch = [prep.sample(ex) for ex in examples(rng.randrange(2**31), settings.batch, TRAIN_TASKS)]
        lr = settings.lr * min(1.0, (step + 1) / settings.warmup) * 0.5 * (1 + math.cos(math.pi * step / settings.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        loss, hits, _ = forward_loss(lm, enc, cfg, layout, batch, prep.geom)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % settings.log_every == 0 or step == 1:
            log.info("step %d  loss %.4f  token acc %.3f  lr %.2e  %.0fs", step, loss.item(), hits.float().mean().item(),
                     lr, time.time() - t_start)
        if step % settings.eval_every == 0 or step == settings.steps:
            ok = evaluate_teacher_forced(lm, enc, cfg, layout, held, prep.geom)
            per_task = {t: sum(o for o, e in zip(ok, held_ex) if e.task == t) / sum(e.task == t for e in held_ex)
                        for t in TASKS if any(e.task == t for e in held_ex)}
            acc = sum(ok) / len(ok)
            history.append({"step": step, "loss": loss.item(), "exact": acc, "per_task": per_task,
                            "elapsed_s": time.time() - t_start})
            log.info("step %d  held-out exact match (teacher-forced) %.3f  %s", step, acc,
                     " ".join(f"{t}={a:.2f}" for t, a in per_task.items()))
    save(out, lm, enc)
    save_sample(out)
    summary = {"steps": step, "params": n_params, "elapsed_s": time.time() - t_start, "history": history,
               "vision_pretraining_accuracy": vision_acc}
    (out / "TRAINING.json").write_text(json.dumps(summary, indent=1))
    return summary


@torch.no_grad()
def evaluate_teacher_forced(lm, enc, cfg, layout, samples: list[Sample], geom) -> list[bool]:
    """Per sample: is every answer token the argmax given the right prefix (= greedy exact match)."""
    ok: list[bool] = []
    for i in range(0, len(samples), 48):
        ok += forward_loss(lm, enc, cfg, layout, samples[i:i + 48], geom)[2].tolist()
    return ok


SAMPLE_SCENE = [("circle", "red", 0), ("triangle", "green", 2), ("square", "blue", 7)]


def save_sample(out: Path) -> None:
    """The README's sample picture and the right answer to its question (not the model's answer)."""
    from .data import Shape

    draw([Shape(k, c, cell) for k, c, cell in SAMPLE_SCENE]).save(out / "sample.png")
    (out / "sample_answer.txt").write_text("green\n")  # What colour is the triangle?


def save(out: Path, lm: DS4ForCausalLM, enc: VisionEncoder) -> None:
    tensors = {k: v.detach().contiguous() for k, v in lm.state_dict().items()}
    tensors.update({k: v.detach().contiguous() for k, v in enc.state_dict().items()})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "producer": "ds4serve tiny train"})
    log.info("saved %s (%.1f MB)", out, (out / "model.safetensors").stat().st_size / 1e6)


__all__ = ["TASKS", "TrainSettings", "train"]
