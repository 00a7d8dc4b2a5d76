"""The encoder worker: admission order, per-image publication, cancellation, failure, shutdown."""

from __future__ import annotations

import threading
import time

import torch
from torch import nn

from ds4serve.engine.encoder import EncoderWorker
from ds4serve.multimodal.layout import image_block
from ds4serve.multimodal.records import ImageInput


class SlowEncoder(nn.Module):
    """Rows = the patch means (so the output identifies the input); waits on a gate per image."""

    def __init__(self, hidden=4):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.hidden = hidden
        self.order: list[float] = []
        self.gate = threading.Semaphore(0)

    def encode(self, patches, vit_h, vit_w):
        self.gate.acquire()
        tag = float(patches[0, 0, 0, 0])
        self.order.append(tag)
        if tag < 0:
            raise RuntimeError("broken pixels")
        n = ((vit_h + 2) // 3) * ((vit_w + 2) // 3)
        return torch.full((n, self.hidden), tag) + torch.arange(n).unsqueeze(1)


def image(tag: float, h=3, w=6) -> ImageInput:
    blk = image_block((h + 2) // 3, (w + 2) // 3, 0)
    return ImageInput(torch.full((h * w, 3, 14, 14), tag), h, w, blk, f"h{tag}")


def test_order_publication_cancel_and_failure():
    enc = SlowEncoder()
    worker = EncoderWorker(enc, torch.device("cpu"), torch.float32, 4)
    a = worker.submit("a", [image(1.0), image(2.0)])
    b = worker.submit("b", [image(3.0), image(-1.0)])
    c = worker.submit("c", [image(5.0)])
    enc.gate.release()
    assert a[0].ready.wait(5) and not a[1].ready.is_set()  # published as soon as encoded
    perm = torch.tensor(a[0].perm)
    assert torch.equal(a[0].rows, (torch.full((len(perm), 4), 1.0) + perm.unsqueeze(1).float()))  # stream order
    worker.cancel("b")  # b's queued images are skipped
    for _ in range(4):
        enc.gate.release()
    assert a[1].ready.wait(5) and c[0].ready.wait(5)
    assert enc.order == [1.0, 2.0, 5.0]
    assert all(h.error == "cancelled" and h.rows is None for h in b)
    d = worker.submit("d", [image(-2.0), image(6.0)])
    enc.gate.release()
    enc.gate.release()
    assert d[0].ready.wait(5) and d[1].ready.wait(5)
    assert d[0].rows is None and "could not be encoded" in d[0].error and d[1].ok  # one bad image fails alone
    for rid in ("a", "c", "d"):
        worker.cancel(rid)
    assert worker.live_requests() == set() and worker.pending_jobs() == 0
    worker.shutdown()


def test_shutdown_fails_pending_without_races():
    enc = SlowEncoder()
    worker = EncoderWorker(enc, torch.device("cpu"), torch.float32, 4)
    hs = worker.submit("x", [image(float(i + 1)) for i in range(5)])
    t = threading.Thread(target=worker.shutdown)
    t.start()
    time.sleep(0.05)
    enc.gate.release()  # let an in-flight encode finish
    for _ in range(5):
        enc.gate.release()
    t.join(10)
    assert not t.is_alive()
    assert all(h.ready.is_set() for h in hs)
    assert any(h.error == "the encoder is shutting down" for h in hs)
