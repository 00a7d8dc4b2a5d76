"""A prefix snapshot outside the device pool, and the file format it is written to disk in.

``Spilled`` is everything a device snapshot at ``H`` stands for, as plain host tensors: per layer the
rings of its arena entry (``swa``, ``comp_ring``, ``idx_ring``) and the pool rows (``comp_pool``,
``idx_pool``) of the ``n_full`` full pages below ``H`` followed by the partial page (when ``tail``).
Bringing it back (``SnapshotArena.import_spilled``) restores the very bytes the device snapshot held, so a
hit on a lower tier computes bit for bit what the device hit computes.

File format (one snapshot per file; no pickle, every byte checked):

=========  ==================================================================================
bytes      content
=========  ==================================================================================
8          magic ``b"DS4PFX\\x00\\x01"`` (format 1)
4          header length ``n`` (little-endian u32)
n          header, UTF-8 JSON: ``fingerprint``, ``key``, ``anchor`` (hex), ``position``,
           ``n_full``, ``tail``, ``tensors`` (``[layer, name, dtype, shape, nbytes]`` in payload
           order) and ``payload_sha256``
32         sha256 of the header bytes
rest       the payload: every tensor's raw bytes, in header order
=========  ==================================================================================

A file is valid only if the magic, the header checksum, the fingerprint, its name (derived from the
fingerprint and the key), its exact length and finally the payload checksum all agree.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass

import torch

MAGIC = b"DS4PFX\x00\x01"
SUFFIX = ".ds4pfx"
_LEN = struct.Struct("<I")
_MAX_HEADER = 1 << 24


class BadFile(ValueError):
    """A cache file that must not be used (the message says why)."""


class DamagedFile(BadFile):
    """A file of this model (its fingerprint) that is damaged: it is deleted, it only takes budget."""


@dataclass(eq=False)
class Spilled:
    key: bytes
    anchor: bytes
    position: int
    n_full: int  # full pages below ``position``
    tail: bool  # the pool rows end with the partial page of ``position``
    tensors: list[dict[str, torch.Tensor]]  # per layer: name -> host rows (rings; pools: n_full + tail pages)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.tensors for t in layer.values())


def file_name(fingerprint: str, key: bytes) -> str:
    """The file of ``key`` under ``fingerprint``: another checkpoint's file never has this name."""
    return hashlib.sha256(fingerprint.encode() + b"\x00" + key).hexdigest()[:48] + SUFFIX


def _dtype(name: str) -> torch.dtype:
    got = getattr(torch, name, None)
    if not isinstance(got, torch.dtype):
        raise BadFile(f"unknown dtype {name!r}")
    return got


def encode(sp: Spilled, fingerprint: str) -> list[bytes | memoryview]:
    """The file's bytes, as pieces (the payload is not copied into one buffer)."""
    payload, entries = [], []
    digest = hashlib.sha256()
    for li, layer in enumerate(sp.tensors):
        for name, t in layer.items():
            raw = memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())
            digest.update(raw)
            payload.append(raw)
            entries.append([li, name, str(t.dtype).removeprefix("torch."), list(t.shape), raw.nbytes])
    header = json.dumps({"fingerprint": fingerprint, "key": sp.key.hex(), "anchor": sp.anchor.hex(),
                         "position": sp.position, "n_full": sp.n_full, "tail": sp.tail, "tensors": entries,
                         "payload_sha256": digest.hexdigest()}, separators=(",", ":")).encode()
    return [MAGIC, _LEN.pack(len(header)), header, hashlib.sha256(header).digest(), *payload]


def read_header(f) -> tuple[dict, int]:
    """The checked header of the open file ``f`` and the offset its payload starts at."""
    head = f.read(len(MAGIC) + _LEN.size)
    if len(head) < len(MAGIC) + _LEN.size or head[:len(MAGIC)] != MAGIC:
        raise BadFile("not a ds4serve prefix-cache file (bad magic or too short)")
    (n,) = _LEN.unpack(head[len(MAGIC):])
    if n > _MAX_HEADER:
        raise BadFile(f"header length {n} is implausible")
    header, check = f.read(n), f.read(32)
    if len(header) != n or len(check) != 32:
        raise BadFile("truncated header")
    if hashlib.sha256(header).digest() != check:
        raise BadFile("header checksum mismatch")
    try:
        meta = json.loads(header)
        meta["payload_bytes"] = sum(int(e[4]) for e in meta["tensors"])
        for field in ("fingerprint", "key", "anchor", "position", "n_full", "tail", "payload_sha256"):
            meta[field]  # noqa: B018 (presence check)
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise BadFile(f"malformed header ({exc})") from None
    return meta, len(MAGIC) + _LEN.size + n + 32


def decode(meta: dict, payload: bytes) -> Spilled:
    """The snapshot a checked header and its payload describe (checksum verified here)."""
    if len(payload) != meta["payload_bytes"]:
        raise DamagedFile(f"payload is {len(payload)} bytes, the header says {meta['payload_bytes']}")
    if hashlib.sha256(payload).hexdigest() != meta["payload_sha256"]:
        raise DamagedFile("payload checksum mismatch")
    buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
    tensors: list[dict[str, torch.Tensor]] = []
    at = 0
    for li, name, dtype, shape, nbytes in meta["tensors"]:
        while len(tensors) <= li:
            tensors.append({})
        t = buf[at:at + nbytes].clone().view(_dtype(dtype)).reshape(shape)  # clone: aligned for the dtype
        tensors[li][name] = t
        at += nbytes
    return Spilled(key=bytes.fromhex(meta["key"]), anchor=bytes.fromhex(meta["anchor"]),
                   position=int(meta["position"]), n_full=int(meta["n_full"]), tail=bool(meta["tail"]),
                   tensors=tensors)
