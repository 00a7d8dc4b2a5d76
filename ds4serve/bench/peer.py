"""``ds4serve bench peer``: ds4serve against transformers on the same checkpoint, in one run.

The checkpoint is the spec's Appendix A DeepSeek-V4 config with random weights (saved by
transformers) and a byte-level tokenizer with a DS4 chat template, so every peer can load it.
Three sides, same prompts and ``max_tokens`` (``ignore_eos``, greedy):

* ds4serve over HTTP (``ds4serve serve``), measured by the ``bench serve`` load generator;
* transformers' own OpenAI server (``transformers serve``, needs ``accelerate``) with the same load
  generator, if it starts here;
* transformers' batched ``generate`` in-process, batch size = concurrency (its best case: equal-length
  prompts, no HTTP).

Printed: output-token throughput and TTFT per concurrency level and the ratios ds4serve / peer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from .engine_bench import make_checkpoint as make_weights
from .serve_bench import make_requests, run_level, summarise

TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
            "{% elif m['role'] == 'assistant' %}<｜Assistant｜></think>{{ m['content'] }}<｜end▁of▁sentence｜>"
            "{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<｜Assistant｜></think>{% endif %}")


def make_checkpoint(root: Path) -> Path:
    """bench engine's Appendix A checkpoint plus a byte tokenizer and a DS4 chat template, so an
    OpenAI-compatible server (ours or transformers') can serve it."""
    from ..tiny.byte_tokenizer import build_byte_tokenizer

    tok = build_byte_tokenizer()
    make_weights(root, vocab_size=264, bos_token_id=0, eos_token_id=1)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<｜begin▁of▁sentence｜>",
        "eos_token": "<｜end▁of▁sentence｜>", "pad_token": "<｜pad｜>", "chat_template": TEMPLATE,
        "model_max_length": 2048}))
    return root


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _process(cmd: list[str], health: str, timeout_s: float = 180):
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tempfile.gettempdir())
    try:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited: {proc.stderr.read().decode()[-800:]}")
            try:
                urllib.request.urlopen(health, timeout=1)
                break
            except OSError:
                time.sleep(0.3)
        else:
            raise RuntimeError(f"{cmd[0]} did not start within {timeout_s} s")
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _http_levels(base: str, model: str, levels: list[int], n: int, max_tokens: int, words: int) -> dict:
    """Both HTTP sides get identical greedy bodies without ``ignore_eos`` (transformers serve rejects
    unknown fields with a 422); same weights, so both stop at the same tokens."""
    out = {}
    for c in levels:
        bodies = make_requests(max(n, c), 0, 0.0, words, max_tokens, model, ignore_eos=False)
        asyncio.run(run_level(base, bodies[:c], c, None, 0, None, False))  # warm-up
        results, duration = asyncio.run(run_level(base, bodies, c, None, 0, None, True))
        lv = summarise(f"c={c}", c, None, results, duration)
        out[c] = {"tok_s": lv.output_throughput, "ttft_ms": lv.ttft_ms["p50"], "errors": lv.errors}
    return out


def _generate_levels(path: Path, levels: list[int], max_tokens: int, prompt_len: int) -> dict:
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = {}
    for c in levels:
        ids = torch.randint(8, 264, (c, prompt_len), generator=torch.Generator().manual_seed(c))
        kw = dict(do_sample=False, pad_token_id=7)
        with torch.no_grad():
            model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
            first = time.perf_counter() - t
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **kw)
            total = time.perf_counter() - t
        out[c] = {"tok_s": c * max_tokens / total, "ttft_ms": 1000 * first, "errors": {}}
    return out


def run(levels: list[int], requests: int = 32, max_tokens: int = 32, words: int = 12,
        with_transformers_serve: bool = True) -> dict:
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(Path(tmp) / "ckpt")
        port = _free_port()
        cmd = [sys.executable, "-m", "ds4serve.cli", "--log-level", "WARNING", "serve", "--model", str(path),
               "--port", str(port), "--max-seqs", str(max(levels) + 2), "--served-model-name", "peer"]
        with _process(cmd, f"http://127.0.0.1:{port}/health"):
            results["ds4serve (HTTP)"] = _http_levels(f"http://127.0.0.1:{port}/v1", "peer", levels, requests,
                                                      max_tokens, words)
        if with_transformers_serve:
            port = _free_port()
            exe = str(Path(sys.executable).parent / "transformers")
            try:
                with _process([exe, "serve", str(path), "--port", str(port)], f"http://localhost:{port}/health"):
                    results["transformers serve (HTTP)"] = _http_levels(f"http://localhost:{port}/v1", str(path),
                                                                        levels, requests, max_tokens, words)
            except (RuntimeError, OSError) as exc:
                print(f"transformers serve could not run here: {exc}")
        prompt_len = 20 + words * 2
        results["transformers generate (in-process)"] = _generate_levels(path, levels, max_tokens, prompt_len)
    print(render(results, levels, max_tokens))
    return results


def render(results: dict, levels: list[int], max_tokens: int) -> str:
    ours = results["ds4serve (HTTP)"]
    lines = [f"same checkpoint (Appendix A config, random weights, fp32), {max_tokens} output tokens per request, "
             f"{torch.get_num_threads()} threads", "",
             "| side | concurrency | output tok/s | TTFT p50 ms | ds4serve throughput ratio | errors |",
             "|---|---:|---:|---:|---:|---|"]
    for side, res in results.items():
        for c in levels:
            r = res.get(c)
            if r is None:
                continue
            ratio = ours[c]["tok_s"] / r["tok_s"] if r["tok_s"] else float("nan")
            lines.append(f"| {side} | {c} | {r['tok_s']:.1f} | {r['ttft_ms']:.0f} | "
                         f"{'-' if side.startswith('ds4serve') else f'{ratio:.2f}x'} | {r['errors'] or '-'} |")
    return "\n".join(lines)
