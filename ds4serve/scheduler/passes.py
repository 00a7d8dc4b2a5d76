"""The scheduler's record of prefill passes in flight: who is in each, and how far it has got.

A pass that needs several steps (an image block beside live decoders, or ``prefill_mode=layers``)
is created here with its members; each executed slice moves its layer cursor; a member that ends
mid-pass leaves it while the others go on; a pass left without members is *retired*: the next
``StepPlan`` carries its id so the engine forgets its staged view too (DESIGN §5). A pass that runs
whole in one step is never recorded.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ..engine.plan import PassMember, PassSlice
from .request import Request


@dataclass
class Pass:
    pass_id: int
    requests: list[Request]
    members: tuple[PassMember, ...]
    cursor: int = 0  # layers done (the next slice starts here)

    @property
    def rows(self) -> int:
        return sum(len(m.ids) for m in self.members)


class PassTable:
    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._passes: dict[int, Pass] = {}
        self._ids = itertools.count(1)
        self._retired: list[int] = []

    def __len__(self) -> int:
        return len(self._passes)

    def in_flight(self, lane: int | None) -> list[Pass]:
        """Passes of one lane (everybody, or one suspect group), oldest first."""
        found = [p for p in self._passes.values() if p.requests[0].suspect == lane]
        return sorted(found, key=lambda p: p.requests[0].arrival)

    def start(self, reqs: list[Request], members: tuple[PassMember, ...], layers: int) -> PassSlice:
        """The first slice of a new pass; recorded only if it does not finish in this step."""
        pid = next(self._ids)
        if layers < self.num_layers:
            self._passes[pid] = Pass(pid, reqs, members)
            for r in reqs:
                r.pass_id = pid
        return PassSlice(pid, 0, layers, members)

    def advanced(self, p: PassSlice) -> bool:
        """Slice ``p`` ran; True when it completed the pass (its members leave it)."""
        state = self._passes.get(p.pass_id)
        if state is not None:
            state.cursor = p.layer_stop
        if p.layer_stop < self.num_layers:
            return False
        self._passes.pop(p.pass_id, None)
        return True

    def forget(self, pass_id: int) -> None:
        """The engine already forgot this pass (its step failed): drop the record, retire nothing."""
        self._passes.pop(pass_id, None)

    def leave(self, req: Request) -> None:
        """A member ended mid-pass. The others continue the same pass (rows of different sequences are
        independent; restarting them would read sliding rings the partial pass already overwrote)."""
        p = self._passes.get(req.pass_id)
        req.pass_id = None
        if p is None:
            return
        p.requests.remove(req)
        p.members = tuple(m for m in p.members if m.request_id != req.request_id)
        if not p.members:
            del self._passes[p.pass_id]
            self._retired.append(p.pass_id)

    def retire_later(self, pass_ids) -> None:
        self._retired.extend(pass_ids)

    def take_retired(self) -> tuple[int, ...]:
        out, self._retired = tuple(self._retired), []
        return out

    @property
    def retiring(self) -> set[int]:
        return set(self._retired)
