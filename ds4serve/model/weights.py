"""Checkpoint loading: safetensors (single file or sharded), HF or official names, FP8 / MXFP4
dequantisation.

This module is the only place that knows checkpoint formats (DESIGN §8.7). Tensors are opened
lazily (safetensors mmap) and converted one at a time, with a progress bar in bytes (on a terminal;
in a log file one summary line says how many tensors and bytes loaded in how long). Official names
(spec ds4-text §13) are mapped to the HF names the modules use; per-expert official tensors are
stacked into HF's ``gate_up_proj`` / ``down_proj``. FP8 e4m3 weights with block scales
(``.scale`` or ``.weight_scale_inv``) and MXFP4 experts (the Flash instruct release: two E2M1 codes
per byte, one UE8M0 scale per 32 inputs) are dequantised at load. Missing, unexpected or mis-shaped
tensors fail with one error that lists them all, and so do index tables (``IndexTable``: the hash
routing's ``tid2eid``) of the wrong dtype or shape or with a value outside the range they index.
"""

from __future__ import annotations

import logging
import re
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .checkpoint import (CheckpointError, Source, checkpoint_files, scale_name, scaled_weight, stored_kind,
                         stored_loader)
from .packed import PackedExperts, stack_parts
from .quant import FormatError, dequant_fp8, dequant_mxfp4, is_fp8, is_packed_fp4

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IndexTable:
    """A checkpoint tensor whose values the forward uses as indices: torch gathers with them and the
    native forward reads them unchecked (outside a checked build), so a bad value would read another
    tensor's memory. Checked at load: an integer dtype, exactly the expected shape (a flattened or
    transposed table would route silently wrong), every value in ``[0, bound)``."""

    bound: int
    meaning: str  # what the values index and which config keys give the shape and bound


# explain(missing, unexpected, misshaped {name: shape found}) -> lines naming the config keys behind them
Explain = Callable[[list[str], list[str], dict[str, tuple[int, ...]]], list[str]]

# safetensors dtypes that hold integers (an index table stored as floats is refused, not truncated)
_INT_DTYPES = {"I8", "U8", "I16", "U16", "I32", "U32", "I64", "U64"}


# Parameters kept in fp32 whatever the model dtype (HF's _keep_in_fp32_modules_strict; the ViT
# norms too, spec ds4-vision §2.1).
_FP32_MARKERS = ("attn_hc.", "ffn_hc.", "hc_head.", ".sinks", "position_bias", "e_score_correction_bias",
                 "q_a_norm.", "kv_norm.", "input_layernorm.", "post_attention_layernorm.", "model.norm.",
                 "bias_vl", "image_start", "image_pad", "image_newline", "image_end", "_norm.weight",
                 "vision.norm.")

# Checkpoint parts ds4serve does not instantiate (the MTP drafter is not used for serving yet).
_IGNORED = (re.compile(r"^(model\.)?mtp\."),)

_OFFICIAL_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "embed_tokens.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "head.weight": "lm_head.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}

_TOP_LEVEL = ("vision.", "aligner.", "image_start", "image_pad", "image_newline", "image_end")

