"""Exact and MinHash-LSH near-duplicate removal (trainbook.pretrain.dedup) and the `dedup`
command."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainbook.__main__ import main
from trainbook.pretrain import dedup, quality

DOCS = [d for d in quality.speeches() if len(d.split()) >= 60][:300]
VOCAB = sorted(set(dedup.normalize(" ".join(DOCS)).split()))


def test_normalisation_makes_trivial_variants_exact_duplicates():
    a = "To be, or not to be: that is the question."
    assert dedup.exact_key(a) == dedup.exact_key("TO BE   or not to be -- that is the question")
    assert dedup.exact_key(a) != dedup.exact_key(a.replace("question", "answer"))


def test_fineweb_probabilities_are_reproduced():
    """FineWeb (14 buckets of 8): 56%, 77%, 92% and 98.8% at s = 0.7, 0.75, 0.8, 0.85."""
    p = dedup.p_candidate(np.array([0.7, 0.75, 0.8, 0.85]), 14, 8)
    assert np.round(100 * p[:3]).tolist() == [56, 77, 92]
    assert round(100 * p[3], 1) == 98.8


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 40), st.integers(1, 40), st.floats(0, 1))
def test_s_curve_is_monotone_and_half_at_threshold(bands, rows, s):
    assert 0 <= dedup.p_candidate(s, bands, rows) <= 1
    assert dedup.p_candidate(min(1.0, s + 0.01), bands, rows) >= dedup.p_candidate(s, bands, rows)
    assert dedup.p_candidate(dedup.threshold(bands, rows), bands, rows) == pytest.approx(0.5)


def test_minhash_agreement_estimates_jaccard():
    rng = np.random.default_rng(0)
    a = dedup.shingles(DOCS[0])
    b = dedup.shingles(dedup.perturb(DOCS[0], 0.05, VOCAB, rng))
    s = dedup.jaccard(a, b)
    est = (dedup.minhash(a, 2000) == dedup.minhash(b, 2000)).mean()
    assert 0.2 < s < 0.95
    assert abs(est - s) < 4 * np.sqrt(s * (1 - s) / 2000)


def test_batched_signatures_equal_one_at_a_time():
    docs = [*DOCS[:20], "", "one two"]
    one = np.stack([dedup.minhash(dedup.shingles(d), 64) for d in docs])
    assert (dedup.signatures(docs, 64) == one).all()


def test_catch_rate_follows_the_s_curve():
    """Planted near duplicates: the fraction LSH catches in each similarity bin is the S-curve's
    mean over the bin, within sampling error."""
    rng = np.random.default_rng(1)
    frac = rng.uniform(0, 0.12, len(DOCS))
    copies = [dedup.perturb(d, f, VOCAB, rng) for d, f in zip(DOCS, frac)]
    sa, sb = dedup.signatures(DOCS), dedup.signatures(copies)
    s = np.array([dedup.jaccard(dedup.shingles(x), dedup.shingles(y))
                  for x, y in zip(DOCS, copies)])
    got = dedup.caught(sa, sb, 14, 8)
    p = dedup.p_candidate(s, 14, 8)
    assert abs(got.mean() - p.mean()) < 4 * np.sqrt((p * (1 - p)).sum()) / len(p) + 0.01
    assert got[s > 0.9].all() and not got[s < 0.3].any()


def test_deduplicate_removes_exact_and_near_copies_and_keeps_the_first():
    rng = np.random.default_rng(2)
    docs = [*DOCS[:50], DOCS[3].upper(), dedup.perturb(DOCS[7], 0.01, VOCAB, rng)]
    res = dedup.deduplicate(docs)
    assert [3, 50] in res.exact
    assert any(c[0] == 7 and 51 in c for c in res.near)
    assert res.keep == list(range(50))
    assert res.removed(len(docs)) == {"documents": 52, "exact": 1, "near": 1, "kept": 50}


def test_verification_threshold_splits_a_bucket():
    sig = np.array([[1, 2, 3, 4], [1, 2, 9, 9]], dtype=np.uint64)
    assert dedup.lsh_clusters(sig, 2, 2) == [[0, 1]]  # share the first band
    assert dedup.lsh_clusters(sig, 2, 2, min_similarity=0.75) == []  # agree on only 2 of 4


def test_best_banding_puts_the_curve_near_the_target():
    b, r = dedup.best_banding(0.8, 128)
    assert b * r <= 128 and abs(dedup.threshold(b, r) - 0.8) < 0.1


def test_bad_input():
    with pytest.raises(ValueError, match="bands and rows must be >= 1"):
        dedup.p_candidate(0.5, 0, 8)
    with pytest.raises(ValueError, match="shingle size"):
        dedup.shingles("a b", 0)
    with pytest.raises(ValueError, match="bands \\* rows"):
        dedup.lsh_clusters(np.zeros((3, 10), dtype=np.uint64), 4, 4)
    with pytest.raises(ValueError, match="fraction must be in"):
        dedup.perturb("a b", 1.5, ["x"], np.random.default_rng(0))
    with pytest.raises(ValueError, match="target similarity"):
        dedup.best_banding(1.0, 100)
    with pytest.raises(ValueError, match="min_similarity"):
        dedup.deduplicate(["a"], min_similarity=2)


# -- the command ---------------------------------------------------------------------------------

def test_command_files_and_paragraphs(tmp_path, capsys):
    a, b, c = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "c.txt"
    a.write_text(DOCS[0])
    b.write_text(DOCS[0].lower() + "\n")
    c.write_text("\n\n".join([DOCS[1], DOCS[2], DOCS[1]]))
    assert main(["dedup", str(a), str(b), str(c), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["exact"] == 1 and out["kept"] == 2 and out["exact_groups"] == [[str(a), str(b)]]
    kept = tmp_path / "kept.txt"
    assert main(["dedup", str(c), "--split", "paragraph", "--out", str(kept)]) == 0
    assert "1 exact duplicates" in capsys.readouterr().out
    assert kept.read_text().count(DOCS[1]) == 1


@pytest.mark.parametrize("argv, message", [
    (["dedup", "missing.txt"], "no file at missing.txt"),
    (["dedup", "a.txt", "--threshold", "1.5"], "--threshold must be in [0, 1]"),
    (["dedup", "a.txt", "--bands", "1000", "--rows", "1000"], "use at most"),
    (["dedup", "empty.txt"], "no documents"),
    (["dedup", "a.txt", "--out", "a.txt/kept.txt"], "is a file, not a folder"),
])
def test_command_bad_input(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("some text here")
    (tmp_path / "empty.txt").write_text("")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err
