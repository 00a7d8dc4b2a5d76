"""The engine's knobs (``EngineSettings``) and the size budgets they are given in.

Each knob has a safe default, resolved against the model and the device at start-up
(``runtime/sizing.py``); a value out of range is a :class:`~ds4serve.config.ConfigError` naming it.
The server's own knobs are ``server/limits.py`` ``ServerLimits``; the model's are ``config.py``
``ModelConfig``. Environment variables are read in ``environment.py`` and the CLI only (DESIGN §8.1).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from .config import ConfigError

_SIZE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_budget(value: str | int | None) -> tuple[str, int] | None:
    """``"4096"``/``4096``/``"64k"`` -> ("tokens", n); ``"512MiB"``/``"2GB"`` -> ("bytes", n)."""
    if value is None:
        return None
    if isinstance(value, int):
        return ("tokens", value)
    text = str(value).strip().lower().replace(" ", "")
    for unit in sorted(_SIZE_UNITS, key=len, reverse=True):
        if text.endswith(unit) and text[: -len(unit)].replace(".", "", 1).isdigit():
            return ("bytes", int(float(text[: -len(unit)]) * _SIZE_UNITS[unit]))
    mult = 1
    if text.endswith("k"):
        text, mult = text[:-1], 1024
    if not text.isdigit():
        raise ConfigError(f"budget {value!r}: use a token count (4096, 64k) or a size (512MiB, 2GB)")
    return ("tokens", int(text) * mult)


def parse_bytes(value: str | int | None, name: str) -> int | None:
    """A size in bytes: ``4096``/``"4096"`` (plain bytes), ``"512MiB"``, ``"2GB"``; None stays None."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    try:
        got = parse_budget(value)
    except ConfigError:
        got = None
    if got is None or got[0] != "bytes":
        raise ConfigError(f"{name} must be a size in bytes, e.g. 0, 4096, 512MiB or 2GB; got {value!r}")
    return got[1]


HOST_KERNEL_MODES = ("auto", "on", "off")
MOE_ACTIVATION_MODES = ("auto", "int8", "fp32")  # model/host_q8.py MOE_ACTIVATIONS (a test holds them equal)
HEAD_ACTIVATION_MODES = ("auto", "bf16", "fp32")  # model/host_pairs.py HEAD_ACTIVATIONS (likewise)
FP8_ACTIVATION_MODES = ("auto", "bf16", "fp32")  # model/host_f8pairs.py FP8_ACTIVATIONS (likewise)
# settings fields with a fixed set of values (cli)
ENGINE_CHOICES = {"host_kernels": HOST_KERNEL_MODES, "moe_activations": MOE_ACTIVATION_MODES,
                  "head_activations": HEAD_ACTIVATION_MODES, "fp8_activations": FP8_ACTIVATION_MODES}
PACKED_MODES = ("auto", "on", "off")  # serve --packed-experts (runtime.capacity.choose_packed_experts)


