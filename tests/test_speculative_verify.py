"""Verification of proposed tokens (``fd_core/engine/speculative/verify.py``) keeps the target's
distribution: over many seeds the emitted tokens pass a chi-square test against the target's
probabilities, and deliberately wrong rules fail the same test; with the contract's
counter-based noise, the tokens emitted with proposals are exactly those emitted without."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fd_core.engine.speculative.verify import accepted
from fd_core.testing import spec
from fd_core.testing.batches import make_sampling_batch

V = 16
ALPHA_Z = 3.719  # the standard normal's upper 1e-4 quantile: the test's significance is 1e-4


def chi2_critical(df: int, z: float = ALPHA_Z) -> float:
    """Wilson-Hilferty's approximation of the chi-square quantile (no scipy here)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """The statistic over the cells the distribution gives mass (a count where it gives none
    makes it infinite), and its degrees of freedom."""
    live = probs > 0
    if counts[~live].any():
        return math.inf, int(live.sum()) - 1
    expected = counts.sum() * probs[live]
    return float(np.sum((counts[live] - expected) ** 2 / expected)), int(live.sum()) - 1


@pytest.fixture(scope="module")
def draws():
    """12,000 sequences, each with one proposal drawn from a distribution q half the target p's,
    verified at step 5: the target's two rows (step 5, and step 6 after the
    proposal) sampled by the spec's ``sample``."""
    rng = np.random.default_rng(3)
    logits_row = rng.normal(0, 1.5, V).astype(np.float32)
    p = spec.filtered_probs(logits_row, 1.0, 0, 1.0, 0.0).astype(np.float64)
    q = 0.5 * p / p.sum() + 0.5 * rng.dirichlet(np.ones(V) * 0.7)  # a proposer half right
    n = 12000
    seeds = np.repeat(np.arange(n, dtype=np.int64) * 7919 + 13, 2)
    batch = make_sampling_batch(2 * n, seeds=seeds, steps=np.tile([5, 6], n))
    sampled = spec.sample(np.tile(logits_row, (2 * n, 1)), batch).token_ids
    proposals = rng.choice(V, size=n, p=q / q.sum())
    return p, q, proposals, sampled, batch


def test_emitted_tokens_follow_the_target(draws):
    p, q, proposals, sampled, _ = draws
    n = len(proposals)
    ok = accepted(sampled, np.arange(0, 2 * n, 2), proposals[:, None].tolist())
    first = sampled[0::2]  # accepted: the proposal, which is the token drawn there; else the draw
    np.testing.assert_array_equal(first[ok == 1], proposals[ok == 1])
    stat, df = chi2(np.bincount(first, minlength=V), p)
    assert stat < chi2_critical(df), (stat, chi2_critical(df))
    # a proposal d is accepted with probability p(d)
    rate = float(np.dot(q, p))
    assert abs(ok.mean() - rate) < 4 * math.sqrt(rate * (1 - rate) / n)
    second = sampled[1::2][ok == 1]  # after an accepted proposal: the next position's draw
    stat, df = chi2(np.bincount(second, minlength=V), p)
    assert stat < chi2_critical(df), (stat, chi2_critical(df))


@pytest.mark.parametrize("rule", ["always accept", "redraw on rejection"])
def test_a_wrong_rule_fails_the_same_test(draws, rule):
    p, _, proposals, sampled, batch = draws
    ok = accepted(sampled, np.arange(0, 2 * len(proposals), 2), proposals[:, None].tolist()) == 1
    if rule == "always accept":
        first = proposals
    else:  # a rejected proposal replaced by a fresh draw from p (another step's noise), not the residual
        fresh = spec.sample(np.tile(np.log(p + 1e-30).astype(np.float32), (len(proposals), 1)),
                            make_sampling_batch(len(proposals), seeds=batch.seeds[0::2], steps=[99] * len(proposals)))
        first = np.where(ok, proposals, fresh.token_ids)
    stat, df = chi2(np.bincount(first, minlength=V), p)
    assert stat > chi2_critical(df), (rule, stat)


def test_accepted_counts_stop_at_the_first_proposal_that_differs():
    # rows 0-3: three proposals, all right; 4-6: the second wrong; 7-9: the first wrong, the
    # second right (it does not count); 10: a row without drafts (not asked about); 11-12: one,
    # wrong; 13-14: one, right, in the last rows
    sampled = np.array([5, 6, 7, 1, 2, 3, 9, 4, 8, 0, 4, 6, 0, 2, 2])
    starts = np.array([0, 4, 7, 11, 13])
    drafts = [[5, 6, 7], [2, 8], [5, 8], [3], [2]]
    np.testing.assert_array_equal(accepted(sampled, starts, drafts), [3, 1, 0, 0, 1])
    assert accepted(sampled, np.zeros(0, np.int64), []).shape == (0,)


def test_seeded_tokens_are_the_same_with_and_without_proposals():
    """A sequence decoding 6 tokens one step at a time, and the same sequence verifying
    proposals (some right, some wrong) in steps of several rows beside other sequences, emit
    the same tokens at temperature 0.8 (the logits of a position do not depend on the path
    here: a fixed table, as a model would give for the same tokens)."""
    rng = np.random.default_rng(21)
    table = rng.normal(0, 2, (6, 200)).astype(np.float32)  # the target's logits at output index 0..5
    seed = 4242

    def rows(steps):
        return make_sampling_batch(len(steps), temperature=[0.8] * len(steps), top_p=[0.9] * len(steps),
                                   seeds=[seed] * len(steps), steps=steps)

    plain = [int(spec.sample(table[s : s + 1], rows([s])).token_ids[0]) for s in range(6)]
    emitted, at = [], 0
    for guesses in ([plain[0], plain[1]], [plain[3] + 1], [plain[4], plain[5]]):
        guesses = guesses[: 5 - at]
        positions = list(range(at, at + len(guesses) + 1))
        other = rng.normal(0, 2, (2, 200)).astype(np.float32)  # another sequence in the step
        batch = make_sampling_batch(len(positions) + 2, temperature=[0.8] * len(positions) + [1.0, 1.0],
                                    top_p=[0.9] * len(positions) + [1.0, 1.0],
                                    seeds=[seed] * len(positions) + [7, 7], steps=positions + [30, 31])
        sampled = spec.sample(np.concatenate([table[positions], other]), batch).token_ids
        a = int(accepted(sampled, np.array([0]), [guesses])[0])
        emitted += sampled[: a + 1].tolist()
        at += a + 1
        if at >= 6:
            break
    assert emitted[:6] == plain
