"""Loop-count samplers: reproducible per global step, right distribution, clipped."""

import math

import numpy as np
import pytest

from loopformer.loop import make_sampler


@pytest.mark.parametrize(
    "kind,kw", [("fixed", dict(n=5)), ("poisson", dict(seed=3)), ("lognormal_poisson", dict(seed=3))]
)
def test_same_global_step_same_count(kind, kw):
    a, b = make_sampler(kind, **kw), make_sampler(kind, **kw)  # e.g. two ranks, or a resumed run
    first = [a.sample(s) for s in range(200)]
    assert first == [b.sample(s) for s in range(200)]
    assert first == [a.sample(s) for s in range(200)]  # no hidden state: replaying a step replays R


def test_fixed():
    assert {make_sampler("fixed", n=7).sample(s) for s in range(50)} == {7}


def test_poisson_mean_and_clip():
    sampler = make_sampler("poisson", mean=4, low=2, high=8, seed=0)
    draws = np.array([sampler.sample(s) for s in range(4000)])
    assert draws.min() >= 2 and draws.max() <= 8
    assert set(draws.tolist()) == set(range(2, 9))
    # expected mean of Poisson(4) clipped to [2, 8], computed from the pmf
    pmf = [math.exp(-4) * 4**k / math.factorial(k) for k in range(60)]
    expected = sum(p * min(max(k, 2), 8) for k, p in enumerate(pmf))
    assert abs(draws.mean() - expected) < 0.1, (draws.mean(), expected)
    other_seed = make_sampler("poisson", mean=4, low=2, high=8, seed=1)
    assert [other_seed.sample(s) for s in range(50)] != draws[:50].tolist()


def test_lognormal_poisson_mean():
    """Huginn: E[Poisson(exp(tau))] = exp(mu + sigma^2 / 2) = mean, so E[R] = mean + 1 (before clipping)."""
    sampler = make_sampler("lognormal_poisson", mean=8, sigma=0.5, low=1, high=1000, seed=0)
    draws = np.array([sampler.sample(s) for s in range(4000)])
    assert draws.min() >= 1
    assert abs(draws.mean() - 9.0) < 0.4
    clipped = make_sampler("lognormal_poisson", mean=8, sigma=0.5, low=2, high=6, seed=0)
    assert {clipped.sample(s) for s in range(300)} <= set(range(2, 7))


def test_bad_sampler_arguments():
    with pytest.raises(ValueError, match="unknown sampler"):
        make_sampler("uniform")
    with pytest.raises(ValueError, match="low"):
        make_sampler("poisson", low=5, high=2)
    with pytest.raises(ValueError, match="bad arguments"):
        make_sampler("poisson", lam=3)
    with pytest.raises(ValueError, match="global_step"):
        make_sampler("poisson").sample(-1)


def test_each_sampler_declares_what_it_takes_from_the_run() -> None:
    from loopformer.loop.samplers import SAMPLERS, sampler_defaults, training_sampler

    assert sampler_defaults("fixed", max_steps=6, seed=3) == {"n": 6}
    assert sampler_defaults("poisson", 6, 3) == sampler_defaults("lognormal_poisson", 6, 3) == {"seed": 3}
    assert sampler_defaults("no_such_sampler", 6, 3) == {}
    assert set(SAMPLERS) == {"fixed", "poisson", "lognormal_poisson"}
    assert training_sampler("fixed", {}, max_steps=6, seed=3).n == 6
    assert training_sampler("poisson", {"seed": 11}, max_steps=6, seed=3).seed == 11  # given options win
    assert training_sampler("none", {}, max_steps=6, seed=3) is None
    with pytest.raises(ValueError, match="unknown sampler 'nope'"):
        training_sampler("nope", {}, 6, 3)
