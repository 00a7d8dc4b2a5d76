"""Command line: ``ds4serve {serve, generate, info}``.

Environment variables are read here or in ``environment.py`` only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from .chat.dsml import EFFORT_PROMPTS
from .server.keys import KEYS_FILE_FORMAT
from .server.limits import THINKING_MODES, ServerLimits
from .settings import ENGINE_CHOICES, PACKED_MODES, EngineSettings

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "ds4v-tiny"

# `serve` flags that set a settings field: flag -> (field, type, help). The default is the field's
# own (``EngineSettings`` / ``ServerLimits``), so it lives in one place; flag names never change.
_ENGINE_FLAGS = {
    "--max-seqs": ("max_seqs", int, "concurrent sequence slots"),
    "--max-model-len": ("max_model_len", int, "longest prompt + completion"),
    "--kv-budget": ("kv_budget", str, "paged state budget: tokens (64k) or bytes (2GiB)"),
    "--host-budget": ("host_budget", str, "host memory for suspended requests (bytes)"),
    "--step-tokens": ("step_tokens", int, "step budget in tokens"),
    "--max-stall": ("max_stall", float, "a step carrying prefill takes at most this many times its decoders' "
                    "pure-decode step (costs measured at start-up; 0: step tokens alone)"),
    "--max-queue": ("max_queue", int, "waiting requests before 503"),
    "--decode-graphs": ("decode_graphs", str, "pure-decode steps as replayed CUDA graphs (auto: on for CUDA devices)"),
    "--host-kernels": ("host_kernels", str, "text forwards on the host as one native call per step: auto (where it "
                       "applies: host, float32, one process), on (fail where it cannot), off (the torch path)"),
    "--moe-activations": ("moe_activations", str, "packed MXFP4 experts multiply int8 (as llama.cpp) or fp32 inputs"),
    "--head-activations": ("head_activations", str, "a bf16 LM head multiplies bf16 (auto: with AVX-512 BF16) or fp32 inputs"),
    "--fp8-activations": ("fp8_activations", str, "FP8 projections multiply bf16 (auto: with AVX-512 BF16 + VBMI) or fp32 inputs"),
    "--image-rows-budget": ("image_rows_budget", str, "memory for retained image rows (e.g. 512MiB)"),
    "--enable-prefix-caching": ("enable_prefix_caching", bool, "reuse the state of prompt prefixes seen before "
                                "(vLLM's flag; --no-enable-prefix-caching turns it off)"),
    "--prefix-cache-budget": ("prefix_cache_budget", str, "memory the prefix cache may keep, in bytes (e.g. "
                              "256MiB; None: a share of the state pool)"),
    "--prefix-interval": ("prefix_interval", int, "prompt tokens between prefix-cache snapshots"),
    "--prefix-cache-host-bytes": ("prefix_cache_host_bytes", str, "host memory for prefix snapshots evicted from "
                                  "the device pool (e.g. 2GiB; 0: off; None: min(1 GiB, 1/16 of free memory))"),
    "--prefix-cache-dir": ("prefix_cache_dir", str, "directory for prefix snapshots leaving host memory, kept "
                           "across restarts (None: no disk tier)"),
    "--prefix-cache-disk-bytes": ("prefix_cache_disk_bytes", str, "disk budget of --prefix-cache-dir (e.g. 50GB; "
                                  "None: min(16 GiB, half the free space))"),
    "--speculative-config": ("speculative", str, "speculative decoding, vLLM's JSON shape, e.g. '{\"method\": "
                             "\"ngram\", \"num_speculative_tokens\": 4}'; auto: the checkpoint's drafter if it has one"),
}
_SERVER_FLAGS = {
    "--request-timeout": ("request_timeout_s", float, "seconds per request"),
    "--max-body-bytes": ("max_body_bytes", int, "larger request bodies are refused with 413"),
    "--default-max-tokens": ("default_max_tokens", int, "max_tokens when the request sends none"),
    "--default-thinking": ("default_thinking", str, "DS4 thinking mode of chat requests that do not choose one"),
    "--no-webui": ("webui", bool, "do not serve the chat page at / (a 404 there)"),
}
_CHOICES = {"default_thinking": THINKING_MODES, **ENGINE_CHOICES}


class _DecodeGraphModes:
    """``engine.decode_graphs.MODES`` (the one list of modes), imported on first use so that
    ``ds4serve --help`` does not import torch."""

    @staticmethod
    def _modes() -> tuple[str, ...]:
        from .engine.decode_graphs import MODES  # noqa: PLC0415

        return MODES

    def __contains__(self, mode: object) -> bool:
        return mode in self._modes()

    def __iter__(self) -> Iterator[str]:
        return iter(self._modes())


def _add_settings_flags(p: argparse.ArgumentParser, cls: type, table: dict) -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    for flag, (name, typ, text) in table.items():
        metavar = flag[2:].upper().replace("-", "_")
        if name == "decode_graphs":  # an explicit metavar keeps argparse from listing the modes at build time
            metavar, text, extra = "MODE", text + "; one of %(choices)s", {"choices": _DecodeGraphModes()}
        else:
            metavar, extra = ("|".join(_CHOICES[name]), {"choices": _CHOICES[name]}) if name in _CHOICES else (metavar, {})
        if typ is bool:
            _add_switch(p, flag, name, defaults[name], text)
            continue
        p.add_argument(flag, dest=name, type=typ, default=defaults[name], metavar=metavar,
                       help=f"{text} (default: {defaults[name]})", **extra)


def _add_switch(p: argparse.ArgumentParser, flag: str, name: str, default: bool, text: str) -> None:
    """A bool field's flag. "--no-X" only turns a default-on feature off (``--no-webui``); any other
    name gets both forms, "--X" and "--no-X" (argparse's BooleanOptionalAction, vLLM's convention for
    ``--enable-prefix-caching``), so a script can state either choice whatever the default."""
    if flag.startswith("--no-"):
        p.add_argument(flag, dest=name, action="store_false", default=default, help=text)
    else:
        p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=default,
                       help=f"{text} (default: {'on' if default else 'off'})")


def _settings(args: argparse.Namespace, cls: type, table: dict):
    """The settings dataclass from the parsed flags of ``table`` (other fields keep their defaults)."""
    return cls(**{name: getattr(args, name) for name, _, _ in table.values()})


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
    _add_serve(sub)
    _add_generate_and_info(sub)
    from .cli_tiny import add_tiny_parser

    add_tiny_parser(sub)
    _add_bench(sub)
    return parser


def _add_serve(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    serve.add_argument("--model", type=Path, default=None,
                       help="checkpoint directory (default: the bundled tiny model)")
    serve.add_argument("--host", default=os.environ.get("DS4SERVE_HOST", "127.0.0.1"))
    serve.add_argument("--port", type=int, default=int(os.environ.get("DS4SERVE_PORT", "8000")))
    serve.add_argument("--api-key", action="append", default=None, metavar="[NAME=]KEY",
                       help="require 'Authorization: Bearer KEY' on /v1, /metrics, the tokenizer routes and "
                            "/reset_prefix_cache; repeat for several keys; NAME (default key-1, key-2 ...) is "
                            "what logs and metrics show; a KEY holding '=' needs a NAME (default: "
                            "$DS4SERVE_API_KEY, when set)")
    serve.add_argument("--api-key-file", action="append", default=[], metavar="PATH",
                       help=f"more API keys from a file: {KEYS_FILE_FORMAT} (repeatable)")
    serve.add_argument("--insecure-no-auth", action="store_true",
                       help="allow binding a non-loopback address without an API key")
    serve.add_argument("--served-model-name", default=None, help="model id in the API (default: directory name)")
    serve.add_argument("--device", default=os.environ.get("DS4SERVE_DEVICE", "cpu"))
    serve.add_argument("--dtype", default="float32")
    _add_settings_flags(serve, EngineSettings, _ENGINE_FLAGS)
    _add_settings_flags(serve, ServerLimits, _SERVER_FLAGS)
    serve.add_argument("--vision-device", default=None, help="run the DS4V vision encoder on this device")
    serve.add_argument("--packed-weights", "--packed-experts", dest="packed_weights", nargs="?", const="on",
                       default="auto", choices=PACKED_MODES,
                       help="keep weights in memory as the checkpoint stores them: MXFP4 / FP8 routed experts, FP8 "
                            "projections, a bf16 embedding and LM head (the log lists bytes per class). On a CPU the "
                            "native forward decodes them in registers (4x fewer bytes than fp32 for FP8, 7.5x for "
                            "MXFP4); on CUDA Triton GEMMs run packed experts (not yet run on a GPU). auto (the "
                            "default): as stored wherever the native host forward runs; elsewhere experts packed "
                            "only when dequantised ones would not fit. The flag alone means on. --packed-experts is "
                            "the same setting under its former name")
    serve.add_argument("--threads", type=int, default=None,
                       help="CPU threads of torch and of the native host forward (default: torch's choice, "
                            "usually one per core)")
    serve.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                       help="ranks (one process per device: cuda:0..N-1, or N CPU processes over gloo)")
    serve.add_argument("--enable-expert-parallel", action="store_true", help="whole routed experts per rank")
    serve.add_argument("--tp-timeout", type=float, default=300.0,
                       help="seconds a tensor-parallel collective may take before the server stops (a rank died or hangs)")
    serve.add_argument("--nnodes", type=int, default=1, help="nodes the tensor-parallel group spans; every node runs "
                       "the same command with its own --node-rank (torchrun's RANK, WORLD_SIZE, LOCAL_RANK, "
                       "MASTER_ADDR, MASTER_PORT stand in for these flags)")
    serve.add_argument("--node-rank", type=int, default=0, help="this node, 0..nnodes-1: 0 serves HTTP, the others "
                       "only run their ranks")
    serve.add_argument("--dist-init-addr", default=None, help="HOST:PORT on node 0 where the nodes meet")
    serve.add_argument("--dist-timeout", type=float, default=600.0, help="seconds the nodes may take to meet")
    serve.add_argument("--chat-encoding", default="auto", choices=("auto", *EFFORT_PROMPTS),
                       help="the reasoning-effort prompts to render: v4 (the first DeepSeek-V4-Flash encoder: "
                            "max = 'Absolute maximum') or v4-vision (Vision-Exp / 0731: high = 'Absolute maximum', "
                            "max = 'Beyond maximum'); auto (the default): the checkpoint's encoding/ folder, else "
                            "its config.json, else v4-vision; the start-up log says which and why")
    serve.add_argument("--allow-image-hosts", default="",
                       help="comma-separated hosts (or *.domain) that http(s) image URLs may come from; "
                            "empty (default): only base64 data: URLs")


def _add_generate_and_info(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="generate from token-id prompts (batched)")
    _add_model_args(gen)
    gen.add_argument("--prompt-ids", type=_parse_ids, action="append", required=True,
                     help="comma-separated token ids; repeat the flag for several prompts (run together)")
    gen.add_argument("--max-tokens", type=int, default=16)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)

    info = sub.add_parser("info", help="print the model config and per-sequence state sizes")
    _add_model_args(info)
    from .cli_inspect import add_plan_parser

    add_plan_parser(sub)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks (not tests): measured figures and ratios")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    eng = bsub.add_parser("engine", help="decode tok/s at several stream counts vs transformers' generate")
    eng.add_argument("--streams", default="1,4,16,32", help="comma-separated concurrency levels")
    eng.add_argument("--prompt-len", type=int, default=128)
    eng.add_argument("--new-tokens", type=int, default=64)
    eng.add_argument("--no-transformers", action="store_true", help="skip the transformers side")
    eng.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    eng.add_argument("--json", default=None, help="also write the figures to this JSON file")
    eng.add_argument("--rounds", type=int, default=3, help="interleaved rounds per stream count (median kept)")
    eng.add_argument("--device", default="cpu", help="cpu or cuda (both engines run there, fp32)")
    eng.add_argument("--host-kernels", default="auto", choices=ENGINE_CHOICES["host_kernels"],
                     help="ds4serve's native host forward (auto: where it applies; off: the torch path)")
    _add_bench_serve(bsub)
    peer = bsub.add_parser("peer", help="ds4serve vs transformers (serve and batched generate), same checkpoint")
    peer.add_argument("--concurrency", default="1,4,16")
    peer.add_argument("--requests", type=int, default=32)
    peer.add_argument("--max-tokens", type=int, default=32)
    peer.add_argument("--no-transformers-serve", action="store_true")
    peer.add_argument("--threads", type=int, default=None)
    ch = bsub.add_parser("chaos", help="seeded storm of real traffic with aborts and bad input; checks invariants")
    ch.add_argument("--model", type=Path, default=None)
    ch.add_argument("--seed", type=int, default=0)
    ch.add_argument("--requests", type=int, default=2000)
    ch.add_argument("--rate", type=float, default=8.0, help="arrivals per second (the tiny pool serves ~6/s)")
    ch.add_argument("--log", type=Path, default=Path("chaos.jsonl"), help="every request and its outcome (replay)")
    img = bsub.add_parser("images", help="text-stream pauses while image requests prefill; concurrency gain")
    img.add_argument("--model", type=Path, default=None, help="a DS4V checkpoint (default: the bundled model)")
    img.add_argument("--step-tokens", type=int, default=24)
    img.add_argument("--threads", type=int, default=None)
    img.add_argument("--rounds", type=int, default=5, help="interleaved sliced / whole rounds (figures are medians)")
    sp = bsub.add_parser("spec", help="decode tok/s with and without speculative drafts; acceptance per position")
    sp.add_argument("--model", type=Path, default=None, help="a checkpoint (default: the bundled model)")
    sp.add_argument("--streams", default="1,4,16", help="comma-separated concurrency levels")
    sp.add_argument("--new-tokens", type=int, default=128)
    sp.add_argument("--rounds", type=int, default=3, help="interleaved plain / drafted rounds (the best is kept)")
    sp.add_argument("--speculative-config", default=None, help="the drafts' config (default: n-gram, 5 tokens)")
    sp.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    sp.add_argument("--requests-per-stream", type=int, default=1, help="prompts each stream sends one by one")
    gr = bsub.add_parser("grammar", help="per-step cost of grammar-constrained decoding at N concurrent requests")
    gr.add_argument("--tokenizer", type=Path, default=None, help="a tokenizer.json or model folder (default: bundled)")
    gr.add_argument("--batch", type=int, default=16, help="concurrent constrained requests")
    gr.add_argument("--threads", type=int, default=1, help="torch CPU threads for the logit mask")
    gr.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")


def _add_bench_serve(bsub: argparse._SubParsersAction) -> None:
    """`bench serve`: the load generator's flags (its multi-turn mode's in ``_add_multiturn_flags``)."""
    srv = bsub.add_parser("serve", help="load generator for any OpenAI-compatible endpoint (ours or a peer's)")
    srv.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root or its /v1 URL")
    srv.add_argument("--launch", action="store_true",
                     help="start `ds4serve serve` (the bundled model unless --launch-model) for the run")
    srv.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    srv.add_argument("--api-key", default=None)
    srv.add_argument("--concurrency", default="1,4,16", help="comma-separated fixed concurrency levels")
    srv.add_argument("--rate", default="", help="comma-separated Poisson request rates (req/s) instead")
    srv.add_argument("--requests", type=int, default=32, help="requests per level")
    srv.add_argument("--image-fraction", type=float, default=0.25)
    srv.add_argument("--prompt-words", type=int, default=30)
    srv.add_argument("--max-tokens", type=int, default=32)
    srv.add_argument("--seed", type=int, default=0)
    srv.add_argument("--out", type=Path, default=Path("bench-out"))
    srv.add_argument("--launch-model", type=Path, default=None,
                     help="with --launch: serve this checkpoint directory (default: the bundled tiny model)")
    srv.add_argument("--launch-args", default="",
                     help="with --launch: more `ds4serve serve` flags, one string (e.g. "
                          "--launch-args='--device cuda --dtype bfloat16')")
    _add_multiturn_flags(srv)


def _add_multiturn_flags(srv: argparse.ArgumentParser) -> None:
    """`bench serve --multi-turn`: growing chat conversations, the traffic a prefix cache is for."""
    mt = srv.add_argument_group("multi-turn (--multi-turn; --model, --max-tokens, --seed, --out apply too)")
    mt.add_argument("--multi-turn", action="store_true",
                    help="concurrent conversations, each turn resending the whole history; TTFT and "
                         "cached tokens per turn")
    mt.add_argument("--conversations", type=int, default=4, help="conversations run at once")
    mt.add_argument("--turns", type=int, default=8, help="turns per conversation")
    mt.add_argument("--system-tokens", type=int, default=400,
                    help="length of the shared system prompt (sized with the server's /tokenize when it has one)")
    mt.add_argument("--user-words", type=int, default=12, help="filler words per user message, before its question")
    mt.add_argument("--images", action=argparse.BooleanOptionalAction, default=None,
                    help="attach an image every --image-every turns (default: when the server takes images)")
    mt.add_argument("--image-every", type=int, default=3)
    mt.add_argument("--image", type=Path, default=None, help="the image to attach (default: the bundled sample.png)")
    mt.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=False,
                    help="every answer exactly --max-tokens long (default off: an answer that runs past EOS "
                         "cannot be sent back as the client's history, so the next turn could not reuse its end)")
    mt.add_argument("--compare", action="store_true",
                    help="run the same conversations twice, prefix cache on then off: with --launch a second "
                         "server gets --no-enable-prefix-caching; else give --baseline-url")
    mt.add_argument("--baseline-url", default=None,
                    help="a cache-off server for the comparison (implies --compare); --base-url is the cache-on one")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        return _serve(args)
    if args.command in ("info", "plan"):
        from .cli_inspect import run_inspect

        return run_inspect(args)
    if args.command == "bench":
        return _bench(args)
    if args.command == "tiny":
        from .cli_tiny import run_tiny

        return run_tiny(args)
    return _generate(args)


def _serve(args) -> int:
    from .server.keys import KeyConfigError, load_keys
    from .config import ConfigError
    from .runtime.tp_group import ParallelSettings, run_node
    from .runtime.rendezvous import resolve
    from .server.launch import BindError, build_state, check_binding, run
    from .tiny.random_model import default_model

    flags = args.api_key
    if flags is None:  # $DS4SERVE_API_KEY stands in for --api-key, never adds to it
        flags = [os.environ["DS4SERVE_API_KEY"]] if os.environ.get("DS4SERVE_API_KEY") else []
    try:
        keys = load_keys(flags, args.api_key_file)
        check_binding(args.host, keys, args.insecure_no_auth)
        parallel = resolve(ParallelSettings(args.tensor_parallel_size, args.enable_expert_parallel, args.tp_timeout,
                                            nnodes=args.nnodes, node_rank=args.node_rank,
                                            dist_init_addr=args.dist_init_addr, join_timeout_s=args.dist_timeout),
                           os.environ)
    except (BindError, KeyConfigError, ConfigError) as exc:
        print(f"ds4serve: {exc}", file=sys.stderr)
        return 2
    import torch

    if args.threads is not None:
        if args.threads < 1:
            print("ds4serve: --threads must be >= 1", file=sys.stderr)
            return 2
        torch.set_num_threads(args.threads)
    logging.getLogger(__name__).info("torch uses %d CPU threads", torch.get_num_threads())
    random_weights = False
    model = args.model
    served = args.served_model_name
    if model is None:
        model, random_weights = default_model()
        served = served or "ds4v-tiny"  # the same id before and after the trained model ships
    settings = _settings(args, EngineSettings, _ENGINE_FLAGS)
    limits = _settings(args, ServerLimits, _SERVER_FLAGS)
    hosts = tuple(h.strip() for h in args.allow_image_hosts.split(",") if h.strip())
    try:
        if parallel.node_rank:  # another node: its ranks only, no HTTP, until rank 0 stops
            return run_node(Path(model), parallel, args.device, args.dtype)
        state = build_state(Path(model), device=args.device, dtype=args.dtype, settings=settings, limits=limits,
                            api_keys=keys, served_name=served, random_weights=random_weights,
                            vision_device=args.vision_device, image_hosts=hosts,
                            packed_experts=args.packed_weights, parallel=parallel,
                            chat_encoding=None if args.chat_encoding == "auto" else args.chat_encoding)
    except ConfigError as exc:
        print(f"ds4serve: {exc}", file=sys.stderr)
        return 2
    run(state, args.host, args.port, args.log_level)
    return 0


def _launch_serve_args(args) -> list[str]:
    """The `ds4serve serve` flags `bench serve --launch` adds to its defaults."""
    import shlex

    extra = ["--model", str(args.launch_model)] if args.launch_model else []
    return extra + shlex.split(args.launch_args)


def _serve_accepts(flag: str) -> bool:
    """Whether this `ds4serve serve` parses ``flag`` (checked before a bench starts a server with it)."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return flag in sub.choices["serve"]._option_string_actions


