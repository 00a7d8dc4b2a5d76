"""``ds4serve info`` and ``ds4serve plan``: what a checkpoint is and what it needs, from its config alone.

Neither loads weights: ``plan`` works on a bare ``config.json`` (e.g. the official DS4-Flash one) so a
user can size hardware before downloading 160 GB.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .settings import PACKED_MODES


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser("plan", help="capacity plan from config.json alone: weights by kind, state per "
                                       "sequence, how many sequences fit, and whether the model fits at all")
    plan.add_argument("--model", type=Path, required=True, help="checkpoint directory or config.json (no weights needed)")
    plan.add_argument("--gpu-memory", "--memory", dest="memory", default="80GiB",
                      help="memory of one device, e.g. 141GiB, 80GB (default 80GiB)")
    plan.add_argument("--max-model-len", type=int, default=None, help="tokens per sequence (default min(model, 8192))")
    plan.add_argument("--dtype", default="bfloat16", help="weights and state dtype (default bfloat16)")
    plan.add_argument("--max-prefill-tokens", type=int, default=1024, help="as serve's flag (sizes staging)")
    plan.add_argument("--packed-experts", nargs="?", const="on", default="auto", choices=PACKED_MODES,
                      help="as serve's flag: routed experts kept packed (auto: only when dequantised ones would not "
                           "fit and packed ones do)")
    plan.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="as serve's flag: the plan per rank")
    plan.add_argument("--enable-expert-parallel", action="store_true", help="as serve's flag: whole experts per rank")


def run_inspect(args) -> int:
    """Exit 0, 3 when the plan does not fit, 2 with a one-line message for a bad config or flag."""
    import sys

    from .config import ConfigError

    try:
        return _info(args) if args.command == "info" else _plan(args)
    except ConfigError as exc:
        print(f"ds4serve {args.command}: {exc}", file=sys.stderr)
        return 2


def _plan(args) -> int:
    from .config import ConfigError, ModelConfig
    from .model import parse_dtype
    from .runtime.capacity import choose_packed_experts, plan_capacity, render_plan
    from .settings import parse_budget

    memory = parse_budget(args.memory)
    if memory is None or memory[0] != "bytes":
        raise ConfigError(f"--gpu-memory {args.memory!r}: give a size, e.g. 141GiB")
    cfg, dtype = ModelConfig.from_file(args.model), parse_dtype(args.dtype)
    # the device is not here (None): "auto" decides on fit alone
    packed, why = choose_packed_experts(args.packed_experts, cfg, dtype, None, args.max_model_len,
                                        args.max_prefill_tokens, args.tensor_parallel_size,
                                        args.enable_expert_parallel, memory=memory[1])
    plan = plan_capacity(cfg, dtype, memory[1], args.max_model_len, args.max_prefill_tokens,
                         packed_experts=packed, tensor_parallel=args.tensor_parallel_size,
                         expert_parallel=args.enable_expert_parallel)
    print(render_plan(plan))
    print(f"routed experts {'kept packed' if packed else 'dequantised at load'} (--packed-experts "
          f"{args.packed_experts}): {why}")
    return 0 if plan.fits else 3


def _info(args) -> int:
    from .cache import StateLayout
    from .config import ModelConfig
    from .model import parse_dtype

    cfg = ModelConfig.from_file(args.model)
    layout = StateLayout.build(cfg, parse_dtype(args.dtype))
    kinds = ", ".join(f"{k.value}:{cfg.attn_kinds.count(k)}" for k in dict.fromkeys(cfg.attn_kinds))
    print(f"model: {args.model}")
    print(f"layers: {cfg.num_layers} ({kinds}); ratios {list(cfg.compress_ratios)}; window {cfg.sliding_window}")
    print(f"hidden {cfg.hidden_size}, heads {cfg.num_heads} x {cfg.head_dim}, experts {cfg.n_routed_experts} "
          f"top-{cfg.n_experts_per_tok}, vocab {cfg.vocab_size}, vision layers {cfg.vision.n_layers}")
    print(f"state per token: {layout.bytes_per_token():.1f} B ({args.dtype} rows)")
    print(f"state per slot (fixed): {layout.bytes_per_slot()} B = {layout.bytes_per_slot() / 2**20:.3f} MiB")
    print(f"page: {layout.page_tokens} tokens = {layout.bytes_per_page()} B")
    return 0
