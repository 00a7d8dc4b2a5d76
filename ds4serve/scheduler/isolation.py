"""Finding the request that made a step fail, without stalling the others (DESIGN §6 invariant 5).

A step whose forward (or sampling) raises leaves its members' state suspect: some layers may have
written their rows. Every request retains its full input and recompute is exact, so the scheduler
drops the members and recomputes them (see ``Scheduler._undo_failed_step``). This module decides
*who runs with whom* while that happens:

* the members of a failed step become suspects, split into two halves (a *suspect group* each);
* a group runs in steps of its own, taking turns with the steps of everybody else, so innocent
  requests never share a step with the culprit again;
* a suspect is cleared once it has recomputed past the point where it failed (``clear_at``);
* a group whose step fails again is split again; a suspect that fails in a step with nobody else
  fails alone, with an error.

A deterministic culprit among ``n`` members is found in about ``log2(n) + 1`` probe steps; the others
lose only their recompute time. A transient fault clears everybody.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from .request import Request


@dataclass
class SuspectGroup:
    group_id: int
    members: list[Request] = field(default_factory=list)  # in arrival order


class Quarantine:
    def __init__(self) -> None:
        self.groups: list[SuspectGroup] = []  # the head is probed next
        self._ids = itertools.count(1)
        self._probe_turn = False

    def __bool__(self) -> bool:
        return bool(self.groups)

    def lanes(self) -> tuple[int | None, ...]:
        """Lanes to plan this step, preferred first. ``None`` is everybody who is not a suspect; the
        head group takes every other step (the other lane is the fallback when one has nothing to do)."""
        if not self.groups:
            return (None,)
        self._probe_turn = not self._probe_turn
        head = self.groups[0].group_id
        return (head, None) if self._probe_turn else (None, head)

    def suspect(self, failed: list[Request], lane: int | None) -> list[Request]:
        """The members of a step of ``lane`` failed. Returns the requests that must fail alone (a
        suspect whose step held nobody else); the others go to new groups at the head of the queue."""
        if lane is not None:
            for r in failed:
                self.clear(r)
            if len(failed) == 1:
                return list(failed)
        half = (len(failed) + 1) // 2
        groups = [failed] if len(failed) == 1 else [failed[:half], failed[half:]]
        new = [SuspectGroup(next(self._ids), list(g)) for g in groups]
        for g in new:
            for r in g.members:
                r.suspect = g.group_id
        self.groups[0:0] = new
        return []

    def clear(self, req: Request) -> None:
        """``req`` is no longer a suspect (it recomputed past its failure, or it ended)."""
        if req.suspect is None:
            return
        for g in self.groups:
            if g.group_id == req.suspect:
                g.members.remove(req)
                if not g.members:
                    self.groups.remove(g)
                break
        req.suspect = None
