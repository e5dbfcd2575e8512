"""The parity infrastructure: fixture files (safetensors + JSON) and the converter's key handling."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from loopformer.cli import cli
from loopformer.convert import KeyMap, load_state_dict, strip_prefixes
from loopformer.convert.fixtures import FixtureError, load_fixture, save_fixture
from loopformer.runs.checkpoint import CheckpointError


def test_parity_fixture_roundtrip_is_byte_identical(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"b": torch.randn(3, generator=g, dtype=torch.float64), "a": torch.arange(4)}
    meta = {"repo": "x/y", "commit": "0" * 40, "config": {"d": 8}}
    p1 = save_fixture(tmp_path / "one", "f", tensors, meta)
    p2 = save_fixture(tmp_path / "two", "f", dict(reversed(list(tensors.items()))), meta)
    assert p1.read_bytes() == p2.read_bytes()
    assert (tmp_path / "one" / "f.json").read_text() == (tmp_path / "two" / "f.json").read_text()
    back, m = load_fixture("f", tmp_path / "one")
    assert m["config"] == {"d": 8} and torch.equal(back["b"], tensors["b"])


def test_parity_fixture_hash_mismatch_and_missing_are_errors(tmp_path):
    save_fixture(tmp_path, "f", {"x": torch.zeros(2)}, {})
    meta = json.loads((tmp_path / "f.json").read_text())
    meta["sha256"] = "0" * 64
    (tmp_path / "f.json").write_text(json.dumps(meta))
    with pytest.raises(FixtureError, match="sha256"):
        load_fixture("f", tmp_path)
    with pytest.raises(FixtureError, match="does not exist"):
        load_fixture("nope", tmp_path)


def test_parity_keymap_names_unknown_and_missing_keys():
    km = KeyMap(
        strip_prefixes(
            {"_orig_mod.model.a": torch.zeros(1), "model.b": torch.zeros(1)}, ["_orig_mod.", "model."]
        ),
        "ckpt.pt",
    )
    km.take("a")
    with pytest.raises(CheckpointError, match="missing key 'c'"):
        km.take("c")
    with pytest.raises(CheckpointError, match=r"unknown keys .*\['b'\]"):
        km.finish()


class Unsafe:
    """An arbitrary class: unpickling it needs weights_only=False."""


def test_parity_load_state_dict_refuses_non_tensor_pickles(tmp_path):
    bad = tmp_path / "obj.pt"
    torch.save({"a": torch.zeros(1), "b": Unsafe()}, bad)
    with pytest.raises(CheckpointError, match="weights_only=True"):
        load_state_dict(bad)
    good = tmp_path / "sd.pt"
    torch.save({"state_dict": {"w": torch.ones(2)}}, good)
    assert torch.equal(load_state_dict(good)["w"], torch.ones(2))
    with pytest.raises(CheckpointError, match="does not exist"):
        load_state_dict(tmp_path / "missing.pt")


def test_parity_convert_cli_unknown_mapping_is_one_line_error(tmp_path):
    ckpt = tmp_path / "sd.pt"
    torch.save({"w": torch.ones(2)}, ckpt)
    res = CliRunner().invoke(cli, ["convert", "ltg", str(ckpt), "--out", str(tmp_path / "run")])
    assert res.exit_code != 0 and "ltg" in res.output
