"""Lower tiers of the prefix cache: host memory, then disk (issue 30).

The device pool (``prefix.py``) is the first tier. A snapshot it evicts under pressure is copied out
as a ``Spilled`` (rings, partial page and the full pages under it) into the *host tier*, an LRU under a
byte budget; what the host tier evicts goes to the *disk tier* (``disk_tier.py``) when a directory is
set, else it is gone. A lookup that the device pool cannot answer as long as it wants asks the lower
tiers for a longer prefix; a hit there is brought back into the pool (``PrefixCache._promote``) and
then attached like any device hit, so it is exact by construction: the same bytes, the same code path.

Keys are the device keys (salted hash chains over tokens and image content hashes); on disk they are
qualified by the model fingerprint (``fingerprint.py``), so another checkpoint or layout never reads a
file. The host tier lives in this process only and needs no fingerprint.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from .disk_tier import DiskTier
from .prefix_keys import BLOCK, PrefixKeys
from .spilled import Spilled

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TierConfig:
    host_bytes: int = 0  # host-memory tier budget (0: no host tier)
    disk_dir: Path | None = None  # disk tier directory (None: no disk tier)
    disk_bytes: int = 0  # disk tier budget
    fingerprint: str = ""  # the model fingerprint disk files are written under (fingerprint.py)


class HostTier:
    """Spilled snapshots in host memory, least recently used first, within ``budget`` bytes."""

    def __init__(self, budget: int):
        self.budget = int(budget)
        self._lru: OrderedDict[bytes, Spilled] = OrderedDict()
        self._by_anchor: dict[bytes, dict[bytes, int]] = {}
        self.bytes = self.hits = self.evictions = 0

    def __len__(self) -> int:
        return len(self._lru)

    def add(self, sp: Spilled) -> list[Spilled]:
        """Keep ``sp``; returns what had to leave to stay in budget (``sp`` itself if it alone is too big)."""
        if sp.nbytes > self.budget:
            return [sp]
        if sp.key in self._lru:
            self._lru.move_to_end(sp.key)
            return []
        self._lru[sp.key] = sp
        self._by_anchor.setdefault(sp.anchor, {})[sp.key] = sp.position
        self.bytes += sp.nbytes
        out = []
        while self.bytes > self.budget:
            out.append(self.pop(next(iter(self._lru))))
            self.evictions += 1
        return out

    def candidates(self, anchor: bytes) -> list[tuple[int, bytes]]:
        return [(p, k) for k, p in self._by_anchor.get(anchor, {}).items()]

    def get(self, key: bytes) -> Spilled | None:
        sp = self._lru.get(key)
        if sp is not None:
            self._lru.move_to_end(key)
        return sp

    def pop(self, key: bytes) -> Spilled:
        sp = self._lru.pop(key)
        self.bytes -= sp.nbytes
        by = self._by_anchor[sp.anchor]
        del by[key]
        if not by:
            del self._by_anchor[sp.anchor]
        return sp

    def drain(self) -> list[Spilled]:
        """Everything, least recently used first (so written in that order, the disk's LRU keeps it)."""
        return [self.pop(k) for k in list(self._lru)]


class TierStore:
    def __init__(self, config: TierConfig):
        self.config = config
        self.host = HostTier(config.host_bytes) if config.host_bytes > 0 else None
        self.disk = (DiskTier(config.disk_dir, config.disk_bytes, config.fingerprint)
                     if config.disk_dir is not None and config.disk_bytes > 0 else None)

    @property
    def enabled(self) -> bool:
        return self.host is not None or self.disk is not None

    def spill(self, sp: Spilled) -> None:
        """``sp`` left the device pool: into host memory, and whatever that pushes out onto disk."""
        overflow = self.host.add(sp) if self.host is not None else [sp]
        if self.disk is not None:
            for out in overflow:
                self.disk.put(out)

    def find(self, keys: PrefixKeys, floor: int, limit: int) -> tuple[Spilled, str] | None:
        """The longest snapshot of ``keys``' sequence at a position in ``(floor, limit]`` on a lower tier,
        loaded (and checked), with the tier's name; None if there is none (or every candidate was bad)."""
        for j in range(limit // BLOCK, floor // BLOCK - 1, -1):
            anchor = keys.boundary(j)
            found = [(p, k, "host") for p, k in self.host.candidates(anchor)] if self.host is not None else []
            if self.disk is not None:
                found += [(p, k, "disk") for p, k in self.disk.candidates(anchor)]
            for pos, key, tier in sorted(found, key=lambda f: -f[0]):
                if not floor < pos <= limit or keys.key(pos) != key:
                    continue
                sp = self.host.get(key) if tier == "host" else self.disk.load(key)
                if sp is not None:
                    return sp, tier
        return None

    def promoted(self, sp: Spilled, tier: str) -> None:
        """``sp`` is a device snapshot again: count the hit; the host copy goes (the device one will
        spill again when evicted), the file stays (disk is what survives a restart)."""
        if tier == "host":
            self.host.hits += 1
            if self.host.get(sp.key) is not None:  # promoting spilled others: it may have moved on already
                self.host.pop(sp.key)
        else:
            self.disk.hits += 1

    def clear(self) -> int:
        """Drop every lower-tier snapshot (host copies and this model's files); returns how many."""
        n = 0
        if self.host is not None:
            n += len(self.host.drain())
        if self.disk is not None:
            n += self.disk.clear()
        return n

    def close(self, device: list[Spilled]) -> None:
        """Persist: the host tier's snapshots and then the device pool's (``device``, least recently used
        first) go to disk, and the writer finishes, so a restart on the same directory starts warm; the
        most recent are written last, the last the disk's LRU would evict."""
        if self.disk is None:
            return
        for sp in (self.host.drain() if self.host is not None else []) + device:
            self.disk.put(sp, block=True)
        self.disk.flush()
        self.disk.close()
        log.info("prefix cache: %d snapshots on disk in %s (%.1f MiB)", self.disk.summary()["disk_snapshots"],
                 self.disk.root, self.disk.bytes / 2**20)

    def summary(self) -> dict[str, int]:
        out = {}
        if self.host is not None:
            out.update(host_hits=self.host.hits, host_bytes=self.host.bytes, host_snapshots=len(self.host),
                       host_evictions=self.host.evictions, host_budget_bytes=self.host.budget)
        if self.disk is not None:
            out.update(self.disk.summary())
        return out