def _bench_multiturn(args) -> int:
    """`bench serve --multi-turn`: one run, or cache on then off (two launched servers or two URLs)."""
    from .bench.launch import launched_server
    from .bench.multiturn import MultiTurnSpec, run, url_target

    compare = args.compare or args.baseline_url is not None
    serve_args = _launch_serve_args(args)
    off_flag = "--no-enable-prefix-caching"
    if compare and not args.launch and args.baseline_url is None:
        print("ds4serve: --compare needs --launch (two servers are started) or --baseline-url", file=sys.stderr)
        return 2
    if compare and args.launch and not _serve_accepts(off_flag):
        print(f"ds4serve: this `ds4serve serve` has no {off_flag}; start a cache-off server yourself and "
              "pass --baseline-url", file=sys.stderr)
        return 2

    def launched(label: str, flags: list[str]):
        return label, lambda: launched_server(flags, label=f"the launched server ({label})")

    on_label = "cache on" if compare else "run"
    targets = [launched(on_label, serve_args) if args.launch else url_target(on_label, args.base_url)]
    if compare:
        targets.append(launched("cache off", [*serve_args, off_flag]) if args.launch
                       else url_target("cache off", args.baseline_url))
    spec = MultiTurnSpec(conversations=args.conversations, turns=args.turns, system_tokens=args.system_tokens,
                         user_words=args.user_words, max_tokens=args.max_tokens, image_every=args.image_every,
                         images=args.images, image_path=args.image, seed=args.seed, ignore_eos=args.ignore_eos)
    run(targets, spec, args.model, args.out, api_key=args.api_key)
    return 0