_OFFICIAL_LAYER = [
    (r"attn_norm\.weight", "input_layernorm.weight"),
    (r"ffn_norm\.weight", "post_attention_layernorm.weight"),
    (r"hc_attn_(fn|base|scale)", r"attn_hc.\1"),
    (r"hc_ffn_(fn|base|scale)", r"ffn_hc.\1"),
    (r"attn\.wq_a\.", "self_attn.q_a_proj."),
    (r"attn\.q_norm\.", "self_attn.q_a_norm."),
    (r"attn\.wq_b\.", "self_attn.q_b_proj."),
    (r"attn\.wkv\.", "self_attn.kv_proj."),
    (r"attn\.(kv_)?norm\.", "self_attn.kv_norm."),  # transformers writes attn.norm
    (r"attn\.wo_a\.", "self_attn.o_a_proj."),
    (r"attn\.wo_b\.", "self_attn.o_b_proj."),
    (r"attn\.attn_sink$", "self_attn.sinks"),
    (r"attn\.compressor\.wkv\.", "self_attn.compressor.kv_proj."),
    (r"attn\.compressor\.wgate\.", "self_attn.compressor.gate_proj."),
    (r"attn\.compressor\.ape$", "self_attn.compressor.position_bias"),
    (r"attn\.compressor\.norm\.", "self_attn.compressor.kv_norm."),
    (r"attn\.indexer\.wq_b\.", "self_attn.compressor.indexer.q_b_proj."),
    (r"attn\.indexer\.weights_proj\.", "self_attn.compressor.indexer.scorer.weights_proj."),
    (r"attn\.indexer\.compressor\.wkv\.", "self_attn.compressor.indexer.kv_proj."),
    (r"attn\.indexer\.compressor\.wgate\.", "self_attn.compressor.indexer.gate_proj."),
    (r"attn\.indexer\.compressor\.ape$", "self_attn.compressor.indexer.position_bias"),
    (r"attn\.indexer\.compressor\.norm\.", "self_attn.compressor.indexer.kv_norm."),
    (r"ffn\.gate\.weight$", "mlp.gate.weight"),
    (r"ffn\.gate\.bias$", "mlp.gate.e_score_correction_bias"),
    (r"ffn\.gate\.bias_vl$", "mlp.gate.bias_vl"),
    (r"ffn\.gate\.tid2eid$", "mlp.gate.tid2eid"),
    (r"ffn\.shared_experts\.w1\.", "mlp.shared_experts.gate_proj."),
    (r"ffn\.shared_experts\.w3\.", "mlp.shared_experts.up_proj."),
    (r"ffn\.shared_experts\.w2\.", "mlp.shared_experts.down_proj."),
]
_OFFICIAL_LAYER_RE = [(re.compile(p), r) for p, r in _OFFICIAL_LAYER]
_EXPERT_RE = re.compile(r"^(?:model\.)?layers\.(\d+)\.ffn\.experts\.(\d+)\.(w1|w2|w3)\.(weight|scale)$")
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_FP4_STORAGE = {"I8", "U8", "F4"}  # safetensors dtypes that hold packed FP4 codes


def canonical_name(name: str) -> str:
    """The module (HF in-memory) name for a checkpoint tensor name.

    Three spellings exist in the wild: HF module names (``model.layers.0.self_attn.q_a_proj.weight``),
    the official names (``layers.0.attn.wq_a.weight``, ``embed.weight``, ``head.weight``), and what
    transformers 5.x writes with ``save_pretrained`` (official names under a ``model.`` prefix).
    Names that match no rule are returned as module names and checked against the model later.
    """
    if name in ("lm_head.weight", "head.weight", "model.head.weight"):
        return "lm_head.weight"
    bare = name[len("model."):] if name.startswith("model.") else name
    if bare.startswith(_TOP_LEVEL):
        return bare  # DS4V: the vision tower, the aligner and the sentinel vectors live at the top
    if bare in _OFFICIAL_TOP:
        return _OFFICIAL_TOP[bare]
    m = _LAYER_RE.match(bare)
    if m:
        layer, rest = m.groups()
        for pattern, repl in _OFFICIAL_LAYER_RE:
            if pattern.match(rest):
                return f"model.layers.{layer}." + pattern.sub(repl, rest, count=1)
    return "model." + bare


