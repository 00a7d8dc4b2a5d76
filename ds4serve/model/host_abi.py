"""The native host forward's binary interface: ctypes mirrors of the C descriptors (``csrc/host.h``) and
the check, at bind time, that both sides still agree (``ds4_abi``: struct sizes and fixed limits by name).

Split from ``host_forward.py`` so the layout of the descriptors is one page: a field added to a C struct
is added here in the same place, and ``abi()`` refuses a library where the two drifted apart.
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_float, c_int64, c_void_p

# the C's fixed array lengths the ctypes mirrors below need at class definition; checked against the
# library's own (ds4_abi) when it is bound, like every struct size
_MAX_RATIOS = 4
MAX_CAPTURES = 8


class _Weight(ctypes.Structure):
    _fields_ = [("p", c_void_p), ("ld", c_int64), ("kn", c_int64), ("fmt", c_int64), ("q", c_void_p),
                ("scales", c_void_p), ("bn", c_int64), ("bk", c_int64), ("sld", c_int64), ("scale_rows", c_int64)]


class _Dims(ctypes.Structure):
    _fields_ = [(n, c_int64) for n in (
        "hidden", "hc", "n_heads", "head_dim", "rope_dim", "q_lora", "o_groups", "o_lora", "idx_heads", "idx_dim",
        "idx_topk", "n_experts", "top_k", "moe_inter", "shared_inter", "vocab", "sinkhorn_iters", "scoring",
        "norm_topk", "window")] + [(n, c_float) for n in ("rms_eps", "hc_eps", "swiglu_limit", "routed_scale")]


def _fields(kind, *names):
    return [(n, kind) for n in names]


class _Layer(ctypes.Structure):
    _fields_ = (_fields(c_int64, "kind", "ratio", "comp_key", "vis_key") + _fields(_Weight, "hc_attn_fn", "hc_ffn_fn")
                + _fields(c_void_p, "hc_attn_base", "hc_attn_scale", "hc_ffn_base", "hc_ffn_scale", "attn_norm",
                          "ffn_norm")
                + _fields(_Weight, "q_a", "q_b", "kv", "o_a", "o_b") + _fields(c_void_p, "q_a_norm", "kv_norm", "sinks")
                + _fields(_Weight, "c_kv", "c_gate") + _fields(c_void_p, "c_ape", "c_norm")
                + _fields(_Weight, "i_kv", "i_gate", "i_q_b", "i_w") + _fields(c_void_p, "i_ape", "i_norm")
                + _fields(_Weight, "gate") + _fields(c_void_p, "gate_bias", "bias_vl", "tid2eid")
                + _fields(c_int64, "tid2eid_rows")
                + _fields(c_void_p, "exp_gate_up", "exp_down") + _fields(c_int64, "exp_kn", "exp_packed", "exp_q8")
                + [("qgu_codes", c_void_p * 2), ("qgu_scales", c_void_p * 2)]
                + _fields(c_void_p, "qdn_codes", "qdn_scales")
                + [("qgu_rows", c_int64 * 2), ("qgu_parts", c_int64)]
                + _fields(_Weight, "sh_gate", "sh_up", "sh_down")
                + _fields(c_int64, "has_shared") + _fields(c_void_p, "swa", "comp_ring", "comp_pool", "idx_ring",
                                                           "idx_pool")
                + _fields(c_int64, "swa_rows", "comp_ring_rows", "idx_ring_rows", "comp_pool_rows", "idx_pool_rows")
                + _fields(c_void_p, "snap_swa", "snap_comp", "snap_idx")
                + _fields(c_int64, "snap_swa_rows", "snap_comp_rows", "snap_idx_rows"))


class _Model(ctypes.Structure):
    _fields_ = (_fields(c_void_p, "embed", "embed_bf16", "image_start", "image_pad", "image_newline", "image_end", "inv_freq_main",
                        "inv_freq_comp") + _fields(c_float, "af_main", "af_comp")
                + _fields(_Weight, "head_fn") + _fields(c_void_p, "head_base", "head_scale", "final_norm")
                + _fields(_Weight, "lm_head") + [("n_layers", c_int64), ("layers", POINTER(_Layer)), ("d", _Dims)])


class _CompView(ctypes.Structure):
    _fields_ = (_fields(c_int64, "ratio", "overlap", "span", "E", "M")
                + _fields(c_void_p, "emit_slots", "emit_valid", "emit_pos", "emit_rows", "ring_dst", "ring_src"))


class _VisView(ctypes.Structure):
    _fields_ = [("R", c_int64), ("rows", c_void_p), ("valid", c_void_p)]


class _Capture(ctypes.Structure):
    _fields_ = _fields(c_int64, "ring_len", "n_old", "n_new") + _fields(c_void_p, "old_dst", "old_src", "new_dst",
                                                                          "new_src")


class _StepView(ctypes.Structure):
    _fields_ = (_fields(c_int64, "T", "Kw", "M", "after_write")
                + _fields(c_void_p, "ids", "positions", "swa_keys", "swa_dst", "swa_src", "swa_valid", "is_image")
                + [("n_image_rows", c_int64)] + _fields(c_void_p, "image_rows", "image_embeds")
                + _fields(c_int64, "n_comp", "n_vis", "n_cap")
                + [("comp", _CompView * _MAX_RATIOS), ("vis", _VisView * _MAX_RATIOS),
                   ("cap", _Capture * MAX_CAPTURES)])


class _Arena(ctypes.Structure):
    _fields_ = [("buf", c_void_p), ("cap", c_int64), ("used", c_int64)]


_MIRRORS = {"Weight": _Weight, "Dims": _Dims, "Layer": _Layer, "Model": _Model, "CompView": _CompView,
            "VisView": _VisView, "Capture": _Capture, "StepView": _StepView, "Arena": _Arena}


def abi(lib: ctypes.CDLL) -> dict[str, int]:
    """The library's struct sizes and limits by name (``ds4_abi``); a mismatch with the ctypes mirrors
    here raises (a field added on one side only would shift every field after it)."""
    names = [n for n in lib.ds4_abi_names().decode().split(",") if n]
    values = (c_int64 * len(names))()
    if lib.ds4_abi(values, len(names)) != len(names):
        raise RuntimeError("the host forward's ABI table and its names disagree")
    abi = dict(zip(names, values))
    mirrors = {n: ctypes.sizeof(t) for n, t in _MIRRORS.items()} | {"MAX_RATIOS": _MAX_RATIOS,
                                                                    "MAX_CAPTURES": MAX_CAPTURES}
    wrong = [f"{n}: C {abi.get(n)} vs Python {v}" for n, v in mirrors.items() if abi.get(n) != v]
    if wrong:
        raise RuntimeError("the host forward's C structs or limits do not match host_forward.py's mirrors ("
                           + "; ".join(wrong) + "): the C and the Python were changed apart")
    return abi
