"""Log-prob layer of diagnostics.gaps and the weights of diagnostics.weights on constructed cases."""
import math

import pytest
import torch

from nvfp4_sampler.diagnostics import gaps, weights
from nvfp4_sampler.diagnostics.report import recompute_agreement


def test_identical_log_probs_have_no_gap():
    lp = torch.tensor([[-0.1, -2.0, -5.0]])
    m = gaps.gap_metrics(lp, lp)
    assert m["kl"] == m["k3"] == m["chi2"] == m["log_ppl_diff"] == m["max_abs_gap"] == m["mean_abs_gap"] == 0.0
    assert m["ppl_ratio"] == 1.0 and m["tokens"] == 3


def test_known_values_and_mask():
    mu = torch.tensor([[-1.0, -2.0, -9.0]])          # sampler
    pi = torch.tensor([[-1.5, -1.0, 0.0]])           # learner: g = [-0.5, +1.0, (masked out)]
    mask = torch.tensor([[True, True, False]])
    m = gaps.gap_metrics(mu, pi, mask)
    assert m["tokens"] == 2
    assert m["kl"] == pytest.approx(((-1.0 + 1.5) + (-2.0 + 1.0)) / 2)
    assert m["k3"] == pytest.approx(((math.exp(-0.5) + 0.5 - 1) + (math.exp(1.0) - 1.0 - 1)) / 2)
    assert m["chi2"] == pytest.approx((math.exp(-1.0) + math.exp(2.0)) / 2 - 1)
    assert m["log_ppl_diff"] == pytest.approx(1.5 - 1.25) and m["ppl_ratio"] == pytest.approx(math.exp(0.25))
    assert m["max_abs_gap"] == pytest.approx(1.0) and m["mean_abs_gap"] == pytest.approx(0.75)


def test_shapes_must_match():
    with pytest.raises(ValueError, match="must be one"):
        gaps.gap_metrics(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="mask"):
        gaps.gap_metrics(torch.zeros(1, 3), torch.zeros(1, 3), torch.ones(1, 4))


def test_segments_respect_rows_and_mask():
    """Two rows of 5 tokens, segment 2: masked-out positions do not count towards a segment."""
    g = torch.tensor([[-0.1, 9.0, -2.0, 0.3, 0.0], [0.5, -0.2, 0.0, 0.0, -3.0]], dtype=torch.float64)
    mask = torch.tensor([[True, False, True, True, True], [True, True, False, False, True]])
    seg = gaps.segments(g, mask, 2)
    # row 0 masked tokens: -0.1, -2.0 | 0.3, 0.0 ; row 1: 0.5, -0.2 | -3.0
    assert seg.row.tolist() == [0, 0, 1, 1]
    assert seg.count.tolist() == [2, 2, 2, 1]
    assert seg.tail_depth.tolist() == pytest.approx([2.0, 0.0, 0.2, 3.0])
    assert seg.mean_gap.tolist() == pytest.approx([-1.05, 0.15, 0.15, -3.0])
    assert seg.ids[0].tolist() == [0, -1, 0, 1, 1] and seg.ids[1].tolist() == [2, 2, -1, -1, 3]


def test_tail_metrics_find_a_concentrated_tail():
    """A small mean gap hides one deep token: mean |gap| ~ 0.05 but the worst segment is 4 nats deep."""
    g = torch.full((1, 256), 0.02, dtype=torch.float64)
    g[0, 200] = -4.0
    mu = torch.zeros_like(g) - 1.0
    t = gaps.tail_metrics(mu, mu + g, segment=64)
    assert gaps.gap_metrics(mu, mu + g)["mean_abs_gap"] < 0.05
    assert t["segments"] == 4 and t["tail_depth_max"] == pytest.approx(4.0) and t["risky_share"] == 0.25


def test_direction_shares():
    mu = torch.zeros(2, 3, dtype=torch.float64)
    pi = torch.tensor([[0.5, -0.5, -0.05], [0.5, -0.5, 0.0]], dtype=torch.float64)
    d = gaps.direction_shares(mu, pi, torch.tensor([1.0, -1.0]), flip_margin=0.1)
    # flips: A>0 & g<-0.1 (row 0 token 1); A<0 & g>0.1 (row 1 token 0)
    assert d["tokens"] == 6 and d["flip_share"] == pytest.approx(2 / 6)
    assert d["pos_adv_neg_gap"] == pytest.approx(2 / 6) and d["neg_adv_pos_gap"] == pytest.approx(2 / 6)


