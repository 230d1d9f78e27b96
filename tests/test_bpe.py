"""Byte-level BPE from scratch (trainbook.pretrain.bpe) against Hugging Face tokenizers, and the
`tokenizer` command."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainbook.__main__ import main
from trainbook.data import load_corpus
from trainbook.pretrain import bpe

TEXT = load_corpus()[:20_000]  # small: the whole file trains in well under a second
HELD = load_corpus()[20_000:30_000]


@pytest.fixture(scope="module")
def small():
    seqs = TEXT.splitlines(keepends=True)
    return bpe.train_bpe(seqs, 400, ["<|endoftext|>"]), bpe.train_hf(seqs, 400, ["<|endoftext|>"])


def test_gpt2_pretokenisation_matches_tokenizers_byte_level():
    from tokenizers import pre_tokenizers

    text = "Hello world, it's 2024!\n\n  ok"
    # a run of spaces leaves its last space to the next word
    assert bpe.pretokenize(text) == ["Hello", " world", ",", " it", "'s", " 2024", "!",
                                     "\n\n ", " ok"]
    b2u = bpe.bytes_to_unicode()
    native = pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(HELD)
    assert ["".join(b2u[b] for b in w.encode()) for w in bpe.pretokenize(HELD)] == \
        [w for w, _ in native]
    assert "".join(bpe.pretokenize(HELD)) == HELD  # a partition of the text: nothing lost


def test_bytes_to_unicode_is_gpt2s_map():
    m = bpe.bytes_to_unicode()
    assert len(set(m.values())) == 256
    assert m[ord(" ")] == "Ġ" and m[ord("\n")] == "Ċ" and m[ord("A")] == "A"


def test_same_vocabulary_merges_and_ids_as_tokenizers(small):
    ours, hf = small
    c = bpe.compare(ours, hf, HELD + "<|endoftext|>" + HELD[:100])
    assert c["same_vocab"] and c["same_merges"] and c["same_ids"], c
    assert ours.vocab_size == hf.get_vocab_size() == 400
    assert ours.vocab()["<|endoftext|>"] == 0  # special tokens first


@pytest.mark.parametrize("min_frequency", [0, 5])
def test_min_frequency_stops_both_at_the_same_merge(min_frequency):
    seqs = TEXT[:5000].splitlines(keepends=True)
    ours = bpe.train_bpe(seqs, 10_000, min_frequency=min_frequency)
    hf = bpe.train_hf(seqs, 10_000, min_frequency=min_frequency)
    c = bpe.compare(ours, hf)
    assert c["same_vocab"] and c["same_merges"]
    assert ours.vocab_size < 10_000  # the pairs ran out before the vocabulary filled


def test_tie_break_order_is_what_makes_them_agree():
    seqs = TEXT.splitlines(keepends=True)
    hf = bpe.train_hf(seqs, 400)
    by_bytes = bpe.compare(bpe.train_bpe(seqs, 400, tie_break="bytes"), hf)
    assert not by_bytes["same_merges"] and by_bytes["first_different_merge"] > 0


def test_a_smaller_vocabulary_is_a_prefix_of_the_merges():
    seqs = TEXT.splitlines(keepends=True)
    big = bpe.train_bpe(seqs, 600, ["<s>"])
    for v in (257, 300, 450):
        small = big.truncate(v)
        assert small.merges == bpe.train_bpe(seqs, v, ["<s>"]).merges
        assert small.vocab_size == v
    with pytest.raises(ValueError, match="to truncate"):
        big.truncate(700)


def test_round_trip_through_tokenizers_json(small, tmp_path):
    ours, _ = small
    ours.save(tmp_path / "t.json")
    back = bpe.BPE.from_file(tmp_path / "t.json")
    assert back.encode(HELD) == ours.encode(HELD)
    assert back.merges == ours.merges and back.special == ours.special


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=80))
def test_decode_encode_is_identity_on_any_text(text):
    tok = _TOK
    assert tok.decode(tok.encode(text)) == text


_TOK = bpe.train_bpe(TEXT[:3000].splitlines(keepends=True), 300, ["<|endoftext|>"])


def test_special_tokens_are_never_split():
    ids = _TOK.encode("a<|endoftext|>b")
    assert ids.count(0) == 1 and _TOK.decode(ids) == "a<|endoftext|>b"


def test_bytes_per_token_grows_with_the_vocabulary():
    seqs = TEXT.splitlines(keepends=True)
    bpt = [bpe.bytes_per_token(bpe.train_bpe(seqs, v).encode, HELD) for v in (256, 300, 500)]
    assert bpt[0] == 1.0 and bpt[0] < bpt[1] < bpt[2]


def test_bad_input():
    with pytest.raises(ValueError, match="beyond any real vocabulary"):
        bpe.train_hf(["abc"], 10**30)
    with pytest.raises(ValueError, match="below the 256 byte tokens"):
        bpe.train_bpe(["abc"], 100)
    with pytest.raises(ValueError, match="min_frequency must be >= 0"):
        bpe.train_bpe(["abc"], 300, min_frequency=-1)
    with pytest.raises(ValueError, match="distinct and non-empty"):
        bpe.train_bpe(["abc"], 300, ["<s>", "<s>"])
    with pytest.raises(ValueError, match="not a single str"):
        bpe.train_bpe("abc", 300)
    with pytest.raises(ValueError, match="tie_break"):
        bpe.train_bpe(["abc"], 300, tie_break="random")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        _TOK.decode([10_000])
    with pytest.raises(ValueError, match="non-empty text"):
        bpe.bytes_per_token(_TOK.encode, "")
    with pytest.raises(ValueError, match="no tokenizer file"):
        bpe.BPE.from_file("missing.json")


# -- the command ---------------------------------------------------------------------------------

def test_command_train_encode_stats_compare(tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text(TEXT)
    out = tmp_path / "tok.json"
    assert main(["tokenizer", "train", "--vocab-size", "300", "--input", str(src), "--out",
                 str(out), "--json"]) == 0
    trained = json.loads(capsys.readouterr().out)
    assert trained["vocab_size"] == 300 and out.is_file()
    assert main(["tokenizer", "encode", "--tokenizer", str(out), "--text", "To be", "--json"]) \
        == 0
    enc = json.loads(capsys.readouterr().out)
    assert bpe.BPE.from_file(out).decode(enc["ids"]) == "To be"
    assert main(["tokenizer", "stats", "--tokenizer", str(out), "--input", str(src),
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["bytes_per_token"] > 1
    assert main(["tokenizer", "compare", "--vocab-size", "300", "--input", str(src),
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["same_merges"]


@pytest.mark.parametrize("argv, message", [
    (["tokenizer", "bogus"], "unknown action 'bogus'"),
    (["tokenizer", "train", "--out", "x.json"], "needs --vocab-size"),
    (["tokenizer", "train", "--vocab-size", "100", "--out", "x.json"], "below the 256"),
    (["tokenizer", "train", "--vocab-size", "300", "--input", "missing.txt", "--out", "x.json"],
     "no file at missing.txt"),
    (["tokenizer", "encode", "--tokenizer", "missing.json", "--text", "x"], "no tokenizer at"),
    (["tokenizer", "encode", "--tokenizer", "a.json"], "needs one of --text or --input"),
    (["tokenizer", "stats"], "needs --tokenizer"),
])
def test_command_bad_input(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err
    assert not (tmp_path / "x.json").exists()


def test_command_rejects_a_file_that_is_not_a_tokenizer(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    assert main(["tokenizer", "stats", "--tokenizer", str(bad)]) == 2
    assert "is not a tokenizer.json" in capsys.readouterr().err
