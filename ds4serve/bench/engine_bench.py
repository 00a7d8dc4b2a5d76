"""``ds4serve bench engine``: decode throughput at several concurrency levels, side by side with
transformers' batched ``generate`` on the same weights (spec Appendix A config, random weights).

A benchmark, not a test: it prints figures and ratios measured in one run on this machine, the two
engines interleaved round by round (median of ``--rounds``) so drift in a shared machine's speed
does not favour whichever side ran first. Decode
throughput counts only steps where every stream decodes (prefill excluded) for ds4serve, and
``total - prefill`` for transformers (its prefill timed separately with ``max_new_tokens=1``).
"""

from __future__ import annotations

import json
import logging
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..model.footprint import footprint
from .bandwidth import read_bandwidth
from .memory import describe

log = logging.getLogger(__name__)

APPENDIX_A = {
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "compress_rope_theta": 160000.0, "eos_token_id": None, "hc_eps": 1e-06, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "head_dim": 64, "hidden_act": "silu", "hidden_size": 256,
    "index_head_dim": 32, "index_n_heads": 16, "index_topk": 8, "initializer_range": 0.02,
    "layer_types": ["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                    "heavily_compressed_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    "max_position_embeddings": 2048, "mlp_bias": False,
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe", "moe", "moe"], "model_type": "deepseek_v4",
    "moe_intermediate_size": 128, "n_routed_experts": 8, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 6, "num_key_value_heads": 1,
    "num_nextn_predict_layers": 1, "o_groups": 2, "o_lora_rank": 64, "pad_token_id": 0,
    "partial_rotary_factor": 0.25, "q_lora_rank": 128, "qk_rope_head_dim": 16, "rms_norm_eps": 1e-06,
    "rope_parameters": {
        "compress": {"attention_factor": 1.0, "beta_fast": 32, "beta_slow": 1, "factor": 4.0,
                     "original_max_position_embeddings": 512, "partial_rotary_factor": 0.25,
                     "rope_theta": 160000.0, "rope_type": "yarn"},
        "main": {"partial_rotary_factor": 0.25, "rope_theta": 10000.0, "rope_type": "default"},
    },
    "rope_theta": 10000.0, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "sliding_window": 32,
    "swiglu_limit": 10.0, "tie_word_embeddings": False, "vocab_size": 1000,
}


@dataclass
class Row:
    streams: int
    ours_tok_s: float
    ours_step_ms: float
    hf_tok_s: float | None
    hf_step_ms: float | None

    @property
    def ratio(self) -> float | None:
        return self.ours_tok_s / self.hf_tok_s if self.hf_tok_s else None


def make_checkpoint(root: Path, **overrides) -> Path:
    """Appendix A (with ``overrides``) and random weights, written by transformers (the same init the
    spec measured). Without transformers (a bare GPU machine), the same shapes with ds4serve's own
    seeded random init (``--no-transformers`` runs only: the figures are then ds4serve's alone)."""
    try:
        from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    except ImportError:
        log.warning("transformers is not importable: random Appendix A weights made by ds4serve instead")
        return make_checkpoint_without_transformers(root)

    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(DeepseekV4Config.from_dict(dict(APPENDIX_A, **overrides)))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("tid2eid"):
                buf.copy_(torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(buf.shape[0])]))
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "position_bias")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    model.save_pretrained(root, safe_serialization=True)
    return root


def make_checkpoint_without_transformers(root: Path) -> Path:
    """Appendix A's shapes (6 layers: sliding x2, CSA 4, HCA 16, CSA 4, HCA 16; hash MoE in layer 0)
    in the official naming, seeded random weights from ``ds4serve.tiny.random_model``; no tokenizer
    (the bench sends token ids)."""
    from safetensors.torch import save_file

    from ..config import ModelConfig
    from ..tiny.random_model import random_config, random_weights

    config = random_config(APPENDIX_A["vocab_size"], vision=False)
    config["max_position_embeddings"] = APPENDIX_A["max_position_embeddings"]
    root.mkdir(parents=True, exist_ok=True)
    save_file(random_weights(ModelConfig.from_dict(config)), str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(config, indent=1))
    return root