SPEC_METHODS = ("ngram", "dspark", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """``--speculative-config``: vLLM's JSON shape (``method``, ``num_speculative_tokens``,
    ``prompt_lookup_min`` / ``prompt_lookup_max``) plus ours: ``prompt_lookup_window`` (tokens of history the
    n-gram lookup searches), ``confidence_threshold`` (a DSpark / MTP block is cut where the drafter's
    survival estimate falls below it), ``acceptance`` (``coupled``: a seeded request's sampled stream is
    plain decoding's whatever was drafted; ``rejection``: Leviathan rejection sampling, engine/model_drafts.py) and ``draft_share`` (the share of a step's calibrated spare rows drafts may
    take; scheduler/drafting.py)."""

    method: str
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    prompt_lookup_window: int = 4096
    draft_share: float = 0.5
    confidence_threshold: float = 0.0  # a checkpoint drafter's block is cut where its survival falls below this
    acceptance: str = "coupled"  # a checkpoint drafter's sampled drafts: "coupled" or "rejection" (model_drafts)

    def __post_init__(self) -> None:
        checks = [
            (self.method in SPEC_METHODS, f"speculative method must be one of {', '.join(SPEC_METHODS)}"),
            (1 <= self.num_speculative_tokens <= 16, "num_speculative_tokens must be in [1, 16]"),
            (1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
             "prompt_lookup_min must be >= 1 and <= prompt_lookup_max"),
            (self.prompt_lookup_window >= self.prompt_lookup_max + 1,
             "prompt_lookup_window must be longer than prompt_lookup_max"),
            (0 < self.draft_share <= 1, "draft_share must be in (0, 1]"),
            (0 <= self.confidence_threshold < 1, "confidence_threshold must be in [0, 1)"),
            (self.acceptance in ("coupled", "rejection"), "acceptance must be \"coupled\" or \"rejection\""),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(f"--speculative-config: {msg}")


def parse_speculative(value: str | dict | None) -> SpeculativeConfig | str | None:
    """A JSON object (or dict) -> ``SpeculativeConfig``; ``"auto"`` stays "auto" (the runtime picks what the
    checkpoint has); None / "" / "off" -> None. Unknown keys are refused, naming them."""
    if value is None or value in ("", "off", "none"):
        return None
    if value == "auto":
        return "auto"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--speculative-config is not JSON ({exc.msg}); e.g. "
                              '\'{"method": "ngram", "num_speculative_tokens": 4}\' or auto') from None
    if not isinstance(value, dict) or "method" not in value:
        raise ConfigError('--speculative-config needs a JSON object with a "method" (ngram, dspark or mtp)')
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(f"--speculative-config: unknown keys {unknown}; known: {sorted(known)}")
    for f in fields(SpeculativeConfig):
        kind = {"str": str, "int": int, "float": (int, float)}[f.type]
        if f.name in value and (not isinstance(value[f.name], kind) or isinstance(value[f.name], bool)):
            raise ConfigError(f"--speculative-config: {f.name} must be {f.type}, got {value[f.name]!r}")
    return SpeculativeConfig(**value)


@dataclass(frozen=True)
class EngineSettings:
    """Knobs of the engine; every one has a safe default (resolved against the model and device)."""

    max_seqs: int = 16  # sequence slots (fixed state allocated for each at start-up)
    max_model_len: int | None = None  # longest prompt + completion; default min(model max, 8192)
    kv_budget: str | int | None = None  # paged state budget: tokens ("64k") or bytes ("2GiB")
    host_budget: str | int | None = None  # host memory for suspended sequences (bytes; default 1 GiB)
    step_tokens: int = 256  # step budget in tokens; in row-layers it is step_tokens x num_layers
    max_prefill_tokens: int = 1024  # largest prefill chunk / pass (rows), also the staging size per slot
    min_prefill_tokens: int = 16  # prefill progress guaranteed per step even when decoders fill the budget
    # time-calibrated budget: a step that carries prefill takes at most this many times the pure-decode
    # step of the same decoders (costs measured at start-up, runtime/calibrate.py); 0: step_tokens alone
    max_stall: float = 2.0
    prefill_mode: str = "chunk"  # text prefill: "chunk" (token chunks with decode) or "layers" (layer slices)
    max_queue: int = 256  # waiting requests beyond this are refused (HTTP 503)
    page_tokens: int | None = None  # raw positions per page (multiple of every compress ratio)
    image_rows_budget: str | int | None = None  # retained encoded image rows (bytes; default 256 MiB)
    warmup: bool = True  # run a warm-up request through every path at start-up
    # pure-decode steps, one of engine.decode_graphs.MODES ("auto": CUDA graphs on CUDA, else off); checked
    # by the runtime (this module sits below the engine and does not restate the list)
    decode_graphs: str = "auto"
    # text forwards (decode rows and prefill chunks) on the host as one native call per step
    # (model/host_forward.py): "auto" where it applies (host, fp32, one process; else the torch path,
    # reason logged), "on" (start-up fails where it cannot), "off" (the torch path always)
    host_kernels: str = "auto"
    # packed MXFP4 experts in the native forward: "int8" multiplies on int8 activations (host_q8.c, as
    # llama.cpp does), "fp32" on fp32 ones (exactly dequantise-at-load); "auto": int8 where it applies
    moe_activations: str = "auto"
    # a bf16 LM head in the native forward: "bf16" rounds its input rows to bf16 and adds bf16 pairs
    # (host_pairs.c, as llama.cpp does), "fp32" multiplies the fp32 rows (exactly the dequantised head);
    # "auto": bf16 where the CPU has AVX-512 BF16
    head_activations: str = "auto"
    # FP8 projections in the native forward: "bf16" rounds their input rows to bf16 and adds bf16 pairs
    # of the decoded codes (host_f8pairs.c), "fp32" multiplies the fp32 rows (exactly the dequantised
    # weights); "auto": bf16 where the CPU has AVX-512 BF16 and VBMI
    fp8_activations: str = "auto"
    # prefix cache (cache/prefix.py): content-keyed shared pages + ring snapshots every ``prefix_interval``
    # prompt tokens, at the end of every prompt and output; budget: bytes (default: a share of the pool)
    enable_prefix_caching: bool = True
    prefix_cache_budget: str | int | None = None
    prefix_interval: int = 256
    # lower prefix-cache tiers (cache/tiers.py): host memory (bytes; default min(1 GiB, 1/16 of the free
    # host memory); 0: off), then files in ``prefix_cache_dir`` (off unless set; bytes, default min(16 GiB,
    # half the free disk)), kept across restarts
    prefix_cache_host_bytes: str | int | None = None
    prefix_cache_dir: str | None = None
    prefix_cache_disk_bytes: str | int | None = None
    # speculative decoding: a SpeculativeConfig, its JSON (parse_speculative), "auto" or None (off)
    speculative: SpeculativeConfig | str | None = None

    def __post_init__(self) -> None:
        checks = [
            (self.max_seqs >= 1, "max_seqs must be >= 1"),
            (self.step_tokens >= 1, "step_tokens must be >= 1"),
            (self.max_stall == 0 or self.max_stall > 1, "max_stall must be 0 (off) or > 1"),
            (self.max_prefill_tokens >= 16, "max_prefill_tokens must be >= 16"),
            (1 <= self.min_prefill_tokens <= self.max_prefill_tokens,
             "min_prefill_tokens must be in [1, max_prefill_tokens]"),
            (self.prefill_mode in ("chunk", "layers"), "prefill_mode must be 'chunk' or 'layers'"),
            (self.max_queue >= 1, "max_queue must be >= 1"),
            (self.max_model_len is None or self.max_model_len >= 2, "max_model_len must be >= 2"),
            (self.prefix_interval >= 16, "prefix_interval must be >= 16 tokens"),
            (self.host_kernels in HOST_KERNEL_MODES, f"host_kernels must be one of {', '.join(HOST_KERNEL_MODES)}"),
            (self.moe_activations in MOE_ACTIVATION_MODES,
             f"moe_activations must be one of {', '.join(MOE_ACTIVATION_MODES)}"),
            (self.head_activations in HEAD_ACTIVATION_MODES,
             f"head_activations must be one of {', '.join(HEAD_ACTIVATION_MODES)}"),
            (self.fp8_activations in FP8_ACTIVATION_MODES,
             f"fp8_activations must be one of {', '.join(FP8_ACTIVATION_MODES)}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            object.__setattr__(self, "speculative", parse_speculative(self.speculative))
        parse_budget(self.kv_budget)
        parse_budget(self.host_budget)
        for name in ("image_rows_budget", "prefix_cache_budget"):
            got = parse_budget(getattr(self, name))
            if got is not None and got[0] != "bytes":
                raise ConfigError(f"{name} is a size in bytes, e.g. 256MiB")
        for name in ("prefix_cache_host_bytes", "prefix_cache_disk_bytes"):
            parse_bytes(getattr(self, name), name)
