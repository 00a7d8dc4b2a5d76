"""Stage 0 of ``tiny train``: teach the vision tower what is where before the LM needs it.

VLMs start from a trained vision encoder; the tiny model's tower starts from noise, and answer-token
loss alone reaches it through the whole decoder. A throw-away linear head on every aligner row
(one image token) gives it a direct, dense target instead. Only the tower and aligner keep what
they learned.

* ``pretrain_vision``: the original renderer (one 3 x 3 grid: aligner row = cell); each row predicts
  its cell's shape kind and colour, or "empty".
* ``pretrain_vision_free``: free-hand pictures (``freehand``) of any size, letterboxed onto the
  server's canvas, so an aligner row no longer is a cell. Each row predicts the kind and colour of a
  shape whose centre falls in its area (else "empty"), and which third-by-third cell of the *picture*
  it belongs to: a shape's answer cell where it holds a shape's centre, else the cell of its own
  middle (or "letterbox"): the position answer, made a property of every token.
"""

from __future__ import annotations

import logging
import math
import random

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..model.vision import VisionEncoder
from ..multimodal.resize import ImageGeometry, preprocess
from .data import COLOURS, SHAPES, draw, random_scene
from .freehand import FULL, Placement, free_picture

log = logging.getLogger(__name__)
LETTERBOX = 9  # the cell label of a token outside the picture
OBJECT_WEIGHT = 4.0


def pretrain_vision(enc: VisionEncoder, cfg: ModelConfig, geom, steps: int, seed: int, batch: int = 32) -> float:
    """The original renderer's stage 0. Returns the final per-cell kind+colour accuracy."""
    n_kind, n_col = len(SHAPES) + 1, len(COLOURS) + 1
    head = torch.nn.Linear(cfg.hidden_size, n_kind + n_col)
    params = [p for p in enc.parameters() if p.requires_grad] + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)
    rng = random.Random(seed)
    colours = list(COLOURS)
    acc = 0.0
    for _ in range(steps):
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


def letterbox_map(width: int, height: int, geom: ImageGeometry) -> tuple[float, float, float, float]:
    """(scale x, scale y, offset x, offset y) from picture pixels to canvas pixels, as Pillow's
    ``ImageOps.pad`` (what ``preprocess`` letterboxes with) places the picture; or the stretch."""
    cw, ch = geom.canvas_w, geom.canvas_h
    if geom.stretch:
        return cw / width, ch / height, 0.0, 0.0
    nw, nh = cw, ch
    if width / height > cw / ch:
        nh = round(height / width * cw)
    elif width / height < cw / ch:
        nw = round(width / height * ch)
    return nw / width, nh / height, float(round((cw - nw) * 0.5)), float(round((ch - nh) * 0.5))


def token_labels(width: int, height: int, geom: ImageGeometry, scene, spots, patch: int,
                 ratio: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per aligner row (row-major ``llm_h x llm_w``): kind and colour of a shape centred in its area
    (0 = none), and a picture cell: the shape's answer cell on such a row (a row may straddle cell lines),
    else the cell holding the row's middle (``LETTERBOX`` outside the picture)."""
    sx, sy, ox, oy = letterbox_map(width, height, geom)
    side = patch * ratio
    n = geom.llm_h * geom.llm_w
    kinds, cols, cells = torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long)
    colours = list(COLOURS)
    for r in range(geom.llm_h):
        for c in range(geom.llm_w):
            x = (min((c + 0.5) * side, geom.canvas_w - 0.5) - ox) / sx
            y = (min((r + 0.5) * side, geom.canvas_h - 0.5) - oy) / sy
            inside = 0 <= x < width and 0 <= y < height
            cells[r * geom.llm_w + c] = min(2, int(3 * y / height)) * 3 + min(2, int(3 * x / width)) if inside else LETTERBOX
    for sh, (cx, cy, _) in zip(scene, spots):
        r = min(geom.llm_h - 1, int((cy * sy + oy) // side))
        c = min(geom.llm_w - 1, int((cx * sx + ox) // side))
        kinds[r * geom.llm_w + c] = 1 + SHAPES.index(sh.kind)
        cols[r * geom.llm_w + c] = 1 + colours.index(sh.colour)
        cells[r * geom.llm_w + c] = sh.cell  # where the shape is, not where the token's middle is
    return kinds, cols, cells


def pretrain_vision_free(enc: VisionEncoder, cfg: ModelConfig, geometry, steps: int, seed: int,
                         batch: int = 32, lr: float = 3e-3, where: Placement = FULL) -> dict:
    """Stage 0 on free-hand pictures (module doc), shapes placed by ``where`` (the curriculum runs
    this twice: ``EASY``, then ``FULL``, each with a fresh head and schedule). ``geometry(w, h)`` is
    the server's sizing. Returns the final batch's accuracies (kind+colour on rows holding a shape,
    cell on every row)."""
    v = cfg.vision
    n_kind, n_col, n_cell = len(SHAPES) + 1, len(COLOURS) + 1, LETTERBOX + 1
    head = torch.nn.Linear(cfg.hidden_size, n_kind + n_col + n_cell)
    params = [p for p in enc.parameters() if p.requires_grad] + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    rng = random.Random(seed)
    stats: dict = {}
    for step in range(steps):
        for g in opt.param_groups:  # cosine to a tenth: the LM stage starts from settled features
            g["lr"] = lr * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps)))
        groups: dict[tuple[int, int], list] = {}
        for _ in range(batch):
            scene = random_scene(rng)
            pic = free_picture(rng, scene, where)
            geom = geometry(*pic.image.size)
            labels = token_labels(*pic.image.size, geom, scene, pic.spots, v.patch_size, v.downsample_ratio)
            groups.setdefault((geom.vit_h, geom.vit_w), []).append((preprocess(pic.image, geom, v.patch_size), labels))
        logits, kinds, cols, cells = [], [], [], []
        for (vit_h, vit_w), items in groups.items():
            rows = enc.encode_same_grid(torch.stack([x for x, _ in items]), vit_h, vit_w)
            logits.append(head(rows).reshape(-1, n_kind + n_col + n_cell))
            for _, (k, c, cell) in items:
                kinds.append(k), cols.append(c), cells.append(cell)
        out, kind, col, cell = torch.cat(logits), torch.cat(kinds), torch.cat(cols), torch.cat(cells)
        lk, lc, lp = out[:, :n_kind], out[:, n_kind:n_kind + n_col], out[:, n_kind + n_col:]
        # rows holding a shape are ~1 in 6: weigh them up so "empty everywhere" is not a cheap optimum
        weight = 1.0 + (OBJECT_WEIGHT - 1.0) * (kind > 0).float()
        loss = ((F.cross_entropy(lk, kind, reduction="none") + F.cross_entropy(lc, col, reduction="none")) * weight).mean() \
            + F.cross_entropy(lp, cell)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % 50 == 0 or step + 1 == steps:
            held = kind > 0
            stats = {"step": step + 1, "loss": loss.item(),
                     "object_rows_kind_colour": float(((lk.argmax(-1) == kind) & (lc.argmax(-1) == col))[held].float().mean()),
                     "object_rows_kind": float((lk.argmax(-1) == kind)[held].float().mean()),
                     "object_rows_colour": float((lc.argmax(-1) == col)[held].float().mean()),
                     "empty_rows": float((lk.argmax(-1) == 0)[~held].float().mean()),
                     "cell": float((lp.argmax(-1) == cell).float().mean())}
            log.info("free-hand vision pretraining %s", stats)
    return stats