def _bench(args) -> int:
    if args.bench_command == "engine":
        from .bench.engine_bench import run

        streams = [int(x) for x in args.streams.split(",") if x.strip()]
        run(streams, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
            compare_hf=not args.no_transformers, json_path=args.json, threads=args.threads,
            rounds=args.rounds, device=args.device, host_kernels=args.host_kernels)
        return 0
    if args.bench_command == "serve":  # one line per request from httpx would bury the tables
        logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    if args.bench_command == "serve" and args.multi_turn:
        return _bench_multiturn(args)
    if args.bench_command == "serve":
        import contextlib

        from .bench.launch import launched_server
        from .bench.serve_bench import run as run_serve

        conc = [int(x) for x in args.concurrency.split(",") if x.strip()] if not args.rate else []
        rates = [float(x) for x in args.rate.split(",") if x.strip()]
        server = launched_server(_launch_serve_args(args)) if args.launch else contextlib.nullcontext(None)
        with server as base:
            run_serve(base or args.base_url, args.model, conc, rates, args.requests, args.image_fraction,
                      args.prompt_words, args.max_tokens, args.seed, args.out, api_key=args.api_key)
        return 0
    if args.bench_command == "peer":
        from .bench.peer import run as run_peer

        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        run_peer([int(x) for x in args.concurrency.split(",")], requests=args.requests, max_tokens=args.max_tokens,
                 with_transformers_serve=not args.no_transformers_serve)
        return 0
    if args.bench_command == "chaos":
        from .bench.chaos import run as run_chaos

        report = run_chaos(args.model, args.seed, args.requests, args.log, rate=args.rate)
        return 0 if report.ok else 1
    if args.bench_command == "images":
        from .bench.images_bench import run as run_images

        run_images(args.model, step_tokens=args.step_tokens, threads=args.threads, rounds=args.rounds)
        return 0
    if args.bench_command == "spec":
        from .bench.spec_bench import run as run_spec

        run_spec(args.model, [int(x) for x in args.streams.split(",") if x.strip()], args.new_tokens, args.rounds,
                 json.loads(args.speculative_config) if args.speculative_config else None, args.json,
                 per_stream=args.requests_per_stream)
        return 0
    if args.bench_command == "grammar":
        from .bench.grammar_bench import run as run_grammar

        run_grammar(args.tokenizer, batch=args.batch, threads=args.threads, out=args.json)
        return 0
    raise SystemExit(f"unknown bench {args.bench_command}")


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
