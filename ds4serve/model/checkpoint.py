"""The files of a checkpoint: its shards, their tensors by name (opened lazily, mapped, unmapped once
read), block-scale lookups, and the tensors kept at their stored width (views of the mapping).

Below ``weights.py``, which plans and checks a load; split from it so the reader of bytes and the
planner of names each fit one screen of thought.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from .stored import StoredWeight


class CheckpointError(RuntimeError):
    """The checkpoint does not match the model config (the message lists what is wrong)."""


_SCALE_SUFFIXES = (".scale", ".weight_scale_inv", "_scale_inv")


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / f for f in weight_map.values()})
    elif (path / "model.safetensors").exists():  # plus siblings, e.g. a drafter (tiny train-drafter)
        files = [path / "model.safetensors"] + sorted(set(path.glob("*.safetensors")) - {path / "model.safetensors"})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no .safetensors files in {path}")
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise CheckpointError(f"shards listed in the index are missing: {missing}")
    return files


class Source:
    """Lazy access to every tensor of a checkpoint by name."""

    def __init__(self, files: list[Path]):
        self.fp8_block = (128, 128)
        self.files = files
        self._handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
        self.where: dict[str, int] = {}
        for i, h in enumerate(self._handles):
            for k in h.keys():
                self.where[k] = i

    def _handle(self, name: str):
        i = self.where[name]
        if self._handles[i] is None:  # released, and asked again (a scale kept in another shard)
            self._handles[i] = safe_open(str(self.files[i]), framework="pt", device="cpu")
        return self._handles[i]

    def release(self, file_index: int) -> None:
        """Unmap one shard. Its pages count in the process's resident set while it is mapped, so a
        reader that kept every shard open until the end peaked at twice the model (7.8 GB for a 3.7 GB
        checkpoint: the copies plus the mapped files)."""
        self._handles[file_index] = None

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The safetensors dtype string (``F32``, ``F8_E4M3``, ``F4``, ``I8``...)."""
        return self._handle(name).get_slice(name).get_dtype()

    def logical_shape(self, name: str) -> tuple[int, ...]:
        """The unpacked shape: FP4 codes in int8/uint8 bytes with a block scale hold two inputs per
        byte (safetensors' own ``F4`` already counts 4-bit values)."""
        shape = self.shape(name)
        if shape and self.dtype(name) in ("I8", "U8") and scale_name(self, name) is not None:
            return shape[:-1] + (2 * shape[-1],)
        return shape


def scaled_weight(src: Source, name: str) -> str | None:
    """The weight that ``name`` is the block scale of, if it is one (``attn_hc.scale`` is not)."""
    for suffix in _SCALE_SUFFIXES:
        if name.endswith(suffix):
            base = name[: -len(suffix)]
            for weight in (base + ".weight", base):
                if weight != name and weight in src.where:
                    return weight
    return None


def scale_name(src: Source, weight_name: str) -> str | None:
    base = weight_name[: -len(".weight")] if weight_name.endswith(".weight") else weight_name
    for suffix in _SCALE_SUFFIXES:
        if base + suffix in src.where:
            return base + suffix
    return None


def stored_kind(src: "Source", name: str, hf: str, dtype: torch.dtype) -> str | None:
    """How tensor ``name`` stays at its stored width under model dtype ``dtype`` (None: it does not):
    "fp8" (codes and block scales), "bf16" (the LM head) or "bf16 table" (the embedding). Only where the
    model computes in fp32 on the host: there the native forward reads these formats directly."""
    if dtype != torch.float32:
        return None
    kind = src.dtype(name)
    if kind == "F8_E4M3" and scale_name(src, name) is not None and len(src.shape(name)) == 2:
        return "fp8"
    if kind == "BF16" and hf == "lm_head.weight":
        return "bf16"
    if kind == "BF16" and hf == "model.embed_tokens.weight":
        return "bf16 table"
    return None


def stored_loader(src: "Source", name: str, kind: str, device) -> Callable[[], StoredWeight | torch.Tensor]:
    """Tensors kept at their stored width are not copied on the host: they stay views of the mapped
    checkpoint (read-only pages the kernel shares with the page cache, as llama.cpp maps its GGUF), so
    loading them costs nothing and they are resident once, not once mapped and once copied. Nothing
    writes to them; only the native forward and the torch path's dequantisers read them."""
    def load() -> StoredWeight | torch.Tensor:
        t = src.get(name)
        if torch.device(device).type != "cpu":
            t = t.to(device=device, copy=True)
        if kind == "bf16 table":
            return t
        if kind == "bf16":
            return StoredWeight("bf16", t, name=name)
        codes = t.view(torch.uint8)
        scales = src.get(scale_name(src, name)).float().to(device)
        if not bool(torch.isfinite(scales).all()) or bool((scales <= 0).any()):
            raise CheckpointError(f"FP8 tensor {name} has block scales that are not positive finite numbers")
        if bool(((codes & 0x7F) == 0x7F).any()):
            raise CheckpointError(f"FP8 tensor {name} holds NaN codes (0x7f / 0xff): the weights are corrupt")
        (b0, b1), (rows, cols) = src.fp8_block, codes.shape
        if tuple(scales.shape) != (-(-rows // b0), -(-cols // b1)):
            raise CheckpointError(f"{name}: scale shape {list(scales.shape)} does not fit weight {[rows, cols]} with "
                                  f"block {[b0, b1]} (set quantization_config.weight_block_size)")
        return StoredWeight("fp8", codes, scales.contiguous(), src.fp8_block, name)

    return load
