"""The runtime: assembly of every part, and the loop object the server talks to.

Above ``scheduler/`` (policy) and ``engine/`` (mechanism): ``sizing`` turns settings into sizes,
``core.EngineCore`` builds cache + engine + encoder + scheduler and steps them, ``warmup`` drives
every path once at start-up, and ``loop.EngineLoop`` runs a core on its own thread behind an
asyncio API. This package is the server's one door below it: what the server needs from the
layers beneath (sampling parameters, refusals, outputs) is re-exported here.
"""

from __future__ import annotations

from ..engine.sampling import SamplingError, SamplingParams
from ..scheduler.request import RequestOutput
from ..scheduler.scheduler import QueueFull, RequestTooLarge, SchedulerLimits
from .core import EngineCore, FatalStepError, check_decode_graphs, load_core
from .loop import EngineLoop, RequestStream

__all__ = ["EngineCore", "EngineLoop", "FatalStepError", "QueueFull", "RequestOutput", "RequestStream",
           "RequestTooLarge", "SamplingError", "SamplingParams", "SchedulerLimits", "check_decode_graphs", "load_core"]
