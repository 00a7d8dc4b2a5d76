"""What a loaded model holds and what one decoded token reads: bytes per weight class.

Why: at DS4-Flash's widths decode is bound by memory traffic, not arithmetic. A step of one stream
reads every weight it multiplies once (the attention and compressor projections, the shared experts,
mHC, the router, the whole LM head), one row of the embedding, and only the routed experts it is sent
to (``top_k`` of ``n_routed_experts`` per layer, on average). Those bytes over the machine's measured
read bandwidth are the fastest a single stream can decode (the roofline ``bench engine`` prints), and
the load log names what each class holds, in the form it is held (fp32 after dequantisation, packed
MXFP4, ...), so "why is this slow / big" has a number to start from.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..config import ModelConfig
from .packed import PackedExperts
from .stored import StoredWeight

# (class, name fragments that put a tensor in it), first match wins
_CLASSES = (
    ("vision", ("vision_encoder.", "image_")),
    ("embedding", ("embed_tokens",)),
    ("LM head", ("lm_head",)),
    ("routed experts", ("mlp.experts.",)),
    ("shared experts", ("mlp.shared_experts.",)),
    ("router", ("mlp.gate.",)),
    ("compressor + indexer", ("self_attn.compressor.",)),
    ("attention", ("self_attn.",)),
    ("mHC", ("_hc.", "hc_head.")),
    ("norms", ("layernorm", "model.norm.")),
)


def weight_class(name: str) -> str:
    """The class of a parameter, buffer or packed stack by its module path (``other``: RoPE tables ...)."""
    return next((cls for cls, parts in _CLASSES if any(p in name for p in parts)), "other")


@dataclass(frozen=True)
class Footprint:
    held: dict[str, int]  # class -> bytes resident
    per_token: dict[str, int]  # class -> bytes one decoded token of one stream reads
    formats: dict[str, str]  # class -> how it is held ("float32", "mxfp4 packed", ...)

    @property
    def held_total(self) -> int:
        return sum(self.held.values())

    @property
    def per_token_total(self) -> int:
        return sum(self.per_token.values())

    def roofline_tok_s(self, bytes_per_s: float) -> float:
        """The single-stream decode rate if every step only streamed its weights at ``bytes_per_s``."""
        return bytes_per_s / max(1, self.per_token_total)

    def describe(self) -> str:
        parts = [f"{cls} {self.held[cls] / 2**20:.1f} MiB ({self.formats[cls]})"
                 for cls in sorted(self.held, key=self.held.get, reverse=True) if self.held[cls]]
        return (f"weights held {self.held_total / 2**20:.1f} MiB: " + ", ".join(parts)
                + f"; one decoded token reads {self.per_token_total / 2**20:.1f} MiB of them")


def _tensors(model: nn.Module):
    """(name, bytes, format) of every parameter, buffer and packed expert stack."""
    seen: set[int] = set()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.device.type != "meta" and id(t) not in seen:
            seen.add(id(t))
            yield name, t.numel() * t.element_size(), str(t.dtype).removeprefix("torch.")
    for mod_name, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, PackedExperts):
                yield f"{mod_name}.{attr}", value.nbytes, f"{value.fmt} packed"
            elif isinstance(value, StoredWeight):
                yield f"{mod_name}.{attr}", value.nbytes, value.fmt


def footprint(cfg: ModelConfig, model: nn.Module) -> Footprint:
    """Bytes held and read per decoded token, per class (this rank's share under tensor parallel)."""
    held: dict[str, int] = {}
    formats: dict[str, set[str]] = {}
    for name, nbytes, fmt in _tensors(model):
        cls = weight_class(name)
        held[cls] = held.get(cls, 0) + nbytes
        formats.setdefault(cls, set()).add(fmt)
    per_token = {cls: n for cls, n in held.items() if cls not in ("vision", "embedding", "routed experts", "other")}
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if embed is not None and embed.weight.device.type != "meta":
        per_token["embedding"] = embed.weight.shape[1] * embed.weight.element_size()
    if "routed experts" in held:  # top_k of E experts per layer, on average
        per_token["routed experts"] = held["routed experts"] * cfg.n_experts_per_tok // max(1, cfg.n_routed_experts)
    return Footprint(held, per_token, {cls: "/".join(sorted(f)) for cls, f in formats.items()})
