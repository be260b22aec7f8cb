"""Mismatch metrics of server/mismatch.py against hand-computed values."""
import math

import pytest
import torch

from server.mismatch import mismatch


def test_identical_log_probs_have_no_mismatch():
    lp = torch.tensor([-0.1, -2.0, -5.0])
    m = mismatch(lp, lp)
    assert m["kl"] == m["k3"] == m["chi2"] == m["log_ppl_diff"] == m["max_abs"] == 0.0 and m["ppl_ratio"] == 1.0


def test_known_values():
    mu = torch.tensor([-1.0, -2.0])                 # sampler
    pi = torch.tensor([-1.5, -1.0])                 # learner: log rho = [-0.5, +1.0]
    m = mismatch(mu, pi)
    assert m["kl"] == pytest.approx(((-1.0 + 1.5) + (-2.0 + 1.0)) / 2)
    assert m["k3"] == pytest.approx(((math.exp(-0.5) + 0.5 - 1) + (math.exp(1.0) - 1.0 - 1)) / 2)
    assert m["chi2"] == pytest.approx((math.exp(-1.0) + math.exp(2.0)) / 2 - 1)
    assert m["log_ppl_diff"] == pytest.approx(1.5 - 1.25)
    assert m["ppl_ratio"] == pytest.approx(math.exp(0.25))
    assert m["max_abs"] == pytest.approx(1.0) and m["tokens"] == 2


def test_shapes_must_match():
    with pytest.raises(ValueError, match="need two 1-D tensors of one length"):
        mismatch(torch.zeros(3), torch.zeros(4))
