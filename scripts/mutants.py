"""Mutation probe: do the tests that should guard a behaviour catch a one-line bug in it?

Each mutant replaces one line of the package in a scratch copy of the repository, then runs the
tests named for it there (``PYTHONPATH`` points at the copy). A mutant is *caught* when those tests
fail, and *survives* when they pass: then nothing guards that behaviour. Not part of CI (each
mutant reruns real tests); run it after changing a guarded area:

    python scripts/mutants.py            # all mutants
    python scripts/mutants.py d e        # some of them
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    key: str
    what: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTANTS = [
    Mutant("a", "image spans attend causally only (visibility widening removed)", "ds4serve/cache/view.py",
           "    _widen_spans(g, chunks, lo, hi, window, max_image_tokens)", "    pass",
           ("tests/test_vision_oracles.py",)),
    Mutant("b1", "image tokens ignore bias_vl", "ds4serve/model/moe.py",
           "        sel_img = scores + bias_vl.float()", "        sel_img = sel", ("tests/test_vision_oracles.py",)),
    Mutant("b2", "image tokens routed through the hash table", "ds4serve/model/moe.py",
           "        idx = hashed if is_image is None else torch.where(is_image.unsqueeze(-1), idx, hashed)",
           "        idx = hashed", ("tests/test_vision_oracles.py",)),
    Mutant("c", "sentinel embedding rows swapped (PAD<->NEWLINE, START<->END)", "ds4serve/model/decoder.py",
           "            kinds = (ids - self.cfg.vocab_size).clamp(0, 4)",
           "            kinds = (4 - (ids - self.cfg.vocab_size)).clamp(0, 4)", ("tests/test_vision_oracles.py",)),
    Mutant("d", "a request inside a running pass picked as preemption victim", "ds4serve/scheduler/pressure.py",
           "                   if r.pass_id is None and self.cache.state.pages.owned(r.slot) > 0]",
           "                   if self.cache.state.pages.owned(r.slot) > 0]", ("tests/test_preemption.py",)),
    Mutant("e", "a request that is not recomputable dropped anyway", "ds4serve/scheduler/pressure.py",
           "        elif self.recomputable(victim):", "        elif True:", ("tests/test_preemption.py",)),
    Mutant("f", "validator skips the check that a token's request matches its planned slot",
           "ds4serve/engine/plan.py", "        if expected[tok.slot] != tok.request_id:", "        if False:",
           ("tests/test_step_contract.py",)),
    Mutant("g", "validator skips the 'pass reported no progress' check", "ds4serve/engine/plan.py",
           "    if reported != set(planned_passes):", "    if False:", ("tests/test_step_contract.py",)),
    Mutant("h", "staging sized by the budget alone (no overshoot)", "ds4serve/runtime/sizing.py",
           "    staging = max_chunk_len(s.max_prefill_tokens, s.min_prefill_tokens,",
           "    staging = s.max_prefill_tokens or max_chunk_len(s.max_prefill_tokens, s.min_prefill_tokens,",
           ("tests/test_isolation_engine.py",)),
    Mutant("i", "a failed step fails everyone in it (no undo)", "ds4serve/scheduler/scheduler.py",
           "            if r in alone:", "            if True:", ("tests/test_isolation.py",)),
    Mutant("j", "IMAGE slots without rows not refused", "ds4serve/engine/plan.py",
           "    if len(filled) != len(set(filled)) or set(filled) != slots:", "    if False:",
           ("tests/test_isolation.py",)),
    Mutant("k", "sampling RNG not re-seeded per token (a retried draw differs)", "ds4serve/engine/sampling.py",
           "        self.generator.manual_seed(token_seed(self.base_seed, len(self.output_ids)))", "        pass",
           ("tests/test_sampling.py",)),
    # behaviours first guarded by tests/test_sampling_filters.py, test_prefix_guards.py, test_guarded_behaviours.py
    Mutant("s1", "top_p drops the token whose mass crosses top_p", "ds4serve/engine/sampling.py",
           "before = torch.cumsum(probs_sorted, dim=-1) - probs_sorted", "before = torch.cumsum(probs_sorted, dim=-1)",
           ("tests/test_sampling_filters.py",)),
    Mutant("s2", "top_p keeps one more token when the prefix mass equals top_p", "ds4serve/engine/sampling.py",
           "    drop |= before >= top_p", "    drop |= before > top_p", ("tests/test_sampling_filters.py",)),
    Mutant("s3", "min_p compared with absolute probabilities, not relative to the top token",
           "ds4serve/engine/sampling.py", "    drop |= probs_sorted < min_p * probs_sorted[:, :1]",
           "    drop |= probs_sorted < min_p", ("tests/test_sampling_filters.py",)),
    Mutant("s4", "repetition_penalty ignores the prompt's tokens", "ds4serve/engine/sampling.py",
           "seen = torch.tensor(list(states[i].prompt_ids) + list(states[i].output_ids), dtype=torch.long, device=dev)",
           "seen = torch.tensor(list(states[i].output_ids), dtype=torch.long, device=dev)",
           ("tests/test_sampling_filters.py",)),
    Mutant("s5", "repetition_penalty divides negative logits too (raising them)", "ds4serve/engine/sampling.py",
           "vals = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)",
           "vals = vals / p.repetition_penalty", ("tests/test_sampling_filters.py",)),
    Mutant("s6", "prefix key: an image starting exactly on a key block's first token left out",
           "ds4serve/cache/prefix_keys.py", "if lo <= s < hi]", "if lo < s < hi]",
           ("tests/test_prefix_guards.py::test_a_key_differs_exactly_when_a_differing_image_starts_below_it",
            "tests/test_prefix_guards.py::test_two_pictures_never_share_a_key")),
    Mutant("s7", "a prefix hit may cover the whole input (nothing left to compute)", "ds4serve/scheduler/reuse.py",
           "snap = prefix.lookup(st.keys, req.total_len - 1)", "snap = prefix.lookup(st.keys, req.total_len)",
           ("tests/test_prefix_guards.py::test_resending_a_snapshotted_prompt_leaves_a_token_to_compute",
            "tests/test_prefix_guards.py::test_resending_a_whole_conversation_leaves_a_token_to_compute")),
    Mutant("s8", "grammar: rolled back to just after </think>, the answer grammar turns off",
           "ds4serve/chat/grammar_runtime.py", "self._activated_at > len(self._history)",
           "self._activated_at >= len(self._history)", ("tests/test_guarded_behaviours.py",)),
    Mutant("s9", "DSML stream: whitespace held from an earlier chunk lost by a whitespace-only chunk",
           "ds4serve/chat/dsml_stream.py", "self.ws += text[len(body):]", "self.ws = text[len(body):]",
           ("tests/test_guarded_behaviours.py",)),
    Mutant("s10", "loop admits one request over max_seqs + max_queue (refused only later, by the engine)",
           "ds4serve/runtime/loop.py",
           "if self._in_flight >= self.limits.max_queue + self.core.resolved.max_seqs:",
           "if self._in_flight > self.limits.max_queue + self.core.resolved.max_seqs:",
           ("tests/test_guarded_behaviours.py",)),
    Mutant("s11", "scheduler bounds only its waiting deque (a burst is refused while slots are free)",
           "ds4serve/scheduler/scheduler.py", "if self.in_flight >= self.cache.n_slots + self.limits.max_queue:",
           "if len(self.waiting) >= self.limits.max_queue:", ("tests/test_guarded_behaviours.py",)),
    Mutant("s12", "scheduler admits one request over max_seqs + max_queue", "ds4serve/scheduler/scheduler.py",
           "if self.in_flight >= self.cache.n_slots + self.limits.max_queue:",
           "if self.in_flight > self.cache.n_slots + self.limits.max_queue:", ("tests/test_guarded_behaviours.py",)),
    Mutant("s13", "isolation: a suspect cleared as soon as it computed anything", "ds4serve/scheduler/scheduler.py",
           "req.computed >= req.clear_at", "req.computed > 0", ("tests/test_guarded_behaviours.py",)),
    Mutant("s14", "isolation: a suspect cleared one token before it passed its failed step",
           "ds4serve/scheduler/scheduler.py", "req.clear_at = max(req.clear_at, end)",
           "req.clear_at = max(req.clear_at, end - 1)", ("tests/test_guarded_behaviours.py",)),
    Mutant("s15", "torch forward: in-chunk captures read the sliding ring after this forward's writes",
           "ds4serve/model/decoder.py",
           "        if view.captures and st.snap:\n"
           "            capture_ring(view.captures.get(cfg.sliding_window), st.snap.get(\"swa\"), st.swa, kv)\n"
           "        st.swa.index_copy_(0, view.swa_dst, kv.index_select(0, view.swa_src))\n",
           "        st.swa.index_copy_(0, view.swa_dst, kv.index_select(0, view.swa_src))\n"
           "        if view.captures and st.snap:\n"
           "            capture_ring(view.captures.get(cfg.sliding_window), st.snap.get(\"swa\"), st.swa, kv)\n",
           ("tests/test_prefix_guards.py::test_a_capture_inside_a_chunk_is_the_cold_state_cut_there",)),
    Mutant("s16", "torch forward: in-chunk captures read the compressor rings after this forward's writes",
           "ds4serve/model/decoder.py",
           "                capture_ring(view.captures.get(self.ratio * (2 if self.overlap else 1)), "
           "snap, ring, states)\n"
           "            ring.index_copy_(0, ci.ring_dst, states.index_select(0, ci.ring_src))\n",
           "                ring.index_copy_(0, ci.ring_dst, states.index_select(0, ci.ring_src))\n"
           "                capture_ring(view.captures.get(self.ratio * (2 if self.overlap else 1)), "
           "snap, ring, states)\n"
           "            if not view.captures:\n"
           "                ring.index_copy_(0, ci.ring_dst, states.index_select(0, ci.ring_src))\n",
           ("tests/test_prefix_guards.py::test_a_capture_inside_a_chunk_is_the_cold_state_cut_there",)),
    # the native host forward (model/csrc): each guarded by its comparison with the torch path
    Mutant("n1", "native: image tokens ignore bias_vl", "ds4serve/model/csrc/host_layers.c",
           "            const float *bias = image ? L->bias_vl : L->gate_bias;",
           "            const float *bias = L->gate_bias;", ("tests/test_host_forward.py",)),
    Mutant("n2", "native: sentinel rows swapped (PAD -> NEWLINE)", "ds4serve/model/csrc/host_forward.c",
           "            row = sentinel[kind];  /* NULL for IMAGE slots: zero until their aligner row lands */",
           "            row = sentinel[kind == 1 ? 3 : kind];", ("tests/test_host_forward.py",)),
    Mutant("n3", "native: prefill reads the sliding ring after this forward's writes", "ds4serve/model/csrc/host_layers.c",
           "    Keys k0 = {L->swa, s->kv, NULL, after ? INT64_MAX : L->swa_rows,",
           "    Keys k0 = {L->swa, s->kv, NULL, INT64_MAX,", ("tests/test_host_forward.py",)),
    Mutant("n4", "native: a CSA window pools the 'a' halves only (overlap ignored)", "ds4serve/model/csrc/host_layers.c",
           "                int64_t ch = cv->overlap && q >= ratio ? od + ch0 : ch0;",
           "                int64_t ch = ch0;", ("tests/test_host_forward.py",)),
    Mutant("n5", "native: the pool's caller stops waiting before every claimed chunk is done",
           "ds4serve/model/csrc/host_pool.c",
           "    for (int spins = 0; atomic_load(&p->done) < chunks; spins++) {",
           "    for (int spins = 0; 0; spins++) {", ("tests/test_host_forward.py",)),
    Mutant("n6", "native MXFP4 experts: the even inputs read from the high nibbles (AVX-512 decode)",
           "ds4serve/model/csrc/host_packed.c", "    w[0] = (vf)_mm512_permutexvar_ps(b, lut);",
           "    w[0] = (vf)_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lut);", ("tests/test_host_packed.py",)),
    Mutant("n7", "native MXFP4 experts: inputs not reordered to the decode's order",
           "ds4serve/model/csrc/host_packed.c",
           "            memcpy(blk, t, sizeof t);", "            (void)t;", ("tests/test_host_packed.py",)),
    Mutant("n8", "native MXFP4 experts: the second part (up) read from the first (gate)",
           "ds4serve/model/csrc/host_packed.c", "    int p = n >= q->rows[0];", "    int p = 0;",
           ("tests/test_host_packed.py",)),
    Mutant("n9", "native few-row product: one weight row's term rounded differently (a few ulps)",
           "ds4serve/model/csrc/host_kernels.c", "acc = vfma(a[i][2], b2, acc);",
           "acc = vfma(a[i][2], b2, acc) + a[i][3] * b3 - a[i][3] * b3;",
           ("tests/test_host_forward.py", "tests/test_host_packed.py")),
    Mutant("n10", "native 6-row tiles: a later block of weight rows starts from zero, not the stored sums",
           "ds4serve/model/csrc/host_kernels.c", "j->y + m0 * j->ldy + n0, j->ldy, k0 > 0);",
           "j->y + m0 * j->ldy + n0, j->ldy, 0);", ("tests/test_host_forward.py",)),
    Mutant("n11", "native contraction: the few-row panels multiply, then add, where the tiles fuse",
           "ds4serve/model/csrc/host_kernels.c", "acc = vfma(a[i][0], b0, acc);",
           "acc = acc + a[i][0] * b0;", ("tests/test_host_forward.py",)),
    Mutant("q1", "int8 experts: the -12 x sum(q) correction of the unsigned weights dropped (AVX-512 VNNI)",
           "ds4serve/model/csrc/host_q8.c", "__m512i d0 = _mm512_set1_epi32(corr[b]), d1 = _mm512_setzero_si512();",
           "__m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();", ("tests/test_host_q8.py",)),
    Mutant("q2", "int8 experts: activations truncated instead of rounded to nearest",
           "ds4serve/model/csrc/host_q8.c", "int32_t t = bad ? 0 : (int32_t)nearbyintf(v[i] * id);",
           "int32_t t = bad ? 0 : (int32_t)(v[i] * id);", ("tests/test_host_q8.py",)),
    Mutant("q3", "int8 experts: the load-time C interleave swaps the low and high nibbles",
           "ds4serve/model/csrc/host_q8.c", "dst[r] = (uint8_t)(lo | hi << 4);", "dst[r] = (uint8_t)(hi | lo << 4);",
           ("tests/test_host_q8.py",)),
    Mutant("q4", "int8 experts: the SwiGLU rows quantised with the wrong row stride",
           "ds4serve/model/csrc/host_layers.c", "q8_quantize(s->h + a * 2 * I, 2 * I, n, I, s->hq + a * lh, lh);",
           "q8_quantize(s->h + a * 2 * I, I, n, I, s->hq + a * lh, lh);", ("tests/test_host_q8.py",)),
    Mutant("r1", "bf16 head: ties rounded away from zero, not to even",
           "ds4serve/model/csrc/host_pairs.c", "b += 0x7FFFu + ((b >> 16) & 1u);", "b += 0x8000u;",
           ("tests/test_host_pairs.py",)),
    Mutant("r2", "bf16 head: the emulation adds the even pair first (AVX-512F, AVX2, plain C builds)",
           "ds4serve/model/csrc/host_pairs.c",
           "acc = p16_flush(fma16(p16_as_f(x & 0xFFFF0000u), p16_flush(p16_as_f(w & 0xFFFF0000u)), acc));",
           "acc = p16_flush(fma16(p16_as_f(x << 16), p16_flush(p16_as_f(w << 16)), acc)); x = x << 16 | x >> 16; w = w << 16 | w >> 16;",
           ("tests/test_host_pairs.py",)),
    Mutant("r3", "bf16 head: subnormal sums kept (no flush to zero) in the scalar tail",
           "ds4serve/model/csrc/host_pairs.c", "    if ((b & 0x7F800000u) == 0) b &= 0x80000000u;", "",
           ("tests/test_host_pairs.py",)),
    Mutant("r4", "bf16 head: the forward passes the fp32 rows to the pair kernel's head unrounded",
           "ds4serve/model/csrc/host_forward.c", "        p16_round_rows(h, D, N, D, hb);",
           "        for (int64_t i = 0; i < N * D; i++) hb[i] = (uint16_t)(((uint32_t *)h)[i] >> 16);",
           ("tests/test_host_pairs.py",)),
    Mutant("r5", "bf16 head tile: every output of a tile multiplies the first output's weight row",
           "ds4serve/model/csrc/host_pairs.c", "b[j] = p16_load(row[j] + 2 * k);", "b[j] = p16_load(row[0] + 2 * k);",
           ("tests/test_host_pairs.py",)),
    Mutant("r6", "bf16 head tile: every row of a tile multiplies the first row's inputs",
           "ds4serve/model/csrc/host_pairs.c", "u16x a = p16_load(x + i * ldx + k);", "u16x a = p16_load(x + k);",
           ("tests/test_host_pairs.py",)),
    Mutant("c1", "draft cost rule: the joint fit only (drafting steps' own cost spread over b again)",
           "ds4serve/scheduler/step_costs.py", "        apart = self._fit_apart(w)", "        apart = None",
           ("tests/test_step_costs.py",)),
    Mutant("n12", "native bounds: the compressed rows a query attends are not checked against the pool",
           "ds4serve/model/csrc/host_layers.c",
           '    BOUND("compressed pool row attended", k->crows[i - k->Kw], k->pool_rows);', "",
           ("tests/test_native_bounds.py",)),
    Mutant("n13", "native bounds: an expert id from the hash table is not checked",
           "ds4serve/model/csrc/host_layers.c", '                BOUND("tid2eid expert id", idx[j], E);', "",
           ("tests/test_native_bounds.py",)),
    Mutant("f1", "native FP8 (AVX2 decode): a negative code's sign-extension bit 27 left set",
           "ds4serve/model/csrc/host_stored.c", "_mm256_set1_epi32((int)0x87F00000u)",
           "_mm256_set1_epi32((int)0x8FF00000u)", ("tests/test_stored_weights.py",)),
    Mutant("f2", "native FP8: every output block takes the first block's scale",
           "ds4serve/model/csrc/host_stored.c", "        muls[j] = w->scales[nb * w->sld + kb] * FP8_BIAS;",
           "        muls[j] = w->scales[kb] * FP8_BIAS;", ("tests/test_stored_weights.py",)),
    Mutant("f3", "native FP8: the eight-row pass adds its rows last to first (other bits than the fp32 kernel)",
           "ds4serve/model/csrc/host_stored.c",
           "for (int q = 0; q < 8; q++) acc = vfma(a[i][q], b[q], acc);",
           "for (int q = 7; q >= 0; q--) acc = vfma(a[i][q], b[q], acc);",
           ("tests/test_stored_weights.py",)),
    Mutant("f4", "native bf16 head: half-widths widened one bit short", "ds4serve/model/csrc/host_stored.c",
           "    vu bits = widen_u16(p) << 16;", "    vu bits = widen_u16(p) << 15;", ("tests/test_stored_weights.py",)),
    Mutant("f5", "load: NaN FP8 codes accepted", "ds4serve/model/checkpoint.py",
           "        if bool(((codes & 0x7F) == 0x7F).any()):", "        if False:", ("tests/test_stored_weights.py",)),
    Mutant("f6", "capacity: stored FP8 weights planned without their block scales", "ds4serve/model/weights.py",
           "            out[hf] = n + 4 * -(-rows // fp8_block[0]) * -(-cols // fp8_block[1])",
           "            out[hf] = n", ("tests/test_stored_weights.py",)),
    Mutant("f7", "FP8 decode at load: padded [in, out] codes read as dense (the row stride ignored)",
           "ds4serve/model/csrc/kernels.c", "        const unsigned char *c = codes + r * ld;",
           "        const unsigned char *c = codes + r * cols;", ("tests/test_kn_layout.py",)),
    Mutant("f8", "native FP8 many-row tile: every register group writes the first group's rows",
           "ds4serve/model/csrc/host_stored.c",
           "f8_mstep_##G##_##NV(xk + i0 * ldx, ldx, xs + i0 * F8_MG, p, ld, muls, fold, y + i0 * ldy, ldy);",
           "f8_mstep_##G##_##NV(xk + i0 * ldx, ldx, xs + i0 * F8_MG, p, ld, muls, fold, y, ldy);",
           ("tests/test_stored_weights.py",)),
    # speculative decoding (issue 28)
    Mutant("p1", "drafts: the ring rows of rejected draft positions are not put back", "ds4serve/engine/executor.py",
           "            saved.restore(counts if self.agree is None else self.agree(counts))", "            pass",
           ("tests/test_spec_decode.py",)),
    Mutant("p2", "drafts: only the sliding ring is rolled back (compressor rings and the CSA overlap half not)",
           "ds4serve/cache/draft_rows.py", 'RINGS = ("swa", "comp_ring", "idx_ring")', 'RINGS = ("swa",)',
           ("tests/test_spec_decode.py",)),
    Mutant("p3", "drafts: a draft accepted whatever the target drew", "ds4serve/engine/drafted.py",
           "    while j < len(draft) and draws[j].ok and draws[j].token == draft[j]:",
           "    while j < len(draft) and draws[j].ok:", ("tests/test_spec_decode.py",)),
    Mutant("p4", "drafts: every verify row drawn with the first row's history and seed index",
           "ds4serve/engine/drafted.py",
           "    return [state] + [SamplerState(state.params, state.prompt_ids, _Extended(state.output_ids, draft[:i]),",
           "    return [state] + [SamplerState(state.params, state.prompt_ids, state.output_ids,",
           ("tests/test_spec_decode.py",)),
    Mutant("p5", "drafts: the scheduler advances a decoder by one whatever it accepted",
           "ds4serve/scheduler/scheduler.py", "            req.computed += 1 + accepted.get(d.slot, 0)",
           "            req.computed += 1", ("tests/test_spec_decode.py",)),
    Mutant("p6", "drafts: the validator lets an accepted run that is not the draft's prefix through",
           "ds4serve/engine/plan.py",
           "        if tok.accepted and tok.accepted != drafts.get(tok.slot, ())[:len(tok.accepted)]:",
           "        if False:", ("tests/test_spec_decode.py",)),
    Mutant("p7", "rejection sampling: the residual drawn from p instead of max(p - q, 0)",
           "ds4serve/engine/spec_verify.py", "    r = (p - q).clamp(min=0)", "    r = p.clone()",
           ("tests/test_spec_verify.py",)),
    Mutant("p8", "drafts: the draft budget ignores the measured step costs", "ds4serve/scheduler/drafting.py",
           "            probe = not req.draft_rate > bar",
           "            probe = False",
           ("tests/test_spec_decode.py", "tests/test_step_costs.py")),
    Mutant("p9", "checkpoint drafter: its state fed every drafted row, the rejected tail too",
           "ds4serve/engine/executor.py",
           "        kept = {d.slot: 1 + len(ok[d.slot].accepted) if d.slot in ok else 0 for d in decodes}",
           "        kept = {d.slot: 1 + len(d.draft) if d.slot in ok else 0 for d in decodes}",
           ("tests/test_model_draft_engine.py::test_accepted_drafts_leave_greedy_output_unchanged",)),
    Mutant("p10", "checkpoint drafter: the confidence threshold ignored (whole blocks verified)",
           "ds4serve/scheduler/drafting.py",
           "        sure = next((i for i, s in enumerate(req.proposal_survival) if s < self.confidence),",
           "        sure = next((i for i, s in enumerate(req.proposal_survival) if False),",
           ("tests/test_model_draft_engine.py::test_the_confidence_threshold_cuts_blocks",)),
    Mutant("p11", "DSpark: the Markov bias of every block position read from the anchor, not the token before",
           "ds4serve/model/dspark.py", "        prev = tok\n", "        prev = anchors\n",
           ("tests/test_dspark_drafter.py::test_markov_chain_and_confidence_match_the_loop_oracle",
            "tests/test_dspark_drafter.py::test_the_chain_follows_the_tokens_the_sampler_draws")),
    Mutant("p12", "rejection sampling in the engine: the residual drawn from p instead of max(p - q, 0)",
           "ds4serve/engine/spec_verify.py", "    r = (p - q).clamp(min=0)", "    r = p.clone()",
           ("tests/test_model_draft_engine.py::test_sampled_outputs_follow_the_target_distribution[mtp]",)),
    Mutant("p13", "checkpoint drafts: the compressor rings (the CSA overlap half with them) not rolled back",
           "ds4serve/cache/draft_rows.py", 'RINGS = ("swa", "comp_ring", "idx_ring")', 'RINGS = ("swa", "idx_ring")',
           ("tests/test_model_draft_engine.py::test_accepted_drafts_leave_greedy_output_unchanged",)),
    Mutant("p14", "drafts: draft rows taken from a prompt still waiting to prefill",
           "ds4serve/scheduler/drafting.py", "            budget = min(budget, spare - prefill())",
           "            budget = budget",
           ("tests/test_spec_decode.py::test_drafts_take_only_the_rows_a_waiting_prompt_leaves",)),
    Mutant("p15", "drafts: an n-gram draft as long as k, whatever its later rows pay",
           "ds4serve/scheduler/drafting.py", "        want = rows_that_pay(req.draft_rate, bar, self.k) if want is None else want",
           "        want = self.k if want is None else want",
           ("tests/test_spec_decode.py::test_drafting_turns_down_as_the_batch_fills",)),
    Mutant("p16", "drafts under a grammar: the verify rows past the first are not masked (constraint dropped)",
           "ds4serve/engine/drafted.py",
           "                                   state.eos_ids, base_seed=state.base_seed, constraint=state.constraint, drafted=i)",
           "                                   state.eos_ids, base_seed=state.base_seed, drafted=i)",
           ("tests/test_grammar_drafts.py",)),
    Mutant("p17", "drafts under a grammar: the matcher keeps the draft's tail after the masks (no rollback)",
           "ds4serve/engine/constraints.py", "        _settle(rows, states)", "        pass",
           ("tests/test_grammar_drafts.py",)),
    Mutant("p18", "drafts under a grammar: every row masked as the first (the matcher not advanced through the draft)",
           "ds4serve/engine/constraints.py", "        r = seen.get(id(states[i].constraint), 0)", "        r = 0",
           ("tests/test_grammar_drafts.py",)),
    Mutant("p19", "tensor parallel drafts: each rank rolls back with its own counts (workers: all rejected)",
           "ds4serve/engine/parallel_executor.py", "        n = len(counts)", "        return counts",
           ("tests/test_tensor_parallel.py::test_drafts_under_two_ranks_answer_as_one_plain_process",)),
    Mutant("d1", "drafting cost: the drafter reading a prompt charged to its first block",
           "ds4serve/scheduler/speculation.py",
           "        self.step_costs.observe_blocks(d.seconds - d.prompt_s, d.proposals, drafts, d.block_s)",
           "        self.step_costs.observe_blocks(d.seconds, d.proposals, drafts, d.block_s)",
           ("tests/test_draft_timing.py",)),
    Mutant("d2", "drafting: a model block none of which pays left out of the request's rate",
           "ds4serve/scheduler/drafting.py", "                refused(req)  # a block not one row of which pays",
           "                pass  # a block not one row of which pays",
           ("tests/test_checkpoint_drafting.py::test_a_block_none_of_which_pays_counts_against_the_rate_and_a_budget_cut_does_not",)),
    Mutant("d3", "native DSpark proposal: the survival product kept in float (torch.cumprod's is a double product)",
           "ds4serve/model/csrc/host_dspark.c", "        double acc = survival[r * B];", "        float acc = survival[r * B];",
           ("tests/test_native_dspark.py::test_the_engines_one_call_paths_equal_commit_ready_draft_and_cumprod",)),
    Mutant("d4", "native DSpark proposal: readiness ignores rows older than the window (a ring with holes drafts)",
           "ds4serve/model/csrc/host_dspark.c", "        if (row[q] < lo || row[q] > last) return 0;",
           "        if (row[q] > last) return 0;",
           ("tests/test_native_dspark.py::test_ready_agrees_with_the_rings_completeness_after_gaps_and_hits",)),
    Mutant("d5", "drafting cost: the cost per drafting step ignored, the excess charged to rows alone",
           "ds4serve/scheduler/step_costs.py", "    if det <= COLLINEAR * sdd * skk:", "    if True:",
           ("tests/test_step_costs.py",)),
    Mutant("d6", "drafting: a block opens with its first row whatever the cost per draft",
           "ds4serve/scheduler/drafting.py", "        if r > best:", "        if best < 0.0:",
           ("tests/test_step_costs.py",)),
    Mutant("d7", "native DSpark: the 1-3 leftover rows of a product read the wrong rows", "ds4serve/model/csrc/host_dspark.c",
           "        case 3: ds_kn_group(x + r * ldx, ldx, wt, n_out, k, y + r * ldy, ldy, 3, 2); break;",
           "        case 3: ds_kn_group(x, ldx, wt, n_out, k, y + r * ldy, ldy, 3, 2); break;",
           ("tests/test_native_dspark.py",)),
    Mutant("d8", "native DSpark: attention weights not normalised by their sum", "ds4serve/model/csrc/host_dspark.c",
           "            if (w >= W || valid[w]) att[w] /= sum;", "            (void)sum;",
           ("tests/test_native_dspark.py",)),
    Mutant("d9", "following: the backlog's row count not kept (old rows trimmed too early / never)",
           "ds4serve/engine/model_drafts.py", "            log_.rows += n\n", "            log_.rows += 2 * n\n",
           ("tests/test_model_draft_engine.py", "tests/test_checkpoint_drafting.py", "tests/test_native_dspark.py")),
    Mutant("d10", "following: a request whose rings cannot catch up before it ends is followed again",
           "ds4serve/scheduler/drafting.py",
           "        return req.unfollowed_at + self.follow_window + self.k < len(req.prompt_ids) + req.params.max_tokens",
           "        return True", ("tests/test_draft_timing.py", "tests/test_step_costs.py")),
    Mutant("d11", "step costs: a window without drafting steps takes c from the prior corners' distance to the plain line",
           "ds4serve/scheduler/step_costs.py", "        if len(self.prior) == 3 and not drafted.any():",
           "        if False:", ("tests/test_step_costs.py",)),
    Mutant("d12", "following: a prompt chunk the drafter did not read leaves no gap in the request's rings",
           "ds4serve/scheduler/speculation.py",
           "                req.unfollowed_at = max(req.unfollowed_at, m.start + len(m.ids) - 1)", "                pass",
           ("tests/test_draft_timing.py",)),
    Mutant("y1", "view refilled in place: the new token ids not written into it",
           "ds4serve/cache/native_view.py", "    held.view.ids.copy_(ids)\n", "",
           ("tests/test_native_view.py",)),
    Mutant("y2", "view refilled in place: the index arrays not rebuilt (last step's positions and rows)",
           "ds4serve/cache/native_view.py", "    lib.ds4_text_view(ctypes.byref(spec), ctypes.byref(held.out))\n", "",
           ("tests/test_native_view.py",)),
    Mutant("y3", "view refilled in place: the compress arrays not re-cut when the closing windows' count changes",
           "ds4serve/cache/native_view.py", "    if emits != held.emits:", "    if False:", ("tests/test_native_view.py",)),
    Mutant("y4", "a kept descriptor: the closing windows' count not refreshed", "ds4serve/model/host_views.py",
           "                cv.E = ci.emit_rows.shape[0]", "                pass", ("tests/test_native_view.py",)),
    Mutant("y5", "a reused view's visible rows padded with valid entries", "ds4serve/cache/csrc/view.c",
           "                    int ok = q < n_vis;", "                    int ok = q < R;", ("tests/test_native_view.py",)),
    Mutant("z1", "draft guard: a width whose drafting steps lose is never turned off",
           "ds4serve/scheduler/draft_guard.py", "        return d.rate < p.rate", "        return False",
           ("tests/test_draft_guard.py",)),
    Mutant("z2", "draft guard: blocks drafted in a plain step charged to the plain step",
           "ds4serve/scheduler/draft_guard.py", "                self._drafting.setdefault(width, _Record()).seconds += drafter_s",
           "                pass", ("tests/test_draft_guard.py",)),
    Mutant("z3", "draft guard: a drafter that follows without a draft verified is never turned off",
           "ds4serve/scheduler/draft_guard.py", "        elif self._loses(width) or (idle or 0) >= IDLE_STEPS:",
           "        elif self._loses(width):", ("tests/test_draft_guard.py",)),
    Mutant("o1", "drafter blocks drafted on the pool's worker never put on their requests before the next plan",
           "ds4serve/runtime/core.py", "        self._settle()\n        record = None", "        record = None",
           ("tests/test_draft_overlap.py",)),
    Mutant("o2", "the pool's job joined without waiting for it to finish", "ds4serve/model/csrc/host_pool.c",
           "for (int spins = 0; atomic_load(&p->done) < 1; spins++) {", "for (int spins = 0; 0; spins++) {",
           ("tests/test_draft_overlap.py",)),
    Mutant("o3", "the engine's wait for pooled blocks counted as the loop's gap", "ds4serve/scheduler/step_costs.py",
           "            self._applied_at += seconds", "            pass", ("tests/test_draft_overlap.py",)),
    Mutant("o4", "a worker that keeps starting late is waited for anyway", "ds4serve/engine/model_drafts.py",
           "        if self._late > LATE_LIMIT:", "        if False:", ("tests/test_draft_overlap.py",)),
    Mutant("s17", "greedy fast path: non-finite rows drawn as if finite", "ds4serve/engine/sampling.py",
           "    finite = np.isfinite(x).all(axis=1).tolist()", "    finite = [True] * x.shape[0]",
           ("tests/test_sampling.py",)),
    # FP8 on bf16 pairs (host_f8pairs.c; the native kernel's mutants need AVX-512 BF16 + VBMI to be built)
    Mutant("x1", "FP8 pairs: the two weight rows of a pair swapped in the interleave", "ds4serve/model/csrc/host_f8pairs.c",
           "f8p_ix[p] = (uint8_t)(p % 2 ? 64 + col : col);", "f8p_ix[p] = (uint8_t)(p % 2 ? col : 64 + col);",
           ("tests/test_host_f8pairs.py",)),
    Mutant("x2", "FP8 pairs: the codes' sign bit dropped", "ds4serve/model/csrc/host_f8pairs.c",
           "hi = _mm512_ternarylogic_epi32(hi, codes, t->sign, 0xF8);", "hi = _mm512_ternarylogic_epi32(hi, codes, t->sign, 0xF0);",
           ("tests/test_host_f8pairs.py",)),
    Mutant("x3", "FP8 pairs: a block's partial sums carried into the next block (not reset)",
           "ds4serve/model/csrc/host_f8pairs.c", "                p[c] = 0.0f;", "                (void)p;",
           ("tests/test_host_f8pairs.py",)),
    Mutant("x4", "FP8 pairs: the scale of the next block of outputs", "ds4serve/model/csrc/host_f8pairs.c",
           "    int64_t nb = n / w->bn, kb = k / w->bk;", "    int64_t nb = (n + 32) / w->bn % w->scale_rows, kb = k / w->bk;",
           ("tests/test_host_f8pairs.py",)),
    Mutant("v1", "load: the hash-routing table's expert ids are not range-checked", "ds4serve/model/weights.py",
           "    bad = (values < 0) | (values >= table.bound)", "    bad = torch.zeros_like(values, dtype=torch.bool)",
           ("tests/test_checkpoint_validation.py",)),
    Mutant("t1", "tensor parallel: the watchdog never reports a rank that exited", "ds4serve/runtime/tp_group.py",
           "        ready = wait(list(sentinels))", "        return", ("tests/test_tensor_parallel.py",)),
    Mutant("t2", "tensor parallel: the collective timeout ignored (steps wait a day for a hung rank)",
           "ds4serve/runtime/tp_group.py", '    backend = "nccl" if device.type == "cuda" else "gloo"',
           '    backend, timeout_s = ("nccl" if device.type == "cuda" else "gloo"), 86400.0',
           ("tests/test_tensor_parallel.py",)),
    Mutant("e1", "native exp: the low part of ln 2 dropped from the remainder (errors of thousands of ulps)",
           "ds4serve/model/csrc/host_kernels.c", "    r = vfma(n, vsplat(2.12194440e-4f), r);", "",
           ("tests/test_host_exp.py",)),
    Mutant("e2", "native products in one loop: each product's blocks taken from the set's first item",
           "ds4serve/model/csrc/host_kernels.c",
           "        if (l < h) set->plan[i].fn((void *)&set->plan[i].job, l - a, h - a);",
           "        if (l < h) set->plan[i].fn((void *)&set->plan[i].job, l, h);",
           ("tests/test_host_forward.py",)),
    Mutant("e3", "native attention: the sink left out of the softmax's denominator",
           "ds4serve/model/csrc/host_layers.c", "        denom[h] = p[n];", "        denom[h] = 0.0f;",
           ("tests/test_host_forward.py",)),
    Mutant("e4", "native experts: the gate/up products not run before SwiGLU (they run beside the down products)",
           "ds4serve/model/csrc/host_layers.c", "    linears_run(set);  /* every gate/up product before any SwiGLU */",
           "", ("tests/test_host_forward.py::test_a_model_without_a_shared_expert",)),
    Mutant("e5", "native mHC: Sinkhorn's lanes normalise the columns only (rows skipped after the first pass)",
           "ds4serve/model/csrc/host_kernels.c",
           "                for (int64_t j = 0; j < hc; j++) m[i * hc + j] = m[i * hc + j] / (e + s);", "",
           ("tests/test_host_forward.py",)),
]


def _copy(dst: Path) -> None:
    ignore = shutil.ignore_patterns(".git", ".venv", "venv", "__pycache__", ".pytest_cache", ".hypothesis", "out")
    shutil.copytree(ROOT, dst, ignore=ignore, dirs_exist_ok=True)


def _run_tests(tree: Path, tests: tuple[str, ...]) -> bool:
    """True when the tests pass in ``tree``."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
    return subprocess.run(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


def probe(m: Mutant, tree: Path) -> str:
    """Apply ``m`` to a fresh scratch copy and run its tests; 'caught', 'SURVIVED' or why not run."""
    target = tree / m.path
    text = target.read_text()
    if text.count(m.old) != 1:
        return f"not applied ({text.count(m.old)} matches for its line: update the mutant)"
    target.write_text(text.replace(m.old, m.new))
    try:
        return "SURVIVED" if _run_tests(tree, m.tests) else "caught"
    finally:
        target.write_text(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("keys", nargs="*", help="mutants to run (default: all)")
    args = ap.parse_args()
    chosen = [m for m in MUTANTS if not args.keys or m.key in args.keys]
    with tempfile.TemporaryDirectory(prefix="ds4serve-mutants-") as tmp:
        tree = Path(tmp)
        _copy(tree)
        baseline = sorted({t for m in chosen for t in m.tests})
        if not _run_tests(tree, tuple(baseline)):
            print("the named tests fail without any mutant: fix them first", file=sys.stderr)
            return 2
        survived = 0
        for m in chosen:
            verdict = probe(m, tree)
            survived += verdict != "caught"
            print(f"{m.key:>3}  {verdict:<9} {m.what}  [{' '.join(m.tests)}]", flush=True)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