class _Ours:
    """ds4serve's engine on the checkpoint; one call = one round of ``n`` streams."""

    def __init__(self, path: Path, max_streams: int, prompt_len: int, new_tokens: int, device: str = "cpu",
                 host_kernels: str = "auto"):
        from ..llm import LLM

        self.device = torch.device(device)
        self.llm = LLM(path, device=device, max_seqs=max_streams, max_model_len=prompt_len + new_tokens + 8,
                       max_prefill_tokens=max(1024, prompt_len), step_tokens=max_streams + 64,
                       host_kernels=host_kernels)
        self.prompt_len, self.new_tokens = prompt_len, new_tokens
        self.gen = torch.Generator().manual_seed(5)

    def _add(self, n: int) -> None:
        """``n`` random greedy requests of ``prompt_len`` tokens, each decoding ``new_tokens``."""
        from ..engine.sampling import SamplingParams
        from ..scheduler.spec import RequestSpec

        core = self.llm.core
        params = SamplingParams(max_tokens=self.new_tokens, temperature=0.0, ignore_eos=True)
        for _ in range(n):
            ids = torch.randint(2, 1000, (self.prompt_len,), generator=self.gen).tolist()
            core.add(core.make_request(RequestSpec(ids, params)))

    def __call__(self, n: int) -> tuple[float, float]:
        core = self.llm.core
        self._add(n)
        core.history.clear()
        core.run_until_idle()
        steps = [h for h in core.history if h.prefill_rows == 0 and h.decode_rows == n]
        if not steps:
            raise RuntimeError(f"no pure decode steps at {n} streams")
        return n * len(steps) / sum(h.elapsed_s for h in steps), 1000 * statistics.median(h.elapsed_s for h in steps)

    def breakdown(self, n: int, steps: int = 10) -> dict[str, float]:
        """Where one pure-decode step of ``n`` streams goes: wall time, torch calls made from Python,
        and the time of replaying only its matrix products. Explains the gap to a target: the
        products are a floor that fusing the elementwise work cannot remove; the rest is per-op
        overhead."""
        from torch.overrides import TorchFunctionMode
        from torch.profiler import ProfilerActivity, profile

        class _Calls(TorchFunctionMode):
            count = 0

            def __torch_function__(self, func, types, args=(), kwargs=None):
                _Calls.count += 1
                return func(*args, **(kwargs or {}))

        core = self.llm.core
        self._add(n)
        while not core.history or core.history[-1].prefill_rows or core.history[-1].decode_rows != n:
            core.step()
        wall, forward = self._timed_steps(steps)
        with _Calls():
            for _ in range(steps):
                core.step()
        calls = _Calls.count / steps
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            core.step()
        core.run_until_idle()
        products = [(e.name, e.input_shapes) for e in prof.events()
                    if e.name in _PRODUCTS and _flops(e.name, e.input_shapes) >= 100_000]
        runner = core.executor.decode
        return {"streams": n, "step_ms": 1000 * wall, "forward_ms": forward, "native": core.executor.host is not None,
                "torch_calls": calls, "products": len(products),
                "products_ms": 1000 * _replay(products, self.device), "decode_graphs": runner.mode,
                "graph_captures": runner.stats["captures"], "graph_replays": runner.stats["replays"],
                "graphs_disabled": runner.disabled}

    def _timed_steps(self, steps: int) -> tuple[float, float]:
        """Median seconds per step, and median ms inside the model forward (native or torch) of the same
        steps (each forward lies inside its step, so the second median never exceeds the first): the
        rest of a step is view building, the LM head, sampling and scheduling."""
        core = self.llm.core
        engine, spent, times = core.executor, [], []
        forward = engine._forward

        def timed(view, *rest):
            t = time.perf_counter()
            out = forward(view, *rest)
            spent.append(time.perf_counter() - t)
            return out

        engine._forward = timed
        try:
            for _ in range(steps):
                t = time.perf_counter()
                core.step()
                times.append(time.perf_counter() - t)
        finally:
            del engine._forward
        return statistics.median(times), 1000 * statistics.median(spent) if spent else 0.0


_PRODUCTS = {"aten::mm": 2, "aten::bmm": 2, "aten::addmm": 3, "aten::baddbmm": 3}


