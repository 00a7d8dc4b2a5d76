"""Command line: ``ds4serve {serve, generate, info}``.

Environment variables are read here or in ``config.py`` only.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "ds4v-tiny"


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be integers separated by commas or spaces: {text!r}")
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty")
    return ids


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, required=True, help="checkpoint directory (config.json + safetensors)")
    p.add_argument("--device", default=os.environ.get("DS4SERVE_DEVICE", "cpu"), help="cpu, cuda, cuda:1 ...")
    p.add_argument("--dtype", default="float32", help="float32 or bfloat16")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ds4serve", description="Serve DeepSeek-V4 / DS4V models.")
    parser.add_argument("--log-level", default=os.environ.get("DS4SERVE_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    serve.add_argument("--model", type=Path, default=None,
                       help="checkpoint directory (default: the bundled tiny model)")
    serve.add_argument("--host", default=os.environ.get("DS4SERVE_HOST", "127.0.0.1"))
    serve.add_argument("--port", type=int, default=int(os.environ.get("DS4SERVE_PORT", "8000")))
    serve.add_argument("--api-key", default=os.environ.get("DS4SERVE_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on /v1 and /metrics")
    serve.add_argument("--insecure-no-auth", action="store_true",
                       help="allow binding a non-loopback address without an API key")
    serve.add_argument("--served-model-name", default=None, help="model id in the API (default: directory name)")
    serve.add_argument("--device", default=os.environ.get("DS4SERVE_DEVICE", "cpu"))
    serve.add_argument("--dtype", default="float32")
    serve.add_argument("--max-seqs", type=int, default=16, help="concurrent sequence slots")
    serve.add_argument("--max-model-len", type=int, default=None, help="longest prompt + completion")
    serve.add_argument("--kv-budget", default=None, help="paged state budget: tokens (64k) or bytes (2GiB)")
    serve.add_argument("--host-budget", default=None, help="host memory for suspended requests (bytes)")
    serve.add_argument("--step-tokens", type=int, default=256, help="step budget in tokens")
    serve.add_argument("--max-queue", type=int, default=256, help="waiting requests before 503")
    serve.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    serve.add_argument("--max-body-bytes", type=int, default=48 * 2**20)
    serve.add_argument("--default-max-tokens", type=int, default=1024)
    serve.add_argument("--vision-device", default=None, help="run the DS4V vision encoder on this device")
    serve.add_argument("--image-rows-budget", default=None, help="memory for retained image rows (e.g. 512MiB)")
    serve.add_argument("--allow-image-hosts", default="",
                       help="comma-separated hosts (or *.domain) that http(s) image URLs may come from; "
                            "empty (default): only base64 data: URLs")

    gen = sub.add_parser("generate", help="generate from token-id prompts (batched)")
    _add_model_args(gen)
    gen.add_argument("--prompt-ids", type=_parse_ids, action="append", required=True,
                     help="comma-separated token ids; repeat the flag for several prompts (run together)")
    gen.add_argument("--max-tokens", type=int, default=16)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)

    info = sub.add_parser("info", help="print the model config and per-sequence state sizes")
    _add_model_args(info)

    bench = sub.add_parser("bench", help="benchmarks (not tests): measured figures and ratios")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    eng = bsub.add_parser("engine", help="decode tok/s at several stream counts vs transformers' generate")
    eng.add_argument("--streams", default="1,4,16,32", help="comma-separated concurrency levels")
    eng.add_argument("--prompt-len", type=int, default=128)
    eng.add_argument("--new-tokens", type=int, default=64)
    eng.add_argument("--no-transformers", action="store_true", help="skip the transformers side")
    eng.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    eng.add_argument("--json", default=None, help="also write the figures to this JSON file")
    img = bsub.add_parser("images", help="text-stream pauses while image requests prefill; concurrency gain")
    img.add_argument("--model", type=Path, default=None, help="a DS4V checkpoint (default: the bundled model)")
    img.add_argument("--step-tokens", type=int, default=24)
    img.add_argument("--threads", type=int, default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        return _serve(args)
    if args.command == "info":
        return _info(args)
    if args.command == "bench":
        return _bench(args)
    return _generate(args)


def _serve(args) -> int:
    from .config import EngineSettings
    from .server.launch import BindError, build_state, check_binding, run
    from .server.serving import ServerLimits
    from .tiny.random_model import default_model

    try:
        check_binding(args.host, args.api_key, args.insecure_no_auth)
    except BindError as exc:
        print(f"ds4serve: {exc}", file=sys.stderr)
        return 2
    random_weights = False
    model = args.model
    served = args.served_model_name
    if model is None:
        model, random_weights = default_model()
        served = served or "ds4v-tiny"  # the same id before and after the trained model ships
    settings = EngineSettings(max_seqs=args.max_seqs, max_model_len=args.max_model_len, kv_budget=args.kv_budget,
                              host_budget=args.host_budget, step_tokens=args.step_tokens, max_queue=args.max_queue,
                              image_rows_budget=args.image_rows_budget)
    limits = ServerLimits(request_timeout_s=args.request_timeout, max_body_bytes=args.max_body_bytes,
                          default_max_tokens=args.default_max_tokens)
    hosts = tuple(h.strip() for h in args.allow_image_hosts.split(",") if h.strip())
    state = build_state(Path(model), device=args.device, dtype=args.dtype, settings=settings, limits=limits,
                        api_key=args.api_key, served_name=served, random_weights=random_weights,
                        vision_device=args.vision_device, image_hosts=hosts)
    run(state, args.host, args.port, args.log_level)
    return 0


def _bench(args) -> int:
    if args.bench_command == "engine":
        from .bench.engine_bench import run

        streams = [int(x) for x in args.streams.split(",") if x.strip()]
        run(streams, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
            compare_hf=not args.no_transformers, json_path=args.json, threads=args.threads)
        return 0
    if args.bench_command == "images":
        from .bench.images_bench import run as run_images

        run_images(args.model, step_tokens=args.step_tokens, threads=args.threads)
        return 0
    raise SystemExit(f"unknown bench {args.bench_command}")


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


def _generate(args) -> int:
    from .llm import LLM

    longest = max(len(p) for p in args.prompt_ids) + args.max_tokens
    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_seqs=min(16, len(args.prompt_ids)),
              max_model_len=longest, progress=True)
    outs = llm.generate(args.prompt_ids, max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    for out in outs:
        print(",".join(str(t) for t in out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