# ------------------------------------------------------------------ weights

def test_tis_truncates():
    mu = torch.tensor([[-1.0, -1.0, -1.0]])
    pi = torch.tensor([[-1.0, 0.0, -1.0 - math.log(4)]])
    w = weights.tis(mu, pi, torch.tensor([[True, True, True]]), cap=2.0)
    assert w[0].tolist() == pytest.approx([1.0, 2.0, 0.25])


def test_icepop_band():
    mu = torch.zeros(1, 4, dtype=torch.float64)
    pi = torch.log(torch.tensor([[0.4, 0.5, 5.0, 5.1]], dtype=torch.float64))
    assert weights.icepop(mu, pi).tolist() == [[0.0, 1.0, 1.0, 0.0]]


def test_opsm_drops_only_drifted_negative_responses():
    mu = torch.zeros(3, 2)
    pi = torch.tensor([[-0.1, -0.1], [-0.1, -0.1], [-0.01, -0.01]])   # drift 0.1, 0.1, 0.01
    w = weights.opsm(mu, pi, torch.tensor([-1.0, 1.0, -1.0]), delta=0.03)
    assert w.tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]


def test_triage_gate_attenuates_negative_gap_tokens_in_risky_negative_segments():
    """Negative advantage; segment 0 (tokens 0-63) holds a -2 nat token (risky), segment 1 only -0.3."""
    g = torch.zeros(1, 128, dtype=torch.float64)
    g[0, 10], g[0, 11], g[0, 12] = -2.0, -0.5, 0.4
    g[0, 70] = -0.3
    mu = torch.full_like(g, -2.0)
    w = weights.triage(mu, mu + g, torch.tensor([-1.0]))
    assert w[0, 10] == pytest.approx(math.exp(-2.0)) and w[0, 11] == pytest.approx(math.exp(-0.5))
    assert w[0, 12] == 1.0 and w[0, 70] == 1.0 and w[0, 0] == 1.0        # positive gap / non-risky / zero gap
    w_pos = weights.triage(mu, mu + g, torch.tensor([1.0]))              # positive advantage: no gate
    assert w_pos[0, 10] != pytest.approx(math.exp(-2.0))


def test_triage_repair_is_bounded_and_per_128_segment():
    g = torch.zeros(1, 256, dtype=torch.float64)
    g[0, :128] = -0.2                    # segment 0 offset -0.2 -> repaired by exp(0.2)
    g[0, 128:] = -3.0                    # segment 1 offset -3   -> bounded at 2x
    mu = torch.full_like(g, -1.0)
    w = weights.triage(mu, mu + g, torch.tensor([0.5]))
    assert w[0, :128].tolist() == pytest.approx([math.exp(0.2)] * 128)
    assert w[0, 128:].tolist() == pytest.approx([2.0] * 128)
    assert weights.triage(mu, mu + g, torch.tensor([0.0])).tolist() == [[1.0] * 256]   # A == 0: untouched


def test_weights_are_zero_outside_the_mask():
    mu = torch.zeros(1, 4)
    mask = torch.tensor([[True, False, True, False]])
    for w in (weights.tis(mu, mu, mask), weights.icepop(mu, mu, mask), weights.opsm(mu, mu, [1.0], mask),
              weights.triage(mu, mu, [1.0], mask)):
        assert w.tolist() == [[1.0, 0.0, 1.0, 0.0]]


def test_recompute_agreement_counts_bitwise_equal_tokens():
    """A sampler's decode log-probs against its own recomputation: equal floats count as equal, any
    difference (however small) does not; ragged rows must pair up."""
    got = recompute_agreement([[-1.0, -2.0], [-0.5]], [[-1.0, -2.0 + 1e-12], [-0.25]])
    assert got["tokens"] == 3 and got["equal_share"] == pytest.approx(1 / 3)
    assert got["max_abs"] == pytest.approx(0.25) and got["mean_abs"] == pytest.approx((1e-12 + 0.25) / 3)
    assert recompute_agreement([[-1.0]], [[-1.0]])["equal_share"] == 1.0
    with pytest.raises(ValueError):
        recompute_agreement([[-1.0, -2.0]], [[-1.0]])

