"""Heuristic quality filters (trainbook.pretrain.quality): each rule on a document made to break
it, and on clean text."""

import pytest

from trainbook.pretrain import quality as Q

DOCS = Q.speeches()
CLEAN = ("It was the best of times, it was the worst of times, it was the age of wisdom, it "
         "was the age of foolishness, it was the epoch of belief, it was the epoch of "
         "incredulity. We had everything before us, we had nothing before us, we were all going "
         "direct to Heaven, we were all going direct the other way. In short, the period was so "
         "far like the present period that some of its noisiest authorities insisted on its "
         "being received, for good or for evil, in the superlative degree of comparison only.")


def test_speeches_are_the_corpus_documents():
    assert len(DOCS) > 7000
    assert all(d.splitlines()[0].endswith(":") and "\n" in d for d in DOCS)
    assert DOCS[0].startswith("First Citizen:\nBefore we proceed")


def test_clean_prose_passes_and_its_repetition_does_not():
    assert not any(Q.gopher_quality(CLEAN).values())
    assert not any(Q.c4_clean(CLEAN)[1].values())
    # Dickens's anaphora ("it was the age of", "we were all going direct") repeats enough 5-grams
    # (over 15% of the characters) for Gopher's rule: a false positive of the repetition rules
    assert [k for k, v in Q.gopher_repetition(CLEAN).items() if v] == ["duplicate 5-grams"]
    assert Q.gopher_repetition(CLEAN + " " + CLEAN)["duplicate 10-grams"]


@pytest.mark.parametrize("text, rule", [
    ("word " * 10, "gopher: word count"),
    ("a b c d e f " * 20 + "the and", "gopher: mean word length"),
    ("the and " + "#tag " * 60, "gopher: hash ratio"),
    ("\n".join(["the and of it was ..."] * 3 + ["the end of that story here."] * 2) * 6,
     "gopher: ellipsis lines"),
    ("\n".join("\u2022 item with the and of" for _ in range(20)), "gopher: bullet lines"),
    ("the and " + " ".join(str(i) for i in range(80)), "gopher: alphabetic words"),
    (" ".join(f"word{i}" for i in range(80)), "gopher: stop words"),
])
def test_each_gopher_rule_catches_its_case(text, rule):
    assert Q.rules(text)[rule]


def test_repetition_rules():
    lines = "\n".join(["the same line over and over again"] * 10 + ["and one more that differs"])
    r = Q.gopher_repetition(lines)
    assert r["duplicate lines"] and r["duplicate line chars"] and r["duplicate 10-grams"]
    assert Q.dup_ngram_char_fraction("a b c d e".split(), 5) == 0
    assert Q.dup_ngram_char_fraction("x y x y".split(), 2) == 0.5  # the second "x y" repeats
    assert Q.top_ngram_char_fraction("ab cd ab cd ef".split(), 2) == pytest.approx(8 / 10)


def test_c4_keeps_only_terminated_lines_of_five_words():
    text = "This line ends with a period.\nthis one has no end\nShort one.\n" \
           "Another complete sentence is here! And a third one here is fine?"
    kept, flags = Q.c4_clean(text)
    assert kept.splitlines() == ["This line ends with a period.",
                                 "Another complete sentence is here! And a third one here is fine?"]
    assert not any(flags.values())
    assert Q.c4_clean("x {\n" + text)[1]["curly bracket"]
    assert Q.c4_clean("Lorem ipsum dolor. " + text)[1]["lorem ipsum"]
    assert Q.c4_clean("Enable JavaScript in your browser to see this page now.")[0] == ""


def test_planted_junk_is_caught_by_its_rule_and_shakespeare_is_not():
    junk = Q.junk_documents(DOCS, 5)
    target = {"keyword list": "gopher: stop words", "hashtags": "gopher: hash ratio",
              "ellipsis teasers": "gopher: ellipsis lines", "bullet menu": "gopher: bullet lines",
              "boilerplate": "repetition: duplicate lines",
              "numbers table": "gopher: alphabetic words", "code": "c4: curly bracket",
              "lorem ipsum": "c4: lorem ipsum"}
    assert set(junk) == set(Q.JUNK_KINDS) == set(target)
    for kind, docs in junk.items():
        assert all(Q.rules(d)[target[kind]] for d in docs), kind
        assert all(len(d.split()) >= 50 for d in docs), kind
    long_speeches = [d for d in DOCS if len(d.split()) >= 50][:200]
    for rule in set(target.values()):
        assert not any(Q.rules(d)[rule] for d in long_speeches), rule


def test_bad_input():
    with pytest.raises(ValueError, match="per_kind must be >= 1"):
        Q.junk_documents(DOCS, 0)
    with pytest.raises(ValueError, match="needs documents"):
        Q.junk_documents(["A:\nhi"], 3)
