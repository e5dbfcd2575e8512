"""``learned_positions``: a learned absolute position table in every family's input embedding."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loopformer.models.registry import build_model, make_config

FAMILIES = ["fprm", "transformer", "trm", "hrm", "recurrent", "attractor", "ut_act"]


def _model(name: str, learned: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = make_config(name, vocab_size=7, seq_len=16, d_model=16, n_heads=2, learned_positions=learned)
    return build_model(name, cfg)


@pytest.mark.parametrize("name", FAMILIES)
def test_learned_positions_add_a_trained_table_that_changes_the_output(name: str) -> None:
    base, model = _model(name, False), _model(name, True)
    extra = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in base.parameters())
    assert extra == 16 * 16  # one [seq_len, d_model] table
    tables = [p for n, p in model.named_parameters() if n.endswith("positions.table")]
    assert len(tables) == 1
    x = torch.randint(1, 7, (3, 16))
    loop = model.config.loop  # a short loop keeps the test fast
    kwargs = {"loop": dataclasses.replace(loop, max_steps=max(2, loop.min_steps))}
    gen = torch.Generator().manual_seed(1)
    out = model(x, generator=gen, **kwargs).logits
    out.float().square().mean().backward()
    assert tables[0].grad is not None and tables[0].grad.abs().sum() > 0  # the table is trained
    with torch.no_grad():
        tables[0].add_(torch.randn_like(tables[0]))
    again = model(x, generator=torch.Generator().manual_seed(1), **kwargs).logits
    assert not torch.allclose(out, again)  # the output depends on the table
    # the table fixes the input length
    with pytest.raises(ValueError, match="seq_len = 16"):
        model(x[:, :15], generator=torch.Generator().manual_seed(1), **kwargs)


def test_transformer_mlp_mixer_matches_fprm_parameter_count_and_mixes_tokens() -> None:
    """The plain transformer with the MLP mixer: the same blocks as FPRM's (equal parameters up to FPRM's
    residual scalars and Q head), and every output position depends on every input position."""
    torch.manual_seed(0)
    kw = {"vocab_size": 7, "seq_len": 16, "d_model": 16, "n_heads": 2, "n_layers": 2, "mixer": "mlp"}
    tr = build_model("transformer", make_config("transformer", **kw))
    fp = build_model("fprm", make_config("fprm", **kw, q_head=False))
    blocks = lambda m: sum(p.numel() for n, p in m.named_parameters() if n.startswith("layers."))  # noqa: E731
    assert blocks(tr) == blocks(fp) > 0
    x = torch.randint(1, 7, (1, 16))
    emb = tr.embedding(x).detach().requires_grad_(True)
    out = tr.readout(tr.step(emb))
    out[0, 0].sum().backward()
    assert (emb.grad[0].abs().sum(-1) > 0).all()  # position 0 reads all 16 positions
    with pytest.raises(ValueError, match="unknown mixer"):
        build_model("transformer", make_config("transformer", **{**kw, "mixer": "conv"}))
