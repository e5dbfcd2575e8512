"""``loopformer models`` counts parameters on the ``meta`` device (issue 25): the counts equal those of real
models, and no real weight is allocated while the table is built."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from loopformer.commands import models as models_cmd
from loopformer.models.registry import MODELS, model_classes

SMALL = {  # a few small configs per family (fields of the family's config class)
    "fprm": [{}, {"d_model": 32, "n_heads": 2, "n_layers": 1}],
    "trm": [{}],
    "transformer": [{"d_model": 48, "n_heads": 4}],
    "recurrent": [{"d_model": 32, "n_heads": 2}],
}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_meta_counts_equal_real_counts(name: str) -> None:
    model_cls, config_cls = model_classes(name)
    for fields in SMALL[name]:
        config = config_cls(**fields)
        meta = models_cmd.meta_model(model_cls, config)
        assert {p.device.type for p in meta.parameters()} == {"meta"}
        real = model_cls(config)
        assert {p.device.type for p in real.parameters()} == {"cpu"}
        assert models_cmd._count(model_cls, config) == real.num_parameters() > 0


def test_the_table_allocates_no_real_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    devices: list[str] = []
    register = nn.Module.register_parameter

    def spy(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None:
            devices.append(param.device.type)
        register(self, name, param)

    monkeypatch.setattr(nn.Module, "register_parameter", spy)
    rows = models_cmd.model_rows()
    assert {r["name"] for r in rows} == set(MODELS)
    broken = [r for r in rows if r["note"].startswith("unavailable")]
    assert broken == []
    assert all(r["cpu"] and r["cpu"] > 0 for r in rows)
    paper = [r["paper"] for r in rows if r["paper"]]
    assert max(paper) > 5_000_000  # the paper-size models were counted ...
    assert devices and set(devices) == {"meta"}  # ... and every parameter of every model lived on meta


def test_the_spy_sees_real_allocations(monkeypatch: pytest.MonkeyPatch) -> None:
    devices: list[str] = []
    register = nn.Module.register_parameter
    monkeypatch.setattr(
        nn.Module, "register_parameter",
        lambda self, n, p: (devices.append(p.device.type) if p is not None else None, register(self, n, p))[1],
    )  # fmt: skip
    nn.Linear(3, 4)
    assert devices == ["cpu", "cpu"] and torch.empty(1).device.type == "cpu"