def _flops(name: str, shapes: list) -> int:
    """2 * m * n * k (* batch) of a recorded product; the tiny ones (mHC's 4x4 Sinkhorn
    normalisers) are per-op overhead, not arithmetic, and a fused kernel would remove them."""
    a, b = shapes[_PRODUCTS[name] - 2], shapes[_PRODUCTS[name] - 1]
    batch = a[0] if len(a) == 3 else 1
    return 2 * batch * a[-2] * a[-1] * b[-1]


def _replay(products: list[tuple[str, list]], device: torch.device | str = "cpu") -> float:
    """Seconds to run just these matrix products (fresh operands of the recorded shapes), best of
    five: the floor of a step that launches them one by one, whatever else it fuses away."""
    ops = {"aten::mm": torch.mm, "aten::bmm": torch.bmm, "aten::addmm": torch.addmm, "aten::baddbmm": torch.baddbmm}
    calls = []
    for name, shapes in products:
        args = [torch.randn(shape, device=device) for shape in shapes[:_PRODUCTS[name]]]
        calls.append((ops[name], args))
    best = float("inf")
    for _ in range(5):
        _sync(device)
        t = time.perf_counter()
        for fn, args in calls:
            fn(*args)
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def _sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


class _Transformers:
    """transformers' batched ``generate`` on the same checkpoint; decode = total - prefill."""

    def __init__(self, path: Path, prompt_len: int, new_tokens: int, device: str = "cpu"):
        from transformers import DeepseekV4ForCausalLM

        self.device = torch.device(device)
        self.model = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).to(self.device).eval()
        self.prompt_len, self.new_tokens = prompt_len, new_tokens
        self.gen = torch.Generator().manual_seed(5)

    def __call__(self, n: int) -> tuple[float, float]:
        ids = torch.randint(2, 1000, (n, self.prompt_len), generator=self.gen).to(self.device)
        kw = dict(do_sample=False, pad_token_id=0)
        with torch.no_grad():
            _sync(self.device)
            t = time.perf_counter()
            self.model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
            _sync(self.device)
            prefill = time.perf_counter() - t
            t = time.perf_counter()
            self.model.generate(ids, max_new_tokens=self.new_tokens, min_new_tokens=self.new_tokens, **kw)
            _sync(self.device)
            total = time.perf_counter() - t
        decode = max(total - prefill, 1e-9)
        return n * (self.new_tokens - 1) / decode, 1000 * decode / (self.new_tokens - 1)


def measure(path: Path, streams: list[int], prompt_len: int, new_tokens: int, compare_hf: bool,
            rounds: int, device: str = "cpu", host_kernels: str = "auto",
            ) -> tuple[dict[int, tuple[float, float]], dict[int, tuple[float, float]], dict[str, float]]:
    """Median over ``rounds`` of (tok/s, step ms) per stream count, ours and transformers'
    interleaved round by round so that a machine that speeds up or slows down mid-run (shared
    CPUs do) shifts both sides alike. One unmeasured warm-up round each first."""
    ours = _Ours(path, max(streams), prompt_len, new_tokens, device, host_kernels)
    hf = _Transformers(path, prompt_len, new_tokens, device) if compare_hf else None
    runners = [("ours", ours)] + ([("hf", hf)] if hf else [])
    for _, run_one in runners:
        run_one(min(streams))
    samples: dict[str, dict[int, list[tuple[float, float]]]] = {name: {n: [] for n in streams} for name, _ in runners}
    for _ in range(rounds):
        for n in streams:
            for name, run_one in runners:
                samples[name][n].append(run_one(n))

    def med(xs: list[tuple[float, float]]) -> tuple[float, float]:
        return statistics.median(x[0] for x in xs), statistics.median(x[1] for x in xs)

    ours_figs = {n: med(v) for n, v in samples["ours"].items()}
    hf_figs = {n: med(v) for n, v in samples.get("hf", {}).items()}
    split = ours.breakdown(16 if 16 in streams else max(streams))
    split["bytes_per_token"] = footprint(ours.llm.cfg, ours.llm.model).per_token_total
    return ours_figs, hf_figs, split


