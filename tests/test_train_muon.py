"""``train.optimizer: muon_adamw`` (loopformer.train.optim): the Polar Express iteration against a float64
SVD oracle, the Muon schedule (momentum warm-up, weight-decay taper), cautious weight decay, fused-qkv
chunks, the parameter split, config errors and a checkpoint resume. The step itself is parity-tested
against the reference's MuonAdamW in tests/test_parity_attractor_lm.py."""

from __future__ import annotations

import pytest
import torch
from test_train_utils import TinyLooped, tiny_config, tiny_dataset

from loopformer.config import ConfigError, build_config
from loopformer.train import Trainer
from loopformer.train.optim import MuonAdamW, muon_chunks, muon_update_, polar_express


def _with_singular_values(rows: int, cols: int, s: torch.Tensor, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(rows, len(s), generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, len(s), generator=g, dtype=torch.float64))
    return u @ torch.diag(s) @ v.mT, u, v


@pytest.mark.parametrize("shape", [(24, 8), (8, 24), (16, 16)], ids=["tall", "wide", "square"])
def test_polar_express_approximates_u_vt(shape: tuple[int, int]) -> None:
    """X = U p(S) V^T exactly (an odd polynomial keeps the singular vectors: off-diagonal of U^T X V at
    rounding level), and p(s) in [0.85, 1.15] for singular values within a factor 10 of the largest
    (5 Polar Express steps after dividing by 1.02 ||G||_F; measured range over these draws: 0.859..1.141),
    so ||X - U V^T||_2 <= 0.15."""
    k = min(shape)
    for seed in range(5):
        s = torch.logspace(-1, 0, k, dtype=torch.float64) * 3.0
        gmat, u, v = _with_singular_values(*shape, s, seed)
        x = polar_express(gmat, 5, torch.float64)
        d = u.mT @ x @ v
        diag = torch.diagonal(d)
        assert float((d - torch.diag(diag)).abs().max()) < 1e-12
        assert float(diag.min()) > 0.85 and float(diag.max()) < 1.15, diag
        assert float(torch.linalg.matrix_norm(x - u @ v.mT, ord=2)) <= 0.15
        xb = polar_express(gmat, 5, torch.bfloat16).double()  # the reference's precision
        assert float(torch.linalg.matrix_norm(xb - u @ v.mT, ord=2)) <= 0.25
    with pytest.raises(ValueError, match="1..5 steps"):
        polar_express(gmat, 6)


def _group(**kw: object) -> dict:
    base = {
        "kind": "muon", "lr": 0.1, "momentum": 0.95, "base_momentum": 0.95, "momentum_warmup": (0.85, 300),
        "weight_decay": 0.2, "base_weight_decay": 0.2, "taper_steps": 10, "beta2": 0.95, "ns_steps": 5,
        "ns_dtype": "float64", "t": 0,
    }  # fmt: skip
    return {**base, **kw}


def test_schedule_warms_momentum_and_tapers_decay() -> None:
    expect = {0: (0.85, 0.2), 5: (0.85 + 0.1 * 5 / 300, 0.1), 150: (0.9, 0.0), 300: (0.95, 0.0)}
    for t, (mom, wd) in expect.items():
        g = _group(t=t)
        MuonAdamW.schedule_(g)
        assert (g["momentum"], g["weight_decay"]) == pytest.approx((mom, wd), abs=1e-12), t
    g = _group(t=7, taper_steps=0, momentum_warmup=(0.85, 0))
    MuonAdamW.schedule_(g)
    assert (g["momentum"], g["weight_decay"]) == (0.95, 0.2)


