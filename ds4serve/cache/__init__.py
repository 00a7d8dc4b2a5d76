"""Per-sequence model state: fixed per-slot rings, paged pools, and the per-forward index view."""

from .layout import StateLayout
from .pages import PageAllocator
from .state import ModelState
from .view import ImageSpan, SeqChunk, ViewError, build_view

__all__ = ["ImageSpan", "ModelState", "PageAllocator", "SeqChunk", "StateLayout", "ViewError", "build_view"]
