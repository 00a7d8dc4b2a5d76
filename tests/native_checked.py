"""Runs in a fresh process with ``DS4SERVE_NATIVE_CHECK=1`` (tests/test_native_bounds.py): the native
forward built with every gather and scatter checked against the size of what it indexes.

``python tests/native_checked.py serve``: the bundled DS4V model through prefills, decode rows, image
passes, prefix-cache hits and preemption (suspend and drop) with ``host_kernels="on"``; prints one JSON
line of what happened. ``python tests/native_checked.py corrupt WHAT``: one forward whose view (or hash
table) holds one index out of range; a checked build must stop with a message naming it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from ds4serve.cache import SeqChunk  # noqa: E402  (ds4serve before torch: its OpenMP setting)
from ds4serve.chat import Tokenizer  # noqa: E402
from ds4serve.engine.sampling import SamplingParams  # noqa: E402
from ds4serve.scheduler.spec import RequestSpec  # noqa: E402
from ds4serve.llm import LLM  # noqa: E402
from ds4serve.model import host_forward  # noqa: E402
from ds4serve.multimodal.pipeline import ImagePipeline  # noqa: E402
from ds4serve.tiny.data import examples  # noqa: E402
from ds4serve.tiny.evaluate import answer_text, prepare, run_examples  # noqa: E402
from ds4serve.tiny.random_model import BUNDLED  # noqa: E402

import torch  # noqa: E402

BIG = 10 ** 7


def serve() -> dict:
    """Every kind of step through the checked build: image and text prompts, then their second turns
    (prefix hits on the first turns' snapshots), then the same traffic in a pool for about two
    requests (suspensions and drops); the answers must also be right."""
    tok = Tokenizer(BUNDLED)
    exs = [ex for ex in examples(11, 40) if ex.images][:6] + examples(12, 4, ("math",))
    llm = LLM(BUNDLED, host_kernels="on", max_seqs=8, prefix_interval=16)
    core = llm.core
    assert core.executor.host is not None and "bounds checked" in host_forward.description()
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    pipeline = ImagePipeline.for_engine(core, tok)
    turns = [prepare(core, tok, pipeline, ex) for ex in exs]
    firsts = _run_all(core, [core.make_request(RequestSpec(ids, params, images=images)) for ids, images in turns])
    seconds = _run_all(core, [core.make_request(RequestSpec(ids + out + ids[-9:], params, images=images))
                              for (ids, images), out in zip(turns, firsts)])
    prefix = core.prefix_stats()
    small = LLM(BUNDLED, host_kernels="on", max_seqs=8, kv_budget=128, host_budget="40KB", step_tokens=16,
                max_prefill_tokens=128).core
    got = run_examples(small, tok, ImagePipeline.for_engine(small, tok), exs, 8, params)
    answers = [answer_text(tok, ids[:ids.index(tok.eos_id)] if tok.eos_id in ids else ids) for ids in got]
    stats = small.scheduler.stats
    return {"images": sum(len(ex.images) for ex in exs), "suspend": stats["preempt_suspend"],
            "drop": stats["preempt_drop"], "prefix_hits": prefix["hits"], "second_turns": len(seconds),
            "same_as_large_pool": got == firsts, "correct": sum(a == ex.answer for a, ex in zip(answers, exs)),
            "n": len(exs), "leaks": core.leaks() + small.leaks()}


def _run_all(core, reqs) -> list[list[int]]:
    for r in reqs:
        core.add(r)
    core.run_until_idle()
    assert all(len(r.output_ids) for r in reqs)
    return [list(r.output_ids) for r in reqs]


def corrupt(what: str) -> None:
    """One prefill then one decode forward of a sequence, with ``what`` out of range in the second."""
    llm = LLM(BUNDLED, host_kernels="on", max_seqs=2, enable_prefix_caching=True, warmup=False)
    core, engine, cache = llm.core, llm.core.executor, llm.core.cache
    slot = cache.alloc_slot()
    prompt = [5 + (7 * i) % 200 for i in range(72)]  # the last token closes a window of every ratio (4, 8)
    assert cache.reserve({slot: len(prompt) + 2})
    with torch.inference_mode():
        engine._forward(engine._view([SeqChunk(slot, 0, prompt[:-1], cache.block_table(slot))]))
        captures = ((len(prompt) - 2, 0),) if what == "capture" else ()
        start = len(prompt) - 3 if what == "capture" else len(prompt) - 1
        view = engine._view([SeqChunk(slot, start, prompt[start:], cache.block_table(slot), captures=captures)])
        csa = next(k for k in view.compress if k[1])
        if what == "swa_dst":
            view.swa_dst[0] = BIG
        elif what == "swa_keys":
            view.swa_keys[0, 0] = BIG
        elif what == "emit_rows":
            assert view.compress[csa].emit_rows.numel(), "no window closes in this forward"
            view.compress[csa].emit_rows[0] = BIG
        elif what == "visible":
            hca = max(view.visible)
            view.visible[hca].rows[0, 0], view.visible[hca].valid[0, 0] = BIG, True
        elif what == "indexer":
            view.visible[csa[0]].rows[0, 0], view.visible[csa[0]].valid[0, 0] = BIG, True
        elif what == "tid2eid":
            gate = next(ly.mlp.gate for ly in llm.model.model.layers if ly.mlp.is_hash)
            gate.tid2eid[prompt[-1]] = llm.cfg.n_routed_experts
        elif what == "capture":
            cap = next(iter(view.captures.values()))
            cap.new_dst[0] = BIG
        else:
            raise SystemExit(f"unknown corruption {what!r}")
        engine._forward(view)
    print("the forward ran to the end")


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        print(json.dumps(serve()))
    else:
        corrupt(sys.argv[2])