def run(streams: list[int], prompt_len: int = 128, new_tokens: int = 64, compare_hf: bool = True,
        json_path: str | None = None, threads: int | None = None, rounds: int = 3, device: str = "cpu",
        host_kernels: str = "auto") -> list[Row]:
    if threads:
        torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(Path(tmp))
        ours, hf, split = measure(path, streams, prompt_len, new_tokens, compare_hf, rounds, device, host_kernels)
    rows = [Row(n, ours[n][0], ours[n][1], hf.get(n, (None, None))[0], hf.get(n, (None, None))[1]) for n in streams]
    print(render(rows, prompt_len, new_tokens, rounds, device))
    print(render_breakdown(split, rows))
    print(describe("this process (both engines ran in it)"))
    if torch.device(device).type == "cpu":  # after the RSS line: the probe's buffer is not the engines'
        print(render_roofline(split["bytes_per_token"], read_bandwidth(), rows))
    if json_path:
        Path(json_path).write_text(json.dumps({"rows": [asdict(r) | {"ratio": r.ratio} for r in rows],
                                               "breakdown": split}, indent=1))
    return rows


def render(rows: list[Row], prompt_len: int, new_tokens: int, rounds: int = 1, device: str = "cpu") -> str:
    where = f"{torch.get_num_threads()} CPU threads" if torch.device(device).type == "cpu" else device
    lines = [f"decode throughput, Appendix A config (random weights), fp32, prompt {prompt_len}, "
             f"{new_tokens} new tokens, {where}, median of {rounds} interleaved rounds",
             "",
             "| streams | ds4serve tok/s | ds4serve step ms | transformers tok/s | transformers step ms | ratio |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        hf = f"{r.hf_tok_s:.0f} | {r.hf_step_ms:.1f}" if r.hf_tok_s else "- | -"
        ratio = f"{r.ratio:.2f}x" if r.ratio else "-"
        lines.append(f"| {r.streams} | {r.ours_tok_s:.0f} | {r.ours_step_ms:.1f} | {hf} | {ratio} |")
    by = {r.streams: r for r in rows}
    if 1 in by and 16 in by:
        lines.append("")
        lines.append(f"ds4serve step time at 16 rows / 1 row: {by[16].ours_step_ms / by[1].ours_step_ms:.2f} "
                     "(target <= 2)")
    if 16 in by and by[16].ratio:
        lines.append(f"ds4serve at 16 streams vs transformers at batch 16: {by[16].ratio:.2f}x (target >= 5)")
    return "\n".join(lines)


def render_breakdown(split: dict[str, float], rows: list[Row]) -> str:
    """One line on where a decode step's time goes, and what the 5x target leaves for it."""
    if split.get("native"):
        line = (f"one {split['streams']}-stream decode step: {split['step_ms']:.1f} ms, of which {split['forward_ms']:.1f} "
                f"ms in the native host forward (one call); the rest ({split['torch_calls']:.0f} torch calls from "
                "Python) is view building, the LM head, sampling and scheduling")
    else:
        line = (f"one {split['streams']}-stream decode step: {split['step_ms']:.1f} ms ({split.get('forward_ms', 0):.1f} "
                f"ms in the torch forward), {split['torch_calls']:.0f} torch calls from Python; replaying only its "
                f"{split['products']} matrix products of >= 100 kFLOP takes {split['products_ms']:.1f} ms")
    hf = {r.streams: r for r in rows}.get(split["streams"])
    if hf and hf.hf_step_ms:
        line += f"; 5x transformers needs a {hf.hf_step_ms / 5:.1f} ms step"
    if split.get("decode_graphs", "off") != "off":
        line += (f"\ndecode graphs: {split['decode_graphs']}, {split['graph_captures']} captured, "
                 f"{split['graph_replays']} replays" + (f", TURNED OFF: {split['graphs_disabled']}"
                                                        if split.get("graphs_disabled") else ""))
    return line


def render_roofline(bytes_per_token: int, bytes_per_s: float, rows: list[Row]) -> str:
    """Single-stream decode against what streaming its weights once per token allows (``footprint``)."""
    roof = bytes_per_s / max(1, bytes_per_token)
    line = (f"memory: one decoded token reads {bytes_per_token / 2**20:.2f} MiB of weights; measured read bandwidth "
            f"{bytes_per_s / 1e9:.1f} GB/s -> 1-stream roofline {roof:.0f} tok/s")
    one = {r.streams: r for r in rows}.get(1)
    if one:
        got = 1000 / one.ours_step_ms
        line += f"; measured {got:.0f} tok/s per decode step ({got / roof:.0%}" + (
            ", above 100%: these weights fit in the CPU caches)" if got > roof else ")")
    return line
