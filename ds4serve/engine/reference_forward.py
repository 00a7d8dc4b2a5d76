"""The torch reference forward over the engine's state, outside any step (``LLM.reference``).

``ReferenceForward`` runs one flattened forward of the torch model for a list of ``SeqChunk``s: build
the view, embed, run the layer stack, and return logits for every row or for each chunk's last row.
Serving never calls it (steps go through ``executor.Executor``, which may run the native host forward);
tests and ``LLM.prompt_logits(engine=False)`` use it as the reference the executor is checked against.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..cache import ModelState, SeqChunk, build_view
from ..config import ModelConfig
from ..model import DS4ForCausalLM


class ReferenceForward:
    def __init__(self, cfg: ModelConfig, model: DS4ForCausalLM, state: ModelState):
        self.cfg = cfg
        self.model = model
        self.state = state
        self.device = state.device

    @torch.inference_mode()
    def forward(self, chunks: Sequence[SeqChunk], all_logits: bool = False) -> torch.Tensor:
        """Logits ``[T, V]`` for every token (``all_logits``) or ``[S, V]`` for each chunk's last token."""
        view = build_view(self.state.layout, self.state.n_slots, chunks, self.device)
        streams = self.model.embed(view)
        streams = self.model.forward_layers(streams, view, self.state.layers)
        if not all_logits:
            last = torch.cumsum(torch.tensor([len(c) for c in chunks]), 0) - 1
            streams = streams.index_select(0, last.to(self.device))
        return self.model.logits(streams)
