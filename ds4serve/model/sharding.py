"""Tensor and expert parallel: which slice of each weight a rank holds, and the modules set to match.

DS4 attention has many query heads but a single K=V head, and its compressor and indexer rows belong
to the sequence, not to a head. So under tensor parallel (TP) over ``world`` ranks:

* query heads split: ``q_b_proj`` rows and ``sinks`` by head, ``o_a_proj`` rows and ``o_b_proj``
  columns by output group (a group owns a contiguous run of heads); each rank's ``o_b_proj`` gives a
  partial sum of the attention output;
* the shared expert's intermediate width splits (gate / up rows, down columns): a partial sum;
* routed experts split their intermediate width the same way (TP), or, with ``expert_parallel``,
  each rank holds ``E / world`` whole experts and computes only the pairs routed to them (EP);
* everything per sequence or per token stays replicated: ``kv_proj``, the compressors and indexers,
  norms, mHC, embeddings, the router and the LM head. Every rank computes them and keeps the same
  KV / compressed state, so no collective is needed for state, and each rank's cache bookkeeping
  matches rank 0's exactly (``engine.parallel_executor`` relies on that).

Two all-reduces per layer (after attention, after the MoE) add the partial sums; ``reduce`` is that
collective, given by the caller, so this module knows nothing of process groups.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..config import ModelConfig

# name suffix -> (dim to split, number of equal halves that split separately); TP rules
_TP_RULES = {
    ".self_attn.q_b_proj.weight": (0, 1), ".self_attn.sinks": (0, 1), ".self_attn.o_a_proj.weight": (0, 1),
    ".self_attn.o_b_proj.weight": (1, 1), ".mlp.shared_experts.gate_proj.weight": (0, 1),
    ".mlp.shared_experts.up_proj.weight": (0, 1), ".mlp.shared_experts.down_proj.weight": (1, 1),
    ".mlp.experts.gate_up_proj": (1, 2), ".mlp.experts.down_proj": (2, 1),
}
_EP_RULES = {".mlp.experts.gate_up_proj": (0, 1), ".mlp.experts.down_proj": (0, 1)}


@dataclass(frozen=True)
class ShardPlan:
    """Rank ``rank`` of ``world``; ``expert_parallel`` puts whole routed experts on ranks."""

    rank: int
    world: int
    expert_parallel: bool = False

    def problems(self, cfg: ModelConfig) -> list[str]:
        """What makes ``cfg`` unsplittable ``world`` ways (empty: it splits)."""
        n, out = self.world, []
        need = {"attention heads": cfg.num_heads, "output groups (o_groups)": cfg.o_groups,
                "shared expert width": cfg.moe_intermediate_size * cfg.n_shared_experts}
        need["routed experts" if self.expert_parallel else "expert intermediate size"] = (
            cfg.n_routed_experts if self.expert_parallel else cfg.moe_intermediate_size)
        for what, size in need.items():
            if size % n:
                out.append(f"{what} ({size}) is not divisible by tensor-parallel-size {n}")
        return out

    def rule(self, name: str) -> tuple[int, int] | None:
        """(dim, halves) to split ``name`` by, or None when every rank holds all of it."""
        if self.world == 1:
            return None
        for rules in ((_EP_RULES, _TP_RULES) if self.expert_parallel else (_TP_RULES,)):
            for suffix, r in rules.items():
                if name.endswith(suffix):
                    return r
        return None

    def local_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        r = self.rule(name)
        if r is None:
            return tuple(shape)
        out = list(shape)
        out[r[0]] //= self.world
        return tuple(out)

    def ranges(self, name: str, size: int) -> list[tuple[int, int]] | None:
        """This rank's index ranges along the split dim of a tensor of ``size`` there (concatenated)."""
        r = self.rule(name)
        if r is None:
            return None
        half = size // r[1]
        part = half // self.world
        return [(h * half + self.rank * part, h * half + (self.rank + 1) * part) for h in range(r[1])]

    def expert_range(self, cfg: ModelConfig) -> tuple[int, int] | None:
        if not self.expert_parallel or self.world == 1:
            return None
        per = cfg.n_routed_experts // self.world
        return self.rank * per, (self.rank + 1) * per

    def take(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full tensor ``t`` named ``name`` (``t`` itself when replicated)."""
        r = self.rule(name)
        if r is None:
            return t
        pieces = [t.narrow(r[0], a, b - a) for a, b in self.ranges(name, t.shape[r[0]])]
        return (pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=r[0])).contiguous()


def shard_model(model: nn.Module, plan: ShardPlan, reduce: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
    """Make ``model`` (a ``DS4ForCausalLM``, on the meta device before loading or already loaded)
    this rank's part: split parameters are replaced by their slices, attention and MoE modules learn
    their local head / group counts and expert range, and sum partial outputs with ``reduce``."""
    cfg: ModelConfig = model.cfg
    problems = plan.problems(cfg)
    if problems:
        raise ValueError("cannot split this model: " + "; ".join(problems))
    if plan.world == 1:
        return
    for name, param in list(model.named_parameters()):
        if plan.rule(name) is None:
            continue
        module = model.get_submodule(name.rsplit(".", 1)[0])
        attr = name.rsplit(".", 1)[1]
        sliced = plan.take(name, param.data)
        setattr(module, attr, nn.Parameter(sliced, requires_grad=False))
    for layer in model.model.layers:
        layer.self_attn.n_heads = cfg.num_heads // plan.world
        layer.self_attn.o_groups = cfg.o_groups // plan.world
        layer.self_attn.reduce = reduce
        layer.mlp.expert_range = plan.expert_range(cfg)
        layer.mlp.reduce = reduce
