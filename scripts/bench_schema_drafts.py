"""One request under a JSON schema (an order, as a tool's arguments) on the bundled model: plain decoding
against drafting, interleaved.

Why a script beside ``ds4serve bench spec``: that bench measures free text (``LLM.generate`` carries no
grammar); here each request carries a schema's matcher, so what is measured is drafting under a grammar,
where the drafts are cut at the first token the grammar refuses and the grammar's forced tokens (a
schema's keys and punctuation) are drafted where prompt lookup or the drafter offers fewer
(``engine.constraints.forced_tokens``).

    python scripts/bench_schema_drafts.py                                  # n-gram drafts
    python scripts/bench_schema_drafts.py --speculative-config '{"method": "dspark"}'

Prints, per prompt (one without JSON in it, one with an example answer), the best of ``--rounds`` wall
times of each engine (greedy, prefill included), their ratio, the verify steps and accepted draft tokens,
and whether the outputs were identical (they must be).
"""

from __future__ import annotations

import ds4serve  # noqa: F401  (first: the OpenMP spin setting before torch)

import argparse
import json
import time
from pathlib import Path

from ds4serve.chat import Tokenizer
from ds4serve.chat.grammar import grammar_spec
from ds4serve.chat.grammar_runtime import GrammarCompiler
from ds4serve.engine.sampling import SamplingParams
from ds4serve.llm import LLM
from ds4serve.scheduler.spec import RequestSpec

TINY = Path(__file__).resolve().parents[1] / "models" / "ds4v-tiny"
# an order as a tool's arguments: keys and punctuation the grammar forces, values the model chooses
ORDER = {"type": "object", "properties": {
    "item": {"type": "string", "maxLength": 10}, "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
    "express": {"type": "boolean"}, "size": {"enum": ["small", "medium", "large"]},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                 "postcode": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "postcode"], "additionalProperties": False},
    "notes": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2}},
    "required": ["item", "quantity", "express", "size", "address", "notes"], "additionalProperties": False}
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def run(llm: LLM, compiler: GrammarCompiler, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    """One greedy request under the schema, stepped to the end: its output and wall time."""
    spec = grammar_spec(response_format={"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER}})
    req = llm.core.make_request(RequestSpec(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                                            constraint=compiler.matcher(spec)))
    t = time.perf_counter()
    llm.core.add(req)
    while llm.core.has_work:
        llm.core.step()
    return list(req.output_ids), time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--speculative-config", default=json.dumps(NGRAM))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--max-tokens", type=int, default=200)
    args = ap.parse_args()
    tok = Tokenizer(TINY)
    compiler = GrammarCompiler.for_tokenizer(tok)
    plain, drafted = LLM(TINY, max_seqs=1), LLM(TINY, max_seqs=1, speculative=args.speculative_config)
    example = json.dumps({"item": "lamp", "quantity": 2, "express": False, "size": "small",
                          "address": {"city": "Oslo", "postcode": "01234"}, "notes": ["gift"]})
    prompts = {"no JSON in the prompt": "Place an order for a lamp.\nAnswer: ",
               "an example answer in the prompt": f"Example: {example}\nAnother: {example}\nAnswer: "}
    print(f"drafts: {args.speculative_config}; greedy, one request, best of {args.rounds} interleaved rounds")
    print("| prompt | tokens | plain ms | drafts ms | ratio | verify steps | accepted | identical |")
    print("|---|---|---|---|---|---|---|---|")
    for label, text in prompts.items():
        ids = tok.encode_text(text)
        best = {"plain": float("inf"), "drafts": float("inf")}
        outs: dict[str, list[int]] = {}
        for _ in range(args.rounds):
            before = dict(drafted.core.scheduler.spec)
            for name, llm in (("plain", plain), ("drafts", drafted)):
                outs[name], dt = run(llm, compiler, ids, args.max_tokens)
                best[name] = min(best[name], dt)
            after = dict(drafted.core.scheduler.spec)
        steps = after.get("verify_steps", 0) - before.get("verify_steps", 0)
        accepted = after.get("accepted_tokens", 0) - before.get("accepted_tokens", 0)
        print(f"| {label} | {len(outs['plain'])} | {1e3 * best['plain']:.2f} | {1e3 * best['drafts']:.2f} | "
              f"{best['plain'] / best['drafts']:.2f}x | {steps} | {accepted} | "
              f"{'yes' if outs['plain'] == outs['drafts'] else 'NO'} |")


if __name__ == "__main__":
    main()
