"""Checkpoint-derived indices are validated when the checkpoint loads (model/weights.py ``IndexTable``,
model/loader.py ``index_tables`` / ``layout_notes``, config.py ``_check_ratio``).

The native host forward reads these values as indices without checking them (outside a checked
build), and torch gathers with them too: a bad table or ratio must fail at load, with a message that
names the tensor or config key, the bad value and the range it must lie in, never reach a forward.
One test per kind of bad checkpoint, each on a copy of one small random checkpoint (vocab 1000,
8 routed experts, top-2, layer 0 hash-routed, compress ratios [0, 0, 4, 16, 4, 16]).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ds4serve.config import ConfigError
from ds4serve.model.loader import load_model
from ds4serve.model.weights import CheckpointError
from model_helpers import write_random_text_checkpoint

TABLE = "model.layers.0.mlp.gate.tid2eid"  # the hash layer's table, as random_weights names it
N_EXPERTS, TOP_K, VOCAB = 8, 2, 1000


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    """The valid checkpoint every test copies and breaks one thing of."""
    return write_random_text_checkpoint(tmp_path_factory.mktemp("good"))


def _variant(good: Path, tmp_path: Path, tensors: dict | None = None, **config) -> Path:
    """A copy of ``good`` with some tensors replaced (``{name: tensor}``) and config fields overridden."""
    out = tmp_path / "variant"
    out.mkdir()
    weights = load_file(str(good / "model.safetensors"))
    if tensors:
        weights.update(tensors)
        save_file(weights, str(out / "model.safetensors"))
    else:
        shutil.copy(good / "model.safetensors", out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(json.loads((good / "config.json").read_text()) | config))
    return out


def _table(good: Path) -> torch.Tensor:
    return load_file(str(good / "model.safetensors"))[TABLE].clone()


def _load_error(path: Path, error: type[Exception]) -> str:
    with pytest.raises(error) as err:
        load_model(path, progress=False)
    return str(err.value)


def test_the_unbroken_checkpoint_loads_and_a_narrower_integer_table_is_widened(good, tmp_path):
    """The checks refuse nothing valid: an int32 table (any integer dtype) loads to the same int64 routes."""
    table = _table(good)
    _, model = load_model(_variant(good, tmp_path, {TABLE: table.to(torch.int32)}), progress=False)
    loaded = model.model.layers[0].mlp.gate.tid2eid
    assert loaded.dtype == torch.int64 and torch.equal(loaded, table)


def test_an_expert_id_equal_to_n_routed_experts_is_refused(good, tmp_path):
    table = _table(good)
    table[17, 1] = N_EXPERTS
    msg = _load_error(_variant(good, tmp_path, {TABLE: table}), CheckpointError)
    assert f"tensor {TABLE}: value {N_EXPERTS} at [17, 1] is outside [0, {N_EXPERTS}) (1 such value)" in msg, msg
    assert f"n_routed_experts = {N_EXPERTS}" in msg


def test_a_negative_expert_id_is_refused_and_all_bad_ids_are_counted(good, tmp_path):
    table = _table(good)
    table[3, 0], table[900, 1] = -1, 1_000_000
    msg = _load_error(_variant(good, tmp_path, {TABLE: table}), CheckpointError)
    assert f"tensor {TABLE}: value -1 at [3, 0] is outside [0, {N_EXPERTS}) (2 such values)" in msg, msg


@pytest.mark.parametrize("shape", [(VOCAB, TOP_K + 1), (TOP_K, VOCAB), (VOCAB * TOP_K,), (VOCAB - 1, TOP_K)])
def test_a_table_of_the_wrong_shape_is_refused(good, tmp_path, shape):
    """Also the same-size transposed and flattened ones, which a plain reshape would route wrong."""
    table = torch.zeros(shape, dtype=torch.int64)
    msg = _load_error(_variant(good, tmp_path, {TABLE: table}), CheckpointError)
    assert f"tensor {TABLE}: shape {list(shape)}, expected [{VOCAB}, {TOP_K}]" in msg, msg
    assert f"vocab_size = {VOCAB}" in msg and f"num_experts_per_tok = {TOP_K}" in msg


@pytest.mark.parametrize("dtype,code", [(torch.float32, "F32"), (torch.bfloat16, "BF16"), (torch.bool, "BOOL")])
def test_a_table_that_is_not_integer_is_refused_not_truncated(good, tmp_path, dtype, code):
    table = _table(good).to(dtype)
    msg = _load_error(_variant(good, tmp_path, {TABLE: table}), CheckpointError)
    assert f"tensor {TABLE}: dtype {code}, expected an integer dtype (I16, I32, I64, I8" in msg, msg
    assert f"each in [0, n_routed_experts = {N_EXPERTS})" in msg


@pytest.mark.parametrize("config,key,value", [
    ({"compress_ratios": [0, 0, 4, 1, 4, 16]}, "compress_ratios[3]", 1),
    ({"compress_ratios": [0, 0, 4, 8192, 4, 16]}, "compress_ratios[3]", 8192),
    ({"layer_types": ["sliding_attention"] * 2 + ["compressed_sparse_attention", "heavily_compressed_attention"] * 2,
      "compress_rates": {"heavily_compressed_attention": 1}}, "compress_rates.heavily_compressed_attention", 1),
    ({"layer_types": ["sliding_attention"] * 2 + ["compressed_sparse_attention", "heavily_compressed_attention"] * 2,
      "compress_rate_csa": 0}, "compress_rate_csa", 0),
])
def test_a_compress_ratio_outside_the_allowed_range_names_its_key(good, tmp_path, config, key, value):
    msg = _load_error(_variant(good, tmp_path, **config), ConfigError)
    assert f"config field '{key}' = {value}: a compressed layer's ratio must be in [2, " \
           "max_position_embeddings = 4096]" in msg, msg


def test_a_sliding_rate_other_than_zero_is_refused(good, tmp_path):
    layout = ["sliding_attention"] * 2 + ["compressed_sparse_attention", "heavily_compressed_attention"] * 2
    msg = _load_error(_variant(good, tmp_path, layer_types=layout,
                               compress_rates={"sliding_attention": 4, "heavily_compressed_attention": 16}),
                      ConfigError)
    assert "config field 'compress_rates.sliding_attention' = 4" in msg and "must be 0" in msg, msg


def test_a_compress_ratio_that_does_not_fit_the_compressor_tensors_names_the_layer(good, tmp_path):
    """A valid ratio that is not the checkpoint's: the window table has the checkpoint's ratio of rows."""
    msg = _load_error(_variant(good, tmp_path, compress_ratios=[0, 0, 4, 32, 4, 16]), CheckpointError)
    assert re.search(r"layers\.3\.self_attn\.compressor\.position_bias: shape \[16, \d+\], expected \[32, \d+\]",
                     msg), msg
    assert "layer 3: the checkpoint's compressor window is 16 positions long (the rows of position_bias), but " \
           "config compress_ratios[3] makes it HCA with compress ratio 32" in msg, msg


@pytest.mark.parametrize("ratios,note", [
    ([0, 0, 0, 16, 4, 16], "layer 2: the checkpoint has a compressor, but config compress_ratios[2] makes it "
                           "sliding-only (compress ratio 0)"),
    ([0, 4, 4, 16, 4, 16], "layer 1: the checkpoint has no compressor, but config compress_ratios[1] makes it "
                           "CSA with compress ratio 4"),
    ([0, 0, 4, 4, 4, 16], "layer 3: the checkpoint has no indexer (only CSA layers have one), but config "
                          "compress_ratios[3] makes it CSA with compress ratio 4"),
    ([0, 0, 16, 16, 4, 16], "layer 2: the checkpoint has an indexer (only CSA layers have one), but config "
                            "compress_ratios[2] makes it HCA with compress ratio 16"),
])
def test_layer_kinds_that_do_not_fit_the_compressor_tensors_name_the_layer(good, tmp_path, ratios, note):
    msg = _load_error(_variant(good, tmp_path, compress_ratios=ratios), CheckpointError)
    assert note in msg, msg


def test_more_experts_per_token_than_experts_is_refused(good, tmp_path):
    msg = _load_error(_variant(good, tmp_path, num_experts_per_tok=N_EXPERTS + 1), ConfigError)
    assert f"config field 'num_experts_per_tok' = {N_EXPERTS + 1} must be in [1, n_routed_experts = {N_EXPERTS}]" \
           in msg, msg
