"""The runtime: assembly of every part, and the loop object the server talks to.

Above ``scheduler/`` (policy) and ``engine/`` (mechanism): ``sizing`` turns settings into sizes,
``assemble`` builds cache + engine + encoder (``parts.EngineParts``), warms them up (``warmup``) and
calibrates the step budget (``calibrate``) before it constructs a ``core.EngineCore`` from them,
which adds the scheduler and steps it all, publishing a ``stats.EngineStats`` snapshot as it goes;
``loop.EngineLoop`` runs a core on its own thread behind an asyncio API. This package is the
server's one door below it: what the server needs from the layers beneath (sampling parameters,
refusals, outputs, the stats snapshot, the request spec and its fit check) is re-exported here.
"""

from __future__ import annotations

from ..engine.sampling import SamplingError, SamplingParams
from ..scheduler.admission import FitLimits, fit
from ..scheduler.request import RequestOutput
from ..scheduler.scheduler import QueueFull, RequestTooLarge, SchedulerLimits
from ..scheduler.spec import RequestSpec
from .assemble import assemble_core, check_decode_graphs, load_core
from .core import EngineCore, FatalStepError
from .loop import EngineLoop, RequestStream
from .stats import DECODE_WIDTH_WINDOW, EngineStats

__all__ = ["DECODE_WIDTH_WINDOW", "EngineCore", "EngineLoop", "EngineStats", "FatalStepError", "FitLimits", "QueueFull",
           "RequestOutput", "RequestSpec", "RequestStream", "RequestTooLarge", "SamplingError", "SamplingParams",
           "SchedulerLimits", "assemble_core", "check_decode_graphs", "fit", "load_core"]
