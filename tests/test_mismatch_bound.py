"""The (1 − p) bound on log-prob mismatch under a bounded logit perturbation.

If every logit moves by at most ε (|δ_b| <= ε), then for every token a

    Δ log p_a = δ_a − log Σ_b p_b e^{δ_b} = −log(p_a + (1 − p_a) e^{x}),   x = log E_{b≠a}[e^{δ_b}] − δ_a ∈ [−2ε, 2ε]

which gives, exactly (not only to first order):
    (i)  |Δ log p_a| <= 2ε (1 − min(p_a, p'_a))     (p' the perturbed probability)
    (ii) |Δ log p_a| <= (e^{2ε} − 1)(1 − p_a)         (= 2ε(1 − p_a) + O(ε²))
The textbook form |Δ log p_a| <= 2ε(1 − p_a) with the *unperturbed* p_a is first-order only; the last test shows
a case where it is exceeded, so the exact forms are what the property tests check.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

TOL = 1e-12  # float64 rounding of log_softmax differences


def _delta(z: torch.Tensor, delta: torch.Tensor):
    lp = torch.log_softmax(z, -1)
    lq = torch.log_softmax(z + delta, -1)
    return lq - lp, lp.exp(), lq.exp()


@settings(max_examples=200, deadline=None)
@given(
    v=st.integers(2, 300), seed=st.integers(0, 2**31 - 1), scale=st.floats(0.0, 20.0),
    eps=st.floats(1e-6, 3.0), kind=st.sampled_from(["uniform", "sign", "one_hot", "bf16_like"]),
)
def test_log_prob_mismatch_is_bounded_by_one_minus_p(v, seed, scale, eps, kind):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(v, generator=gen, dtype=torch.float64) * scale
    if kind == "uniform":
        delta = (torch.rand(v, generator=gen, dtype=torch.float64) * 2 - 1) * eps
    elif kind == "sign":  # extreme points of the ε-box: the worst cases live here
        delta = torch.where(torch.rand(v, generator=gen) < 0.5, -1.0, 1.0).double() * eps
    elif kind == "one_hot":  # one token moves by ε, the rest by −ε
        delta = torch.full((v,), -eps, dtype=torch.float64)
        delta[torch.randint(0, v, (1,), generator=gen)] = eps
    else:  # rounding-like error: relative to |z|, clipped to ε
        delta = (z.abs() * 2.0**-8 * (torch.rand(v, generator=gen, dtype=torch.float64) * 2 - 1)).clamp(-eps, eps)
    assert float(delta.abs().max()) <= eps
    d, p, p_new = _delta(z, delta)
    assert (d.abs() <= 2 * eps * (1 - torch.minimum(p, p_new)) + TOL).all()
    assert (d.abs() <= math.expm1(2 * eps) * (1 - p) + TOL).all()
    # and the first-order form holds up to its O(ε²) remainder
    assert (d.abs() <= 2 * eps * (1 - p) + (math.expm1(2 * eps) - 2 * eps) + TOL).all()


def test_first_order_form_can_be_exceeded():
    """p_a = 1/2 and token a's logit drops by ε while the other rises by ε: |Δ| = log(cosh-like) > 2ε(1 − p_a)."""
    eps = 1.0
    z = torch.zeros(2, dtype=torch.float64)
    d, p, _ = _delta(z, torch.tensor([-eps, eps], dtype=torch.float64))
    assert abs(abs(float(d[0])) - math.log(0.5 + 0.5 * math.exp(2 * eps))) < 1e-12
    assert abs(float(d[0])) > 2 * eps * (1 - float(p[0]))  # 1.434 > 1.0
    assert abs(float(d[0])) <= 2 * eps * (1 - min(float(p[0]), float(torch.softmax(z + torch.tensor([-eps, eps]), -1)[0])))


def test_bound_is_tight_to_first_order():
    """The worst case of (ii) is attained as ε → 0: the bound cannot be tightened by a constant factor."""
    eps = 1e-4
    z = torch.tensor([2.0, 0.0, -1.0, 0.5], dtype=torch.float64)
    delta = torch.tensor([eps, -eps, -eps, -eps], dtype=torch.float64)
    d, p, _ = _delta(z, delta)
    assert float(d[0]) / (2 * eps * (1 - float(p[0]))) > 0.9998
