"""TRM: the step map against a hand-written latent recursion, the truncated (last-cycle) gradient
against a hand-written float64 autograd reference, the paper parameter count, puzzle tokens, training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from model_helpers import random_batch, train_losses

from loopformer.loop import LoopConfig
from loopformer.models import build_model
from loopformer.models.trm import TRM, TRMConfig, paper_config

V, T, D = 7, 6, 32


def tiny(**kw: object) -> TRMConfig:
    base = dict(vocab_size=V, seq_len=T, d_model=D, n_heads=4, n_layers=2, n_inner=2, expansion=2.0)
    base.update(kw)
    return TRMConfig(**base)


def batch(B: int = 3, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return random_batch(V, T, B, seed)


def net(model: TRM, h: torch.Tensor) -> torch.Tensor:
    for layer in model.net.layers:
        h = layer(h)
    return h


def test_step_equals_hand_written_recursion() -> None:
    model = TRM(tiny(n_inner=2)).double()
    inputs, _ = batch()
    (x,) = model.embed(inputs)
    z0 = torch.randn(3, 2, T, D, dtype=torch.float64)
    out = model.step(z0, x)
    y, z = z0[:, 0], z0[:, 1]
    z = net(model, z + (y + x))  # z = net(x + y + z), twice (n_inner = 2)
    z = net(model, z + (y + x))
    y = net(model, y + z)  # y = net(y + z)
    torch.testing.assert_close(out[:, 0], y, rtol=0, atol=1e-12)
    torch.testing.assert_close(out[:, 1], z, rtol=0, atol=1e-12)
    # n_inner is honoured: three latent updates give a different state
    out3 = TRM(tiny(n_inner=3)).double()
    out3.load_state_dict(model.state_dict())
    assert not torch.allclose(out3.step(z0, x), out)


def _grads(model: TRM) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _loss(model: TRM, logits: torch.Tensor, q: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1)) + 0.3 * q.sum()


def test_truncated_gradient_equals_last_cycle_reference() -> None:
    torch.manual_seed(0)
    model = TRM(tiny()).double()
    with torch.no_grad():  # make the q head matter in the gradient
        model.q_proj.weight.normal_(0, 0.1)
    inputs, labels = batch()
    assert model.config.loop.max_steps == 3 and model.config.loop.grad == "truncated"

    out = model(inputs)  # default loop: T = 3 cycles, first two without gradient
    _loss(model, out.logits, out.q_logits, labels).backward()
    got = _grads(model)

    model.zero_grad()
    (x,) = model.embed(inputs)
    z = model.init_state((x,))
    with torch.no_grad():
        for _ in range(2):
            z = model.step(z, x)
    z = model.step(z.detach(), x)
    _loss(model, model.readout(z, x), model.q_head(z, x), labels).backward()
    ref = _grads(model)

    assert got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-9, atol=1e-12, msg=name)
    torch.testing.assert_close(out.state, z.detach(), rtol=1e-12, atol=1e-12)

    # full backprop through all three cycles gives a different gradient (the test can fail)
    model.zero_grad()
    out = model(inputs, loop=LoopConfig(halting="fixed", max_steps=3, grad="bptt"))
    _loss(model, out.logits, out.q_logits, labels).backward()
    bptt = _grads(model)
    assert not torch.allclose(bptt["embedding.tokens.weight"], ref["embedding.tokens.weight"])


def test_paper_parameter_counts() -> None:
    attn = TRM(paper_config()).num_parameters()
    mlp = TRM(paper_config(mixer="mlp")).num_parameters()
    print(f"TRM paper size: attention {attn / 1e6:.2f}M, MLP-mixer {mlp / 1e6:.2f}M")
    assert abs(attn - 7e6) <= 0.15 * 7e6, attn
    assert abs(mlp - 5e6) <= 0.15 * 5e6, mlp


def test_puzzle_embedding_tokens() -> None:
    cfg = tiny(num_puzzle_ids=5, puzzle_emb_len=2)
    model = TRM(cfg)
    inputs, labels = batch()
    ids = torch.tensor([0, 3, 4])
    out = model(inputs, puzzle_ids=ids)
    assert out.logits.shape == (3, T, V)
    assert out.state.shape == (3, 2, T + 2, D)
    assert out.q_logits.shape == (3,)
    F.cross_entropy(out.logits.reshape(-1, V), labels.reshape(-1)).backward()
    grad = model.embedding.puzzle_emb.weight.grad
    assert grad[[0, 3, 4]].abs().sum() > 0 and grad[[1, 2]].abs().sum() == 0
    # the puzzle table is excluded from the count, as the papers count
    total = sum(p.numel() for p in model.parameters())
    assert model.num_parameters() == total - 5 * 2 * D
    with pytest.raises(ValueError, match="puzzle_ids"):
        model(inputs, puzzle_ids=torch.tensor([0, 1, 5]))
    with pytest.raises(ValueError, match="num_puzzle_ids"):
        TRM(tiny(num_puzzle_ids=0, puzzle_emb_len=2))
    # puzzle tokens with the MLP mixer (fixed size: seq_len tokens + the prefix)
    mlp = TRM(tiny(num_puzzle_ids=5, puzzle_emb_len=2, mixer="mlp"))
    assert mlp(inputs, puzzle_ids=ids).logits.shape == (3, T, V)


@pytest.mark.parametrize("causal,mixer", [(False, "attention"), (True, "attention"), (False, "mlp")])
def test_training_reduces_loss(causal: bool, mixer: str) -> None:
    torch.manual_seed(0)
    model = build_model("trm", config=tiny(causal=causal, mixer=mixer))
    inputs, labels = batch(B=4)
    losses = train_losses(model, inputs, labels, steps=8)
    assert losses[-1] < 0.8 * losses[0], losses


def test_causal_model_is_causal() -> None:
    model = TRM(tiny(causal=True)).double()
    inputs, _ = batch()
    changed = inputs.clone()
    changed[:, -1] = (changed[:, -1] + 1) % V
    a, b = model(inputs).logits, model(changed).logits
    torch.testing.assert_close(a[:, :-1], b[:, :-1])
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match="seq_len"):
        TRM(tiny(mixer="mlp"))(torch.zeros(2, T + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="inputs"):
        TRM(tiny())(torch.zeros(2, T))
    with pytest.raises(ValueError, match="n_inner"):
        TRM(tiny(n_inner=0))


def test_arc_canvas_with_puzzle_tokens() -> None:
    """ARC-like input: 30x30 canvases (900 tokens, vocab 12) with per-(task, version) puzzle ids."""
    import numpy as np

    from loopformer.tasks.arc import encode_grid

    grids = [np.array([[1, 2], [3, 4]]), np.array([[0, 5, 5]]), np.eye(3, dtype=np.int64) * 7]
    inputs = torch.from_numpy(np.stack([encode_grid(g) for g in grids])).long()
    assert inputs.shape == (3, 900)
    cfg = TRMConfig(
        vocab_size=12, seq_len=900, d_model=16, n_heads=2, n_inner=1, expansion=2.0,
        num_puzzle_ids=9, puzzle_emb_len=2, loop=LoopConfig(halting="fixed", max_steps=2, grad="truncated"),
    )  # fmt: skip
    model = TRM(cfg)
    out = model(inputs, puzzle_ids=torch.tensor([1, 5, 8]))
    assert out.logits.shape == (3, 900, 12) and out.state.shape == (3, 2, 902, 16)
    out.logits.logsumexp(-1).mean().backward()
    assert model.embedding.puzzle_emb.weight.grad[[1, 5, 8]].abs().sum(1).gt(0).all()


def test_learned_init_and_tied_embeddings() -> None:
    inputs, labels = batch()
    model = TRM(tiny(learned_init=True, tie_embeddings=True))
    assert model.lm_head is None and isinstance(model.y_init, torch.nn.Parameter)
    out = model(inputs, loop=LoopConfig(halting="fixed", max_steps=2, grad="bptt"))
    torch.testing.assert_close(out.logits, out.state[:, 0] @ model.embedding.tokens.weight.t())
    F.cross_entropy(out.logits.reshape(-1, V), labels.reshape(-1)).backward()
    assert model.y_init.grad.abs().sum() > 0 and model.z_init.grad.abs().sum() > 0
    # under the default truncated gradient the initial state sits in the no-grad prefix: no gradient
    # (why the fixed buffers are the default)
    model.zero_grad()
    out = model(inputs)
    F.cross_entropy(out.logits.reshape(-1, V), labels.reshape(-1)).backward()
    assert model.y_init.grad is None
    assert "y_init" not in dict(TRM(tiny()).named_parameters()) and "y_init" in TRM(tiny()).state_dict()
