"""The disk tier of the prefix cache: one file per snapshot in ``--prefix-cache-dir``, LRU under a byte budget.

Writes happen on a background thread fed by a bounded queue, so a decode step never waits for a disk:
``put`` hands a snapshot over and returns at once (a full queue drops it, counted, instead of
blocking). Until its file is written a queued snapshot is still found and read from memory. Each write
is atomic: a temporary file (mode 0600) in the same directory, fsync, rename, fsync of the directory;
a crash leaves either the old state or the whole new file, never half of one.

At start-up the index is rebuilt from the directory (headers only; recency from the files' mtimes),
so a restarted server keeps its hits. A file that is truncated, corrupted or written for another model
(fingerprint) is skipped with one log line naming it; a damaged file of ours is also deleted (it
would only take budget). Reads verify the payload checksum before anything reaches the pool.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from .spilled import SUFFIX, BadFile, DamagedFile, Spilled, decode, encode, file_name, read_header

log = logging.getLogger(__name__)

_STALE_TMP_S = 3600.0  # a temporary file this old is a crashed write's leftover


@dataclass
class DiskEntry:
    path: Path
    anchor: bytes
    position: int
    nbytes: int  # the file's size


class DiskTier:
    def __init__(self, root: Path, budget: int, fingerprint: str, queue_size: int = 16):
        self.root, self.budget, self.fingerprint = Path(root), int(budget), fingerprint
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, DiskEntry] = OrderedDict()  # key -> entry, least recent first
        self._by_anchor: dict[bytes, dict[bytes, int]] = {}  # anchor -> key -> position
        self._pending: dict[bytes, Spilled] = {}  # queued, not yet on disk
        self._queue: queue.Queue[Spilled | None] = queue.Queue(maxsize=queue_size)
        self.hits = self.evictions = self.skipped = self.dropped = self.writes = 0
        self.write_s = 0.0
        self.bytes = 0
        self._open_dir()
        self._scan()
        self._thread = threading.Thread(target=self._writer, name="ds4serve-prefix-disk", daemon=True)
        self._thread.start()
        atexit.register(_close_at_exit, weakref.ref(self))

    # ---- start-up ------------------------------------------------------------------------------
    def _open_dir(self) -> None:
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.root.stat().st_mode & 0o077:
            os.chmod(self.root, 0o700)  # snapshots hold what users sent: readable by the server's user only
            log.info("prefix cache: %s made private (mode 0700)", self.root)

    def _skip(self, path: Path, why: str, delete: bool) -> None:
        self.skipped += 1
        log.warning("prefix cache: skipped %s: %s%s", path, why, " (deleted)" if delete else "")
        if delete:
            path.unlink(missing_ok=True)

    def _scan(self) -> None:
        """Rebuild the index from the directory: every valid file of this fingerprint, oldest first."""
        found = []
        for path in self.root.iterdir():
            if path.name.endswith(".tmp"):
                self._clean_tmp(path)
                continue
            if not path.name.endswith(SUFFIX) or not path.is_file():
                continue
            try:
                entry, key, mtime = self._check(path)
            except BadFile as exc:
                self._skip(path, str(exc), delete=isinstance(exc, DamagedFile))
                continue
            except OSError as exc:
                self._skip(path, f"unreadable ({exc})", delete=False)
                continue
            found.append((mtime, key, entry))
        for _, key, entry in sorted(found, key=lambda f: f[0]):
            self._file(key, entry)
        self._shrink()
        log.info("prefix cache: disk tier %s: %d snapshots, %.1f MiB of %.1f MiB", self.root, len(self._index),
                 self.bytes / 2**20, self.budget / 2**20)

    def _check(self, path: Path) -> tuple[DiskEntry, bytes, float]:
        with open(path, "rb") as f:
            meta, start = read_header(f)
        st = path.stat()
        if meta["fingerprint"] != self.fingerprint:
            raise BadFile("written for another model or state layout (fingerprint differs)")
        key = bytes.fromhex(meta["key"])
        if path.name != file_name(self.fingerprint, key):
            raise DamagedFile("its name does not match the prefix it holds")
        want = start + meta["payload_bytes"]
        if st.st_size != want:
            raise DamagedFile(f"truncated or padded: {st.st_size} bytes, the header says {want}")
        return DiskEntry(path, bytes.fromhex(meta["anchor"]), int(meta["position"]), st.st_size), key, st.st_mtime

    def _clean_tmp(self, path: Path) -> None:
        try:
            if time.time() - path.stat().st_mtime > _STALE_TMP_S:
                path.unlink()
        except OSError:
            pass

    # ---- index (callers hold the lock, or run before the writer starts) ------------------------
    def _file(self, key: bytes, entry: DiskEntry) -> None:
        old = self._index.pop(key, None)
        if old is not None:
            self.bytes -= old.nbytes
        self._index[key] = entry
        self._by_anchor.setdefault(entry.anchor, {})[key] = entry.position
        self.bytes += entry.nbytes

    def _unfile(self, key: bytes) -> DiskEntry | None:
        entry = self._index.pop(key, None)
        if entry is None:
            return None
        self.bytes -= entry.nbytes
        by = self._by_anchor.get(entry.anchor, {})
        by.pop(key, None)
        if not by:
            self._by_anchor.pop(entry.anchor, None)
        return entry

    def _shrink(self) -> None:
        while self.bytes > self.budget and self._index:
            key = next(iter(self._index))
            entry = self._unfile(key)
            entry.path.unlink(missing_ok=True)
            self.evictions += 1

    # ---- lookups (engine thread) ---------------------------------------------------------------
    def candidates(self, anchor: bytes) -> list[tuple[int, bytes]]:
        """(position, key) of every snapshot filed under ``anchor``, on disk or queued."""
        with self._lock:
            got = dict(self._by_anchor.get(anchor, {}))
            got.update({k: s.position for k, s in self._pending.items() if s.anchor == anchor})
        return [(p, k) for k, p in got.items()]

    def has(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index or key in self._pending

    def load(self, key: bytes) -> Spilled | None:
        """The snapshot of ``key``, checked; None (logged, the file deleted) if its file is damaged."""
        with self._lock:
            queued = self._pending.get(key)
            entry = self._index.get(key)
            if entry is not None:
                self._index.move_to_end(key)
        if queued is not None:
            return queued
        if entry is None:
            return None
        try:
            with open(entry.path, "rb") as f:
                meta, _ = read_header(f)
                if meta["fingerprint"] != self.fingerprint or bytes.fromhex(meta["key"]) != key:
                    raise BadFile("its header changed since start-up (another model's file?)")
                sp = decode(meta, f.read())
            os.utime(entry.path)  # recency survives a restart
            return sp
        except (BadFile, OSError) as exc:
            with self._lock:
                self._unfile(key)
            self._skip(entry.path, str(exc), delete=not isinstance(exc, FileNotFoundError))
            return None

    # ---- writes --------------------------------------------------------------------------------
    def put(self, sp: Spilled, block: bool = False) -> bool:
        """Queue ``sp`` for writing; False (dropped, counted) if the queue is full and not ``block``."""
        if not self._thread.is_alive():
            self.dropped += 1
            return False
        with self._lock:
            if sp.key in self._index:
                self._index.move_to_end(sp.key)
                return True
            if sp.key in self._pending:
                return True
            self._pending[sp.key] = sp
        try:
            self._queue.put(sp, block=block)
        except queue.Full:
            with self._lock:
                self._pending.pop(sp.key, None)
            self.dropped += 1
            return False
        return True

    def _writer(self) -> None:
        while True:
            sp = self._queue.get()
            try:
                if sp is None:
                    return
                self._write(sp)
            except Exception:  # noqa: BLE001 - a disk error must not kill the writer or the server
                log.exception("prefix cache: writing a snapshot to %s failed", self.root)
            finally:
                if sp is not None:
                    with self._lock:
                        self._pending.pop(sp.key, None)
                self._queue.task_done()

    def _write(self, sp: Spilled) -> None:
        t0 = time.perf_counter()
        path = self.root / file_name(self.fingerprint, sp.key)
        tmp = self.root / f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                for piece in encode(sp, self.fingerprint):
                    f.write(piece)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        dfd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        with self._lock:
            self._file(sp.key, DiskEntry(path, sp.anchor, sp.position, path.stat().st_size))
            self._shrink()
            self.writes += 1
        self.write_s += time.perf_counter() - t0

    def flush(self) -> None:
        """Wait until every queued snapshot is on disk."""
        if self._thread.is_alive():
            self._queue.join()

    def clear(self) -> int:
        """Delete every snapshot file of this fingerprint; returns how many went."""
        self.flush()
        with self._lock:
            keys = list(self._index)
            for key in keys:
                self._unfile(key).path.unlink(missing_ok=True)
        return len(keys)

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=60)

    def summary(self) -> dict[str, int]:
        with self._lock:
            n = len(self._index)
        return {"disk_hits": self.hits, "disk_bytes": self.bytes, "disk_snapshots": n,
                "disk_evictions": self.evictions, "disk_budget_bytes": self.budget,
                "disk_skipped_files": self.skipped, "disk_dropped_writes": self.dropped, "disk_writes": self.writes}


def _close_at_exit(ref: weakref.ReferenceType) -> None:
    """Queued writes reach the disk before the interpreter exits (the writer thread is a daemon)."""
    tier = ref()
    if tier is not None:
        tier.close()
