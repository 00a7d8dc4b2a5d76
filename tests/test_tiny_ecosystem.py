"""The bundled folder loads in the ecosystem's tools (issue 17): transformers' AutoConfig and
AutoTokenizer (what guidellm's ``--processor``, vLLM and most clients call), with the same model and
the same token ids as ds4serve's own loaders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds4serve.chat import Tokenizer
from ds4serve.config import ModelConfig
from ds4serve.tiny.train import TOKENIZER_CONFIG, model_config

TINY = Path(__file__).resolve().parents[1] / "models" / "ds4v-tiny"
transformers = pytest.importorskip("transformers")


def test_the_bundled_files_are_what_the_trainers_write():
    """The model's keys as ``tiny train`` writes them, and the shipped drafter's ``dspark_*`` keys as ``tiny
    train-drafter`` writes them with its default settings."""
    from ds4serve.tiny.train_drafter import DrafterSettings, drafter_config

    config = json.loads((TINY / "config.json").read_text())
    drafter = {k: v for k, v in config.items() if k.startswith("dspark_")}
    assert {k: v for k, v in config.items() if k not in drafter} == model_config(config["vocab_size"])
    assert drafter == json.loads(json.dumps(drafter_config(DrafterSettings(TINY, TINY))))
    assert json.loads((TINY / "tokenizer_config.json").read_text()) == TOKENIZER_CONFIG


def test_autoconfig_reads_the_same_model():
    """HCA at ratio 8 (the legacy ``compress_ratios`` form would be refused: the reference maps only 0,
    4 and 128) is stated as transformers states layers: ``layer_types`` plus ``compress_rates``."""
    hf = transformers.AutoConfig.from_pretrained(TINY)
    ours = ModelConfig.from_file(TINY / "config.json")
    assert type(hf).__name__ == "DeepseekV4Config"
    rates = {"sliding_attention": 0, **hf.compress_rates}
    assert tuple(rates[t] for t in hf.layer_types) == ours.compress_ratios == (0, 4, 8, 4)
    assert (hf.hidden_size, hf.num_hidden_layers, hf.sliding_window, hf.vocab_size) == \
        (ours.hidden_size, ours.num_layers, ours.sliding_window, ours.vocab_size)


def test_autotokenizer_gives_ds4serves_token_ids():
    hf = transformers.AutoTokenizer.from_pretrained(TINY)
    ours = Tokenizer(TINY)
    for text in ["What colour is the circle?", "what's the color of the square ", "12 + 7 = 19. Reverse: tac"]:
        ids = hf.encode(text, add_special_tokens=False)
        assert ids == ours.encode_text(text)
        assert hf.decode(ids) == ours.decode(ids)
    assert (hf.bos_token_id, hf.eos_token_id) == (ours.bos_id, ours.eos_id)
    assert hf.convert_tokens_to_ids("<｜pad｜>") == hf.pad_token_id