def load_state_dict(path: str | Path, expected: dict[str, tuple[tuple[int, ...], torch.dtype]],
                    dtype: torch.dtype, device: torch.device | str, progress: bool = True,
                    fp8_block: tuple[int, int] = (128, 128), packed_experts: bool = False,
                    shard=None, skip: tuple[str, ...] = (), indices: Mapping[str, IndexTable] | None = None,
                    explain: Explain | None = None, stored: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Read a checkpoint into ``{hf_name: tensor}`` matching ``expected`` (name -> (full shape, dtype)).
    ``packed_experts``: quantised routed experts (official per-expert tensors) stay packed
    (``packed.PackedExperts`` values instead of tensors). ``shard`` (``sharding.ShardPlan``): only this
    rank's slices are kept, and of the routed experts only this rank's are read at all; names starting
    with a ``skip`` prefix are not loaded (a tensor-parallel worker has no vision tower). ``indices``:
    the tensors whose values are indices (``IndexTable``), checked before anything is loaded.
    ``explain(missing, unexpected, misshaped)``: lines that say what in the config those names point at.
    ``stored``: names that may stay at the checkpoint's width (``stored_kind``): FP8 projections become
    ``StoredWeight`` values, a bf16 LM head too, and a bf16 embedding table stays bf16."""
    src = Source(checkpoint_files(Path(path)))
    src.fp8_block = fp8_block
    plan, experts, scales, ignored, unknown = _plan(src)
    if ignored:
        log.info("ignoring %d checkpoint tensors not used for serving (e.g. %s)", len(ignored), ignored[0])
    indices = indices or {}
    problems = _compare(src, plan, experts, expected, unknown, indices, explain)
    problems += _index_problems(src, plan, expected, indices)
    if problems:
        raise CheckpointError("checkpoint does not match the model config:\n  " + "\n  ".join(problems))
    if skip:
        plan = {hf: name for hf, name in plan.items() if not hf.startswith(skip)}
    local = {hf: (shard.local_shape(hf, shape) if shard else shape, dt) for hf, (shape, dt) in expected.items()}
    loaders: dict[str, Callable[[], torch.Tensor]] = {hf: _single_loader(src, name, hf, shard)
                                                      for hf, name in plan.items()}
    stacked = _expert_loaders(src, experts, local, dtype, torch.device(device), packed_experts, shard)
    loaders.update(stacked)
    expected = local
    targets = {hf: dtype if hf in stacked else loaded_dtype(hf, expected[hf][1], dtype) for hf in loaders}
    final = set(stacked)
    for hf in stored if shard is None or shard.world == 1 else ():
        kind = stored_kind(src, plan[hf], hf, dtype) if hf in plan else None
        if kind is not None:
            loaders[hf] = stored_loader(src, plan[hf], kind, device)
            final.add(hf)
    t0 = time.perf_counter()
    out = _materialise(loaders, final, expected, targets, device, progress, _file_order(src, plan, experts, loaders),
                       src)
    seconds = time.perf_counter() - t0
    nbytes = sum(_nbytes(t) for t in out.values())
    log.info("loaded %d tensors, %.3g GiB in %.2f s (%.2f GiB/s) from %s", len(out), nbytes / 2**30, seconds,
             nbytes / 2**30 / max(seconds, 1e-9), path)
    return out


def stored_bytes(path: str | Path, fp8_block: tuple[int, int] = (128, 128)) -> dict[str, int]:
    """{module name: bytes held} of the tensors ``load_state_dict(stored=...)`` would keep at their stored
    width under an fp32 model (FP8 codes and their fp32 block scales, bf16 head and embedding), read from
    the safetensors headers alone: the capacity plan counts these instead of their fp32 size."""
    src = Source(checkpoint_files(Path(path)))
    plan = _plan(src)[0]
    out: dict[str, int] = {}
    for hf, name in plan.items():
        kind = stored_kind(src, name, hf, torch.float32)
        if kind is None:
            continue
        n = _numel(src.shape(name))
        if kind == "fp8":
            rows, cols = src.shape(name)
            out[hf] = n + 4 * -(-rows // fp8_block[0]) * -(-cols // fp8_block[1])
        else:
            out[hf] = 2 * n
    return out


def _file_order(src: Source, plan: dict[str, str], experts: dict, loaders: dict) -> list[tuple[int, list[str]]]:
    """The loaders grouped by the shard they read (expert stacks: their first expert's), in file order."""
    groups: dict[int, list[str]] = defaultdict(list)
    for hf in sorted(loaders):
        if hf in plan:
            groups[src.where[plan[hf]]].append(hf)
            continue
        m = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.", hf)
        pieces = experts.get(int(m.group(1))) if m else None
        groups[src.where[next(iter(pieces.values()))] if pieces else -1].append(hf)
    return sorted(groups.items())


def _materialise(loaders: dict[str, Callable[[], torch.Tensor]], stacked, expected: dict,
                 targets: dict[str, torch.dtype], device: torch.device | str,
                 progress: bool, order: list[tuple[int, list[str]]] | None = None,
                 src: Source | None = None) -> dict[str, torch.Tensor]:
    """Run every loader, converting to its target dtype on the device. The bar counts bytes (a
    tensor count hides that one expert stack outweighs hundreds of norms) and shows only on a
    terminal (``disable=None``): in a log file the caller's summary line is what remains. ``order``:
    the loaders by shard (``_file_order``); each shard of ``src`` is unmapped once its tensors are read."""
    total = sum(_numel(expected[hf][0]) * targets[hf].itemsize for hf in loaders)
    out: dict[str, torch.Tensor] = {}
    with tqdm(total=total, desc="loading weights", unit="B", unit_scale=True, unit_divisor=1024,
              disable=None if progress else True, leave=False) as bar:
        for file_index, names in order if order is not None else [(-1, sorted(loaders))]:
            for hf in names:
                t = loaders[hf]()
                if hf in stacked:  # built in place on the device (expert stacks, stored weights): already final
                    out[hf] = t
                else:  # copy=True: never keep views into the mmap (unaligned storage changes GEMM rounding)
                    out[hf] = t.to(device=device, dtype=targets[hf], copy=True).reshape(expected[hf][0])
                bar.update(_nbytes(out[hf]))
            if src is not None and file_index >= 0:
                src.release(file_index)
    return out


def _nbytes(t) -> int:
    return t.nbytes if not isinstance(t, torch.Tensor) else t.numel() * t.element_size()


def loaded_dtype(name: str, want: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    """The dtype tensor ``name`` (meta dtype ``want``) is loaded with under model dtype ``dtype`` (the
    capacity plan counts with it too): integer buffers keep theirs, a few precision-critical tensors
    stay fp32."""
    if not want.is_floating_point:
        return want
    return torch.float32 if _keeps_fp32(name) else dtype


def _keeps_fp32(name: str) -> bool:
    return any(marker in name for marker in _FP32_MARKERS)


def _plan(src: Source):
    """Sort checkpoint names into direct tensors, official per-expert pieces, scales, ignored and unknown."""
    plan: dict[str, str] = {}
    experts: dict[int, dict[tuple[int, str], str]] = defaultdict(dict)
    scales, ignored, unknown = [], [], []
    for name in src.where:
        if any(p.search(name) for p in _IGNORED):
            ignored.append(name)
            continue
        if scaled_weight(src, name) is not None:
            scales.append(name)
            continue
        m = _EXPERT_RE.match(name)
        if m:
            experts[int(m.group(1))][(int(m.group(2)), m.group(3))] = name
            continue
        hf = canonical_name(name)
        if hf in plan:
            unknown.append(f"{name} (duplicate of {plan[hf]})")
        else:
            plan[hf] = name
    return plan, experts, scales, ignored, unknown


def _single_loader(src: Source, name: str, hf: str, shard) -> Callable[[], torch.Tensor]:
    if shard is None or shard.rule(hf) is None:
        return lambda: _read(src, name, fp4_needs_scale=False)
    # dequantised whole (FP8 blocks straddle slice edges), then sliced: one tensor at a time
    return lambda: shard.take(hf, _read(src, name, fp4_needs_scale=False).reshape(src.logical_shape(name)))


def _read(src: Source, name: str, fp4_needs_scale: bool) -> torch.Tensor:
    """A checkpoint tensor, dequantised when it is FP8 (which always has a block scale) or packed
    MXFP4 with one. Int8/uint8 bytes without a scale pass through unless they must be FP4 experts."""
    t = src.get(name)
    fp8, fp4 = is_fp8(t), is_packed_fp4(t)
    scale = scale_name(src, name) if fp8 or fp4 else None
    if fp8:
        if scale is None:
            raise CheckpointError(f"FP8 tensor {name} has no block scale (.scale / .weight_scale_inv)")
        return _dequant(dequant_fp8, t, src.get(scale), src.fp8_block, name)
    if fp4 and scale is not None:
        return _dequant(dequant_mxfp4, t, src.get(scale), name)
    if fp4 and fp4_needs_scale:
        raise CheckpointError(f"{name} is packed FP4 (MXFP4) but has no block scale (.scale / .weight_scale_inv)")
    return t


def _dequant(fn, *args) -> torch.Tensor:
    """A dequantiser's format error is a checkpoint error here (the user's file, named in it)."""
    try:
        return fn(*args)
    except FormatError as exc:
        raise CheckpointError(str(exc)) from exc


def _expert_loaders(src: Source, experts: dict[int, dict[tuple[int, str], str]],
                    expected: dict[str, tuple[tuple[int, ...], torch.dtype]], dtype: torch.dtype,
                    device: torch.device, packed: bool = False, shard=None) -> dict[str, Callable]:
    """Stack official per-expert tensors into HF's ``gate_up_proj [E, 2I, D]`` / ``down_proj [E, D, I]``,
    written expert by expert into a tensor allocated once on the target device in the target dtype:
    host memory holds one dequantised expert at a time, not a layer's experts in fp32 twice over
    (for Flash that would be ~34 GB per layer). With ``packed``, quantised experts are stacked as
    they are stored instead (``_packed_loader``)."""

    def fill(hf: str, part: Callable[[int], torch.Tensor]) -> torch.Tensor:
        shape = expected[hf][0]
        out = torch.empty(shape, dtype=dtype, device=device)
        for j in range(shape[0]):
            out[j].copy_(part(j))
        return out

    def piece(name: str, dim: int = 0) -> torch.Tensor:
        t = _read(src, name, fp4_needs_scale=True).float()
        if shard is None or shard.expert_parallel or shard.world == 1:
            return t
        part = t.shape[dim] // shard.world  # TP: this rank's share of the intermediate width
        return t.narrow(dim, shard.rank * part, part)

    loaders: dict[str, Callable[[], torch.Tensor]] = {}
    for layer, pieces in experts.items():
        prefix = f"model.layers.{layer}.mlp.experts."
        lo = _first_expert(shard, expected[prefix + "down_proj"][0][0])
        fmt = _packed_format(src, pieces[(0, "w1")]) if packed and (0, "w1") in pieces else None
        if fmt is not None:
            if shard is not None and shard.world > 1 and not shard.expert_parallel:
                raise CheckpointError("packed experts split by tensor parallel are not supported: "
                                      "add --enable-expert-parallel (each rank then holds whole experts)")
            for hf, kinds in ((prefix + "gate_up_proj", ("w1", "w3")), (prefix + "down_proj", ("w2",))):
                loaders[hf] = _packed_loader(src, pieces, kinds, fmt, expected[hf][0], dtype, device, hf, lo)
            continue

        def gate_up(pieces=pieces, hf=prefix + "gate_up_proj", lo=lo):
            return fill(hf, lambda j: torch.cat((piece(pieces[(lo + j, "w1")]), piece(pieces[(lo + j, "w3")]))))

        def down(pieces=pieces, hf=prefix + "down_proj", lo=lo):
            return fill(hf, lambda j: piece(pieces[(lo + j, "w2")], dim=1))

        loaders[prefix + "gate_up_proj"] = gate_up
        loaders[prefix + "down_proj"] = down
    return loaders


def _packed_format(src: Source, name: str) -> str | None:
    """"mxfp4" / "fp8" when ``name`` is a quantised tensor with its scale, else None (kept as today)."""
    kind = src.dtype(name)
    if scale_name(src, name) is None:
        return None
    if kind in _FP4_STORAGE:
        return "mxfp4"
    if kind in ("F8_E4M3", "F8_E5M2"):
        return "fp8"
    return None


def _first_expert(shard, n_local: int) -> int:
    """The first routed expert this rank holds (expert parallel: rank x its share; else 0)."""
    return shard.rank * n_local if shard is not None and shard.expert_parallel else 0


def _packed_loader(src: Source, pieces: dict, kinds: tuple[str, ...], fmt: str, shape, dtype, device, hf: str,
                   lo: int = 0):
    def load():
        per_expert = [[(src.get(pieces[(j, k)]), src.get(scale_name(src, pieces[(j, k)]))) for k in kinds]
                      for j in range(lo, lo + shape[0])]
        return PackedExperts(fmt, stack_parts(per_expert, device), shape, dtype, src.fp8_block, hf)

    return load


def _compare(src: Source, plan: dict[str, str], experts: dict, expected: dict, unknown: list[str],
             indices: Mapping[str, IndexTable] | None = None,
             explain: Explain | None = None) -> list[str]:
    """Missing, unexpected and mis-shaped tensors (index tables' shapes: ``_index_problems``), each a line."""
    problems: list[str] = []
    have = set(plan)
    for layer, pieces in experts.items():
        n_exp = 1 + max(j for j, _ in pieces)
        incomplete = [f"layers.{layer}.ffn.experts.{j}.{w}" for j in range(n_exp) for w in ("w1", "w2", "w3")
                      if (j, w) not in pieces]
        if incomplete:
            problems.append(f"incomplete experts: {_short(incomplete)}")
        have |= {f"model.layers.{layer}.mlp.experts.gate_up_proj", f"model.layers.{layer}.mlp.experts.down_proj"}
    missing = sorted(set(expected) - have)
    unexpected = sorted((have - set(expected))) + unknown
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {_short(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {_short(unexpected)}")
    misshaped: dict[str, tuple[int, ...]] = {}
    for hf, name in plan.items():
        if hf in expected and hf not in (indices or {}):
            got, want = src.logical_shape(name), expected[hf][0]
            if _numel(got) != _numel(want) or (len(got) == len(want) and got != want):
                problems.append(f"tensor {name}: shape {list(got)}, expected {list(want)}")
                misshaped[hf] = got
    if explain is not None and (missing or unexpected or misshaped):
        problems += explain(missing, unexpected, misshaped)
    for layer, pieces in experts.items():
        for (j, w), name in pieces.items():
            if src.dtype(name) in _FP4_STORAGE and scale_name(src, name) is None:
                problems.append(f"tensor {name} is packed FP4 (MXFP4) but has no block scale (.scale)")
                continue
            want = expected.get(f"model.layers.{layer}.mlp.experts.{'down_proj' if w == 'w2' else 'gate_up_proj'}")
            if want is None:
                continue
            e, rows, cols = want[0]
            exp_shape = (rows // 2, cols) if w != "w2" else (rows, cols)
            if src.logical_shape(name) != exp_shape or j >= e:
                problems.append(f"tensor {name}: shape {list(src.logical_shape(name))}, expected {list(exp_shape)}")
    return problems


def _index_problems(src: Source, plan: dict[str, str], expected: dict,
                    indices: Mapping[str, IndexTable]) -> list[str]:
    """One line per index table that is not integer, not exactly its expected shape, or holds a value
    outside ``[0, bound)`` (the first such value and where, and how many); missing ones are ``_compare``'s."""
    problems: list[str] = []
    for hf, table in sorted(indices.items()):
        name = plan.get(hf)
        if name is None or hf not in expected:
            continue
        got, want = src.shape(name), expected[hf][0]
        if src.dtype(name) not in _INT_DTYPES:
            problems.append(f"tensor {name}: dtype {src.dtype(name)}, expected an integer dtype "
                            f"({', '.join(sorted(_INT_DTYPES))}): {table.meaning}")
        elif got != want:
            problems.append(f"tensor {name}: shape {list(got)}, expected {list(want)}: {table.meaning}")
        else:
            problems += _out_of_range(name, src.get(name), table)
    return problems


def _out_of_range(name: str, values: torch.Tensor, table: IndexTable) -> list[str]:
    """The line for an index table with values outside ``[0, table.bound)``, or none."""
    values = values.long()  # unsigned ints have no comparisons in torch; the model holds int64 anyway
    bad = (values < 0) | (values >= table.bound)
    count = int(bad.sum())
    if not count:
        return []
    where = [int(i) for i in bad.nonzero()[0]]
    return [f"tensor {name}: value {int(values[tuple(where)])} at {where} is outside [0, {table.bound}) "
            f"({count} such value{'s' if count > 1 else ''}): {table.meaning}"]


def _numel(shape: Iterable[int]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _short(items: list[str], limit: int = 12) -> str:
    head = ", ".join(items[:limit])
    return head + (f", ... (+{len(items) - limit} more)" if len(items) > limit else "")