def test_cautious_decay_and_shape_scaled_rate() -> None:
    """Zero gradient: no update, every weight decayed by lr' wd with lr' = lr sqrt(max(1, r / c)).
    A gradient: the decay only where the update and the weight have the same sign (X * W >= 0)."""
    torch.manual_seed(0)
    for shape, scale in (((32, 8), 2.0), ((8, 32), 1.0)):
        p = torch.randn(shape, dtype=torch.float64)
        p0 = p.clone()
        z = torch.zeros_like(p)
        muon_update_(p, z, torch.zeros_like(p), torch.zeros(1, shape[0], 1) if shape[0] >= shape[1]
                     else torch.zeros(1, 1, shape[1]), _group(), 1)  # fmt: skip
        lr, wd = (
            float(torch.tensor(x, dtype=torch.float32)) for x in (0.1 * scale, 0.2)
        )  # float32, as the reference
        torch.testing.assert_close(p, p0 * (1 - lr * wd), rtol=0, atol=1e-15)
    p, grad = torch.randn(16, 16, dtype=torch.float64), torch.randn(16, 16, dtype=torch.float64)
    with_decay, no_decay = p.clone(), p.clone()
    for q, wd in ((with_decay, 0.2), (no_decay, 0.0)):
        muon_update_(
            q,
            grad,
            torch.zeros_like(q),
            torch.zeros(1, 16, 1, dtype=torch.float64),
            _group(weight_decay=wd),
            1,
        )
    step = p - no_decay  # lr X
    decayed = (with_decay - no_decay).abs() > 1e-15
    assert torch.equal(decayed, (step * p) >= 0) and 0 < int(decayed.sum()) < 256


def test_fused_qkv_is_three_matrices() -> None:
    """A fused (3d, d) qkv projection takes the update of its three (d, d) pieces, each on its own."""
    torch.manual_seed(1)
    p, grad = torch.randn(24, 8, dtype=torch.float64), torch.randn(24, 8, dtype=torch.float64)
    assert muon_chunks("mix.qkv.weight", p) == 3 and muon_chunks("mix.proj.weight", p) == 1
    fused = p.clone()
    muon_update_(fused, grad, torch.zeros_like(p), torch.zeros(3, 8, 1, dtype=torch.float64), _group(), 3)
    for i in range(3):
        piece = p[8 * i : 8 * (i + 1)].clone()
        muon_update_(
            piece,
            grad[8 * i : 8 * (i + 1)],
            torch.zeros_like(piece),
            torch.zeros(1, 8, 1, dtype=torch.float64),
            _group(),
            1,
        )
        torch.testing.assert_close(fused[8 * i : 8 * (i + 1)], piece, rtol=0, atol=1e-15)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("train.muon_ns_steps=6", "train.muon_ns_steps"),
        ("train.muon_momentum=1.0", "train.muon_momentum"),
        ("train.muon_lr=-1", "train.muon_lr"),
        ("train.muon_weight_decay=-0.1", "train.muon_weight_decay"),
        ("train.muon_momentum_warmup_steps=-1", "train.muon_momentum_warmup_steps"),
        ("train.decay_all=true", "decay_all"),
        ("train.strategy=fsdp", "train.strategy=fsdp"),
    ],
)
def test_bad_muon_settings_are_config_errors(tmp_path, override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        build_config({}, [f"out_dir={tmp_path}", "train.optimizer=muon_adamw", override])


def _trainer(tmp_path, *extra: str) -> Trainer:
    cfg = tiny_config(tmp_path, "train.mode=simple", "train.optimizer=muon_adamw", "train.steps=4",
                      "train.checkpoint_every=2", "train.muon_momentum_warmup_steps=3", *extra)  # fmt: skip
    return Trainer(cfg, model=TinyLooped(seed=0), train_data=tiny_dataset(32), eval_data=None)


def test_muon_adamw_trains_and_resumes_bit_exact(tmp_path) -> None:
    """Muon takes the hidden matrices (w, u; not the embedding, the no_weight_decay gate, norms,
    biases), and a resumed run continues the Muon step counter and state exactly."""
    full = _trainer(tmp_path / "full")
    kinds = {n: g["kind"] for g in full.optimizer.param_groups for n in g["names"]}
    assert {n for n, k in kinds.items() if k == "muon"} >= {"w.weight", "u.weight"}
    assert kinds["emb.weight"] == kinds["gate"] == kinds["norm.weight"] == kinds["w.bias"] == "adamw"
    full.fit()
    killed = _trainer(tmp_path / "killed")
    original = killed.train_step

    def until_two() -> dict:
        if killed.step == 2:
            raise KeyboardInterrupt("simulated kill")
        return original()

    killed.train_step = until_two
    with pytest.raises(KeyboardInterrupt):
        killed.fit()
    resumed = _trainer(tmp_path / "killed", "train.resume=true")
    muon = next(g for g in resumed.optimizer.param_groups if g["kind"] == "muon")
    assert resumed.step == 2 and muon["t"] == 2
    resumed.fit()
    for (name, a), (_, b) in zip(full.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), name
    assert next(g for g in full.optimizer.param_groups if g["kind"] == "muon")["t"] == 4
