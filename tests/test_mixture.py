"""Mixture weights, epochs and the blended sample schedule (trainbook.pretrain.mixture)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainbook.pretrain import mixture as X

SIZES = {"royal": 700, "named": 250, "minor": 50}


def test_temperature_interpolates_from_proportional_to_uniform():
    assert X.temperature_weights(SIZES, 1) == pytest.approx({"royal": .7, "named": .25,
                                                             "minor": .05})
    flat = X.temperature_weights(SIZES, 1e6)
    assert all(v == pytest.approx(1 / 3, abs=1e-5) for v in flat.values())
    w2 = X.temperature_weights(SIZES, 2)
    assert w2["minor"] > 0.05 and w2["royal"] < 0.7


def test_gpt3_epochs_against_its_weights():
    """GPT-3 Table 2.2: the printed epochs imply weights epochs * tokens / 300B; rounded to whole
    percent they are the printed weights for every source but WebText2 (18%, printed 22%)."""
    tokens = {k: v[0] for k, v in X.GPT3_MIX.items()}
    weights = {k: v[1] for k, v in X.GPT3_MIX.items()}
    printed = {k: v[2] for k, v in X.GPT3_MIX.items()}
    implied = {k: printed[k] * tokens[k] / 300e9 for k in tokens}
    off = {k for k in tokens if round(100 * implied[k]) != round(100 * weights[k])}
    assert off == {"WebText2"} and round(100 * implied["WebText2"]) == 18
    ep = X.epochs(weights, tokens, 300e9)  # forwards, from the rounded weights
    assert ep["Common Crawl (filtered)"] == pytest.approx(0.44, abs=0.005)
    assert ep["WebText2"] == pytest.approx(3.47, abs=0.01)
    assert sum(weights.values()) == pytest.approx(1.01)  # the printed weights sum to 101%


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(0.01, 10), min_size=1, max_size=5), st.integers(1, 400))
def test_greedy_blend_tracks_every_prefix(ws, n):
    weights = {str(i): w for i, w in enumerate(ws)}
    src = X.blend(weights, 0, n)
    w = np.array(ws) / sum(ws)
    counts = np.stack([np.cumsum(src == k) for k in range(len(ws))], 1)
    target = np.maximum(np.arange(n), 1)[:, None] * w
    assert np.abs(counts - target).max() <= 1.0 + 1e-9


@pytest.mark.parametrize("method", X.METHODS)
def test_any_slice_of_the_schedule_is_the_same(method):
    w = X.temperature_weights(SIZES, 2)
    full = X.sample_ids(w, SIZES, 0, 1500, method, seed=3)
    assert X.sample_ids(w, SIZES, 600, 900, method, seed=3) == full[600:]  # resume
    per_source = {k: [i for s, i in full if s == k] for k in SIZES}
    for k, items in per_source.items():  # each epoch of a source is a permutation of it
        n = SIZES[k]
        for e in range(len(items) // n):
            assert sorted(items[e * n:(e + 1) * n]) == list(range(n))


def test_bad_input():
    with pytest.raises(ValueError, match="temperature must be positive"):
        X.temperature_weights(SIZES, 0)
    with pytest.raises(ValueError, match="must be positive"):
        X.temperature_weights({"a": 0}, 1)
    with pytest.raises(ValueError, match="same sources"):
        X.epochs({"a": 1}, {"b": 1}, 10)
    with pytest.raises(ValueError, match="method 'shuffle' is unknown"):
        X.blend({"a": 1}, 0, 3, "shuffle")
    with pytest.raises(ValueError, match="need at least one source"):
        X.blend({}, 0, 3)
