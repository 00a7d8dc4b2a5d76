"""``--speculative-config`` resolved against the checkpoint and the engine (issue 28).

What runs today is the n-gram (prompt lookup) drafter, for any model: its drafts are verified exactly in
the batched step (``engine/drafted.py``), the rejected tail undone in the rings (``cache/draft_rows.py``),
and its length budgeted by load (``scheduler/drafting.py``). The checkpoint drafters (DSpark's three
stages, the serial MTP block) are not loaded by this build: asking for them is a start-up error that says
so, never a silent fallback, and ``auto`` on a checkpoint that ships one says at WARNING that it is left
unused. Tensor parallelism is refused with drafts: the verify pass's rollback runs on the sampling rank.
"""

from __future__ import annotations

import logging

from ..cache.draft_rows import max_draft
from ..cache.manager import CacheManager
from ..config import ConfigError, ModelConfig
from ..scheduler.drafting import DraftPolicy
from ..settings import SpeculativeConfig

log = logging.getLogger(__name__)


def draft_policy(cfg: ModelConfig, spec: SpeculativeConfig | str | None, cache: CacheManager,
                 tensor_parallel: bool = False) -> DraftPolicy | None:
    """The scheduler's drafter for ``spec`` (None: no speculative decoding), or a ConfigError naming what
    this checkpoint or this engine cannot do."""
    if spec is None:
        return None
    if spec == "auto":
        if cfg.num_nextn_predict_layers:
            log.warning("speculative decoding off: the checkpoint declares %d draft layer(s) (DSpark / MTP), which "
                        "this build does not run yet; the n-gram drafter runs on any checkpoint: "
                        "--speculative-config '{\"method\": \"ngram\"}'", cfg.num_nextn_predict_layers)
        else:
            log.info("speculative decoding off: the checkpoint ships no drafter (n-gram lookup runs on any model: "
                     "--speculative-config '{\"method\": \"ngram\"}')")
        return None
    if spec.method != "ngram":
        raise ConfigError(f"--speculative-config method {spec.method!r}: the checkpoint drafters (DSpark, MTP) are "
                          "not run by this build yet; use {\"method\": \"ngram\"}, or leave speculative decoding off")
    if tensor_parallel:
        raise ConfigError("--speculative-config: drafts are not verified under tensor parallelism yet "
                          "(--tensor-parallel-size 1, or no --speculative-config)")
    room = max_draft(cache.state)
    if room < 1:
        raise ConfigError("--speculative-config: this model's smallest state ring has no room for a draft")
    k = min(spec.num_speculative_tokens, room)
    if k < spec.num_speculative_tokens:
        log.warning("speculative decoding: num_speculative_tokens %d lowered to %d (the smallest state ring of "
                    "this model undoes at most %d drafted rows)", spec.num_speculative_tokens, k, room)
    policy = DraftPolicy(k=k, min_n=spec.prompt_lookup_min, max_n=spec.prompt_lookup_max,
                         window=spec.prompt_lookup_window, max_rows=room, vocab_size=cfg.vocab_size,
                         share=spec.draft_share)
    log.info("speculative decoding: n-gram drafts of up to %d tokens (suffixes of %d-%d tokens in the last %d), "
             "verified exactly; drafts take at most %.0f%% of a step's calibrated spare rows",
             k, policy.min_n, policy.max_n, policy.window, 100 * policy.share)
    return policy
