"""Fault injection for the tensor-parallel tests, run inside a worker process (``worker_hook``).

``raise_on_token``: rank 1's MoE of layer 1 raises on any forward holding token ``MAGIC``: the rank
fails in the middle of a step, after some of the step's all-reduces and before the rest.
"""

from __future__ import annotations

MAGIC = 371  # a byte-pair token of the bundled vocabulary that the other prompts of these tests never hold


def raise_on_token(rank: int, engine) -> None:
    if rank != 1:
        return
    mlp = engine.model.model.layers[1].mlp
    forward = mlp.forward

    def failing(x, view):
        if bool((view.ids == MAGIC).any()):
            raise RuntimeError("injected fault on rank 1")
        return forward(x, view)

    mlp.forward = failing


def raise_on_first_draft(rank: int, engine) -> None:
    """Rank 1 raises once, in layer 1's MoE, on the first forward of 2-5 rows: a decode step verifying a
    draft (the tests' prompts are longer; plain decode steps have one row a sequence)."""
    if rank != 1:
        return
    mlp = engine.model.model.layers[1].mlp
    forward = mlp.forward
    fired = []

    def failing(x, view):
        if not fired and 1 < view.ids.numel() <= 5:
            fired.append(True)
            raise RuntimeError("injected fault on rank 1 in a drafted step")
        return forward(x, view)

    mlp.forward = failing
