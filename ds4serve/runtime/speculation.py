"""``--speculative-config`` resolved against the checkpoint and the engine (issue 28).

Three drafters: n-gram prompt lookup for any model (``scheduler/drafting.py`` proposes), and the
checkpoint's own, DSpark's three-stage block drafter or the serial MTP block, loaded from its ``mtp.*``
tensors (``model/dspark_weights.py``, ``model/mtp_weights.py``: missing, malformed or unhandled tensors
stop start-up with an error naming them) and run by the engine with every step
(``engine/model_drafts.py``). Drafts are verified exactly in the batched step, the rejected tail undone in
the rings (``cache/draft_rows.py``), and their length budgeted by load. ``auto`` runs the drafter the
checkpoint ships, and says so; a method the checkpoint cannot run is a start-up error, never a silent
fallback. Under tensor parallelism rank 0 samples and verifies, and every rank rolls back the rejected rows
(agreed in one all-reduce: ``Collectives.agree``); a checkpoint drafter runs whole on rank 0, which reads the
target's full hidden rows after their all-reduces (DSpark's target layers, MTP's last layer; the drafter's own
weights are not sharded, and its own layers reduce nothing).
"""

from __future__ import annotations

import logging

from pathlib import Path

from ..cache.draft_rows import max_draft
from ..cache.manager import CacheManager
from ..config import ConfigError, ModelConfig
from ..engine.checkpoint_drafters import MTPDrafts, dspark_drafts
from ..engine.model_drafts import ModelDrafts
from ..model.checkpoint import Source, checkpoint_files
from ..model.dspark_weights import detect_drafter, load_dspark
from ..model.mtp_weights import load_mtp
from ..scheduler.drafting import DraftPolicy
from ..settings import SpeculativeConfig

log = logging.getLogger(__name__)

# ``auto``'s draft lengths: DSpark's whole block (it was trained at that width, ds4-speculative.md §5.4;
# the load budget shortens it), and vLLM's Flash recipe for the serial MTP block (§2.3)
AUTO_TOKENS = {"dspark": 16, "mtp": 2}


def draft_policy(cfg: ModelConfig, spec: SpeculativeConfig | str | None, cache: CacheManager,
                 tensor_parallel: bool = False, *, checkpoint: Path | None = None, model=None,
                 executor=None) -> DraftPolicy | None:
    """The scheduler's drafter for ``spec`` (None: no speculative decoding), or a ConfigError naming what
    this checkpoint or this engine cannot do. A checkpoint drafter needs the ``checkpoint`` folder, the
    loaded target ``model`` (its embedding and head are shared) and the ``executor`` that runs it."""
    if spec is None:
        return None
    if spec == "auto":
        found = _found_drafter(cfg, checkpoint)
        if found is None:
            log.info("speculative decoding off: the checkpoint ships no drafter (n-gram lookup runs on any model: "
                     "--speculative-config '{\"method\": \"ngram\"}')")
            return None
        log.info("speculative decoding auto: the checkpoint ships a %s drafter", found)
        spec = SpeculativeConfig(method=found, num_speculative_tokens=AUTO_TOKENS[found])
    if tensor_parallel and spec.method in ("dspark", "mtp"):
        log.info("speculative decoding under tensor parallelism: the %s drafter runs whole on rank 0 (its own "
                 "weights unsharded there; the embedding and head it shares are replicated on every rank)",
                 "DSpark" if spec.method == "dspark" else "MTP")
    room = max_draft(cache.state)
    if room < 1:
        raise ConfigError("--speculative-config: this model's smallest state ring has no room for a draft")
    if spec.method != "ngram":
        return _checkpoint_policy(cfg, spec, cache, room, checkpoint, model, executor)
    k = _fit_k(spec.num_speculative_tokens, room)
    policy = DraftPolicy(k=k, min_n=spec.prompt_lookup_min, max_n=spec.prompt_lookup_max,
                         window=spec.prompt_lookup_window, max_rows=room, vocab_size=cfg.vocab_size,
                         share=spec.draft_share)
    log.info("speculative decoding: n-gram drafts of up to %d tokens (suffixes of %d-%d tokens in the last %d), "
             "verified exactly; drafts take at most %.0f%% of a step's calibrated spare rows",
             k, policy.min_n, policy.max_n, policy.window, 100 * policy.share)
    return policy


def _fit_k(k: int, room: int) -> int:
    if k > room:
        log.warning("speculative decoding: num_speculative_tokens %d lowered to %d (the smallest state ring of "
                    "this model undoes at most %d drafted rows)", k, room, room)
    return min(k, room)


def _found_drafter(cfg: ModelConfig, checkpoint: Path | None) -> str | None:
    """"dspark", "mtp" or None: what the checkpoint's tensors and config carry."""
    if checkpoint is None:
        return None
    return detect_drafter(cfg, Source(checkpoint_files(checkpoint)).where)


def _checkpoint_policy(cfg: ModelConfig, spec: SpeculativeConfig, cache: CacheManager, room: int,
                       checkpoint: Path | None, model, executor) -> DraftPolicy:
    """Load the checkpoint's drafter, hand it to the executor, and budget its blocks like n-gram drafts."""
    if checkpoint is None or model is None or executor is None or not hasattr(executor, "use_drafter"):
        raise ConfigError(f"--speculative-config method {spec.method!r} needs a checkpoint loaded with its model "
                          "(this engine has none to draft with)")
    if spec.method == "dspark":
        weights = load_dspark(checkpoint, cfg, device=cache.state.device)
        drafter = dspark_drafts(weights, model, cache.n_slots, getattr(executor, "host", None) is not None)
        what = (f"DSpark: {weights.config.n_stages} stages, blocks of {drafter.block}, target layers "
                f"{list(weights.config.target_layer_ids)}")
    else:
        mtp = load_mtp(checkpoint, model)
        if mtp is None:
            raise ConfigError(f"--speculative-config method 'mtp': the checkpoint {checkpoint} has no MTP block "
                              "(mtp.0.e_proj / h_proj tensors)")
        drafter = MTPDrafts(mtp, _fit_k(spec.num_speculative_tokens, room))
        what = f"MTP: {drafter.block} chained steps"
    executor.use_drafter(ModelDrafts(drafter, spec.acceptance))
    k = _fit_k(min(spec.num_speculative_tokens, drafter.block), room)
    log.info("speculative decoding: the checkpoint's %s; up to %d drafted tokens verified a step, exactly; drafts "
             "take at most %.0f%% of a step's calibrated spare rows", what, k, 100 * spec.draft_share)
    return DraftPolicy(k=k, min_n=1, max_n=1, window=1, max_rows=room, vocab_size=cfg.vocab_size,
                       share=spec.draft_share, source="model", confidence=spec.confidence_threshold,
                       forced=spec.acceptance == "coupled", follow_window=drafter.keep_rows)
