"""The encoder worker: a persistent thread that turns admitted images into aligner rows.

Images are encoded in admission order (FIFO), each published the moment it is done (a prefill pass
only takes blocks whose images are ready, so a request with eight images can start on its first
while the others encode). The worker may own another device (``--vision-device``); rows are moved
to the engine's device and stored in *stream order* (aligner rows permuted by the block's ``perm``),
ready to be placed into the IMAGE slots. Retiring a request cancels its queued images; an image
being encoded when its request retires is finished and then discarded. ``shutdown`` fails every
pending image and joins the thread, so nothing races the process exit.

The rows of a live request are *retained* (a few MB per image) until it finishes: with them an image
request can be dropped under memory pressure and recomputed exactly, never rebuilt from sentinel ids.
The scheduler accounts for that memory against ``rows_budget``.

The scheduler talks to the worker in four calls: ``submit`` at admission, ``cancel`` at retirement,
``row_bytes`` for its budget, and one question per step, ``ready(request_id)``: the ``ImageState`` of
each of the request's images. The handles, their events and the thread stay in here.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..multimodal.records import ImageInput, ImageRows

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ImageState:
    """What the scheduler may know of one submitted image, at the moment it asks."""

    ready: bool  # the worker is done with it: ``rows.rows`` or ``error`` is final
    rows: ImageRows  # its slot positions, and its rows once encoded (None while pending or when lost)
    error: str | None = None  # why it could not be encoded (its request fails alone)

    @property
    def retained(self) -> bool:
        """Its input can be rebuilt exactly: rows in hand, or still to come (never a failed image)."""
        return self.error is None and (self.rows.rows is not None or not self.ready)


@dataclass
class EncodedImage:
    """One image's rows; ``ready`` is set when ``rows`` (or ``error``) is final."""

    request_id: str
    index: int
    patches: torch.Tensor  # retained pixels (CPU): the input can always be re-encoded
    vit_h: int
    vit_w: int
    perm: tuple[int, ...]
    positions: tuple[int, ...]  # absolute positions of the IMAGE slots, stream order
    rows: torch.Tensor | None = None  # [len(perm), hidden] on the engine device, stream order
    error: str | None = None
    encode_s: float = 0.0
    ready: threading.Event = field(default_factory=threading.Event)

    @property
    def ok(self) -> bool:
        return self.ready.is_set() and self.rows is not None

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size() if self.rows is not None else 0

    def state(self) -> ImageState:
        ready = self.ready.is_set()
        return ImageState(ready, ImageRows(self.positions, self.rows if ready else None), self.error)


class EncoderWorker:
    def __init__(self, encoder, engine_device: torch.device, dtype: torch.dtype, hidden_size: int):
        self.encoder = encoder
        self.engine_device = torch.device(engine_device)
        self.dtype = dtype
        self.hidden_size = hidden_size
        self.device = next(encoder.parameters()).device
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self._stop = False
        self.encoded = 0
        self.cancelled = 0
        self._pending: dict[str, list[EncodedImage]] = {}
        self._thread = threading.Thread(target=self._run, name="ds4serve-encoder", daemon=True)
        self._thread.start()
        log.info("encoder worker on %s (rows to %s)", self.device, self.engine_device)

    def row_bytes(self, n_rows: int) -> int:
        return n_rows * self.hidden_size * torch.empty((), dtype=self.dtype).element_size()

    def submit(self, request_id: str, images: Sequence[ImageInput]) -> list[EncodedImage]:
        """Queue a request's images in order; returns their handles (the worker's own, for tests)."""
        handles = [EncodedImage(request_id, i, im.patches, im.vit_h, im.vit_w, tuple(im.block.perm),
                                tuple(im.block.image_positions)) for i, im in enumerate(images)]
        with self._lock:
            if self._stop:
                raise RuntimeError("the encoder worker is shut down")
            self._cancelled.discard(request_id)
            self._pending[request_id] = handles
        for h in handles:
            self._jobs.put(h)
        return handles

    def ready(self, request_id: str) -> tuple[ImageState, ...]:
        """The state of each of a live request's images, in order (empty once it is cancelled)."""
        with self._lock:
            handles = self._pending.get(request_id, ())
        return tuple(h.state() for h in handles)

    def wait(self, request_id: str, timeout: float) -> bool:
        """Block until every image of the request is ready (warm-up and tests); False on timeout."""
        with self._lock:
            handles = list(self._pending.get(request_id, ()))
        deadline = time.monotonic() + timeout
        return all(h.ready.wait(max(0.0, deadline - time.monotonic())) for h in handles)

    def cancel(self, request_id: str) -> None:
        """The request retired: skip its queued images and forget its rows."""
        with self._lock:
            handles = self._pending.pop(request_id, None)
            if handles is None:
                return
            self._cancelled.add(request_id)
        for h in handles:
            if not h.ready.is_set():
                h.error = "cancelled"
                h.ready.set()
            h.rows = None

    def pending_jobs(self) -> int:
        """Images of live requests not encoded yet (leak checks)."""
        with self._lock:
            return sum(1 for hs in self._pending.values() for h in hs if not h.ready.is_set())

    def live_requests(self) -> set[str]:
        with self._lock:
            return set(self._pending)

    def shutdown(self) -> None:
        with self._lock:
            self._stop = True
            pending = [h for hs in self._pending.values() for h in hs]
            self._pending.clear()
        for h in pending:
            if not h.ready.is_set():
                h.error = "the encoder is shutting down"
                h.ready.set()
        self._jobs.put(None)
        self._thread.join(timeout=30)

    # ---- the worker thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with self._lock:
                skip = self._stop or job.request_id in self._cancelled or job.ready.is_set()
            if skip:
                self.cancelled += 1
                continue
            self._encode(job)

    @torch.inference_mode()
    def _encode(self, job: EncodedImage) -> None:
        t0 = time.perf_counter()
        try:
            patches = job.patches.to(self.device)
            rows = self.encoder.encode(patches, job.vit_h, job.vit_w)
            perm = torch.tensor(job.perm, dtype=torch.long, device=rows.device)
            rows = rows.index_select(0, perm).to(self.engine_device, self.dtype)
            error = None
        except Exception as exc:  # one bad image fails its request alone
            log.exception("encoding image %d of %s failed", job.index, job.request_id)
            rows, error = None, f"image {job.index + 1} could not be encoded: {type(exc).__name__}: {exc}"
        with self._lock:
            live = job.request_id in self._pending and job.request_id not in self._cancelled
        if live:
            job.rows, job.error = rows, error
            job.encode_s = time.perf_counter() - t0
            self.encoded += 1
            job.ready.set()
        else:
            self.cancelled += 1
