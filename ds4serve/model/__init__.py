"""The DeepSeek-V4 network, stateless about users (state arrives as LayerState tensors)."""

from .batch import BatchView, CompressIndex, LayerState, VisibleRows
from .decoder import DS4ForCausalLM
from .loader import load_model, parse_dtype

__all__ = ["BatchView", "CompressIndex", "DS4ForCausalLM", "LayerState", "VisibleRows", "load_model", "parse_dtype"]
