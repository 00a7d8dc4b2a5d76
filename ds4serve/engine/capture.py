"""Hidden states a model drafter reads from the target's forward (speculative decoding, issue 28).

A checkpoint drafter is fed from inside the target: DSpark the outputs of its target layers, averaged
over the hyper-connection copies (``ds4-speculative.md`` §3.3: a plain mean, not ``hc_head``); MTP the
last layer's output with every copy kept (§2.2: the pre-``hc_head`` residual, ``[hc, D]``). Both are a
layer's *output*, so one rule serves them: split the forward after each captured layer and read the
streams there. The split runs the same layers on the same rows in the same order (a forward from a
middle layer is a supported entry of both the native and the torch forward), so the target's results
do not change by a bit when a drafter is on; the captured rows are copies.

``CapturePlan.layers`` are 0-based layer indices whose outputs are captured; a row's capture is their
concatenation in that order: ``[len(layers) * D]`` (``mean_hc``) or ``[len(layers) * hc * D]``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# forward(streams or None (from the embedding), start, stop) -> streams after layer ``stop - 1``
WHOLE = -1  # ``split``'s key for one forward's captures of every layer of the plan, as one matrix
Segment = Callable[[torch.Tensor | None, int, int], torch.Tensor]


@dataclass(frozen=True)
class CapturePlan:
    layers: tuple[int, ...]
    mean_hc: bool  # True: mean over the hc copies (DSpark); False: every copy, flattened (MTP)

    def __post_init__(self) -> None:
        if not self.layers or list(self.layers) != sorted(set(self.layers)):
            raise ValueError(f"capture layers must be distinct and ascending, got {self.layers}")

    def width(self, hc: int, hidden: int) -> int:
        return len(self.layers) * hidden * (1 if self.mean_hc else hc)

    def read(self, streams: torch.Tensor) -> torch.Tensor:
        """One layer's capture of ``streams [T, hc, D]``: ``[T, D]`` or ``[T, hc * D]`` (a copy)."""
        if self.mean_hc:
            return streams.mean(dim=1)
        return streams.reshape(streams.shape[0], -1).clone()

    def run(self, forward: Segment, streams: torch.Tensor | None, start: int, stop: int,
            into: dict[int, torch.Tensor]) -> torch.Tensor:
        """Layers ``[start, stop)`` through ``forward``, split after every captured layer in the range;
        each capture lands in ``into[layer]``. Returns the streams after layer ``stop - 1``."""
        cursor = start
        for layer in self.layers:
            if start <= layer < stop:
                streams = forward(streams, cursor, layer + 1)
                into[layer] = self.read(streams)
                cursor = layer + 1
        if cursor < stop or streams is None:
            streams = forward(streams, cursor, stop)
        return streams

    def within(self, start: int, stop: int) -> tuple[int, ...]:
        """The captured layers inside ``[start, stop)``."""
        return tuple(layer for layer in self.layers if start <= layer < stop)

    def split(self, layers: tuple[int, ...], captured: torch.Tensor, into: dict[int, torch.Tensor]) -> None:
        """``captured [T, len(layers) * W]`` from one forward (``HostForward.forward_captured``) into
        ``into``: under ``WHOLE`` as it is when it holds every layer of the plan (``rows`` returns it: the
        per-layer views and the check that they tile one matrix were ~30 us of every step that follows),
        else ``into[layer]``, views of it, one per layer."""
        if tuple(layers) == self.layers and not into:
            into[WHOLE] = captured
            return
        width = captured.shape[1] // max(1, len(layers))
        for j, layer in enumerate(layers):
            into[layer] = captured[:, j * width:(j + 1) * width]

    def rows(self, into: dict[int, torch.Tensor]) -> torch.Tensor:
        """The captures of one forward, concatenated per row in ``layers`` order (every layer present)."""
        if WHOLE in into and len(into) == 1:
            return into[WHOLE]
        missing = [layer for layer in self.layers if layer not in into]
        if missing:
            raise RuntimeError(f"the forward captured no output of layer(s) {missing}")
        parts = [into[layer] for layer in self.layers]
        if len(parts) == 1:
            return parts[0]
        whole = parts[0]._base  # ``split``'s views of one native forward's matrix: that matrix is the answer
        if (whole is not None and whole.dim() == 2 and whole.is_contiguous() and whole.shape[0] == parts[0].shape[0]
                and whole.shape[1] == sum(p.shape[1] for p in parts)
                and all(p._base is whole and p.storage_offset() == whole.storage_offset() + j * p.shape[1]
                        and p.shape[1] == parts[0].shape[1] for j, p in enumerate(parts))):
            return whole
        return torch.cat(parts, dim=1)
