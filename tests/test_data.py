from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainbook import data


def test_corpus_is_shipped_and_checked():
    text = data.load_corpus()
    assert len(text.encode("utf-8")) == 1_115_394
    assert text.startswith("First Citizen:")
    with pytest.raises(ValueError, match="unknown corpus 'wiki'"):
        data.load_corpus("wiki")


@settings(max_examples=50, deadline=None)
@given(st.text(max_size=200))
def test_byte_tokenizer_round_trips(text):
    tok = data.ByteTokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text


def test_bpe_trains_round_trips_and_compresses(cache_dir, tmp_path):
    tok = data.make_tokenizer("bpe", 512, cache_dir=cache_dir)
    assert tok.vocab_size == 512
    sample = data.load_corpus()[:5000]
    ids = tok.encode(sample)
    assert tok.decode(ids) == sample
    assert len(ids) < len(sample.encode()) / 1.5  # merges compress English text
    again = data.make_tokenizer("bpe", 512, cache_dir=cache_dir)  # from the cache file
    assert again.encode(sample) == ids
    tok.save(tmp_path / "t.json")
    assert data.BPETokenizer.from_file(tmp_path / "t.json").encode(sample) == ids


def test_tokenizer_errors():
    with pytest.raises(ValueError, match="unknown tokenizer 'sentencepiece'"):
        data.make_tokenizer("sentencepiece")
    with pytest.raises(ValueError, match="vocab_size must be in"):
        data.BPETokenizer.train("abc", 100)


def test_own_text_file_and_tokenizer_file(cache_dir, tmp_path):
    """A corpus may be a UTF-8 file and a tokenizer a tokenizers JSON file: the path a reader
    takes to train on their own data (and the lifecycle chapter takes between stages)."""
    text = data.load_corpus()[:20_000]
    own = tmp_path / "own.txt"
    own.write_text(text, encoding="utf-8")
    assert data.load_corpus(str(own)) == text
    tok = data.make_tokenizer("bpe", 300, corpus=str(own), cache_dir=cache_dir)
    cached = list(Path(cache_dir).glob("bpe-own-*-300.json"))
    assert len(cached) == 1  # keyed by the file's content, not a path with slashes
    tok.save(tmp_path / "tok.json")
    again = data.make_tokenizer(str(tmp_path / "tok.json"))
    assert again.vocab_size == 300 and again.encode(text[:500]) == tok.encode(text[:500])
    ds = data.build_dataset(again, 16, str(own))
    assert ds.train.shape[1] == 17 and len(ds.val) > 0


def test_own_files_bad_input(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not UTF-8 text"):
        data.load_corpus(str(tmp_path / "latin1.txt"))
    with pytest.raises(ValueError, match="is empty"):
        data.load_corpus(str(tmp_path / "empty.txt"))
    with pytest.raises(ValueError, match="path of a UTF-8 text file"):
        data.load_corpus(str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match="cannot read .* as a tokenizers JSON"):
        data.make_tokenizer(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="unknown tokenizer"):
        data.make_tokenizer(str(tmp_path / "missing.json"))


def test_pack_shifts_targets_by_one_and_covers_every_token_once():
    tokens = torch.arange(23)
    blocks = data.pack(tokens, 5)
    assert blocks.shape == (4, 6)
    x, y = blocks[:, :-1], blocks[:, 1:]
    torch.testing.assert_close(y, x + 1)
    assert y.flatten().tolist() == list(range(1, 21))  # each token is a target exactly once
    with pytest.raises(ValueError, match="too few"):
        data.pack(torch.arange(3), 5)
    with pytest.raises(ValueError, match="seq_len must be >= 1"):
        data.pack(tokens, 0)


def test_dataset_split():
    ds = data.build_dataset(data.ByteTokenizer(), 64)
    assert ds.train.shape[1] == 65 and ds.val.shape[1] == 65
    assert 8 < len(ds.train) / len(ds.val) < 10  # 90/10 split of the text


def blocks(n=40, t=4):
    return torch.arange(n * (t + 1)).view(n, t + 1)


def test_loader_is_deterministic_and_epochs_differ():
    a = data.ShardedLoader(blocks(), 4, seed=1)
    b = data.ShardedLoader(blocks(), 4, seed=1)
    first = [a.next_batch()[0] for _ in range(10)]
    for x in first:
        torch.testing.assert_close(x, b.next_batch()[0])
    assert a.epoch == 0 and a.steps_per_epoch == 10
    nxt = a.next_batch()[0]
    assert a.epoch == 1
    seen = torch.cat([x[:, 0] for x in first]).sort().values
    assert torch.equal(seen, blocks()[:, 0])  # one epoch visits every block once
    assert not torch.equal(nxt, first[0])


@pytest.mark.parametrize("world", [2, 4])
def test_shards_union_is_the_single_process_batch(world):
    single = data.ShardedLoader(blocks(), 2 * world, seed=3)
    ranks = [data.ShardedLoader(blocks(), 2, r, world, seed=3) for r in range(world)]
    for _ in range(7):
        full = single.next_batch()[0]
        torch.testing.assert_close(torch.cat([r.next_batch()[0] for r in ranks]), full)


def test_loader_resumes_exactly():
    a = data.ShardedLoader(blocks(), 4, seed=2)
    for _ in range(13):
        a.next_batch()
    b = data.ShardedLoader(blocks(), 4, seed=2)
    b.load_state_dict(a.state_dict())
    for _ in range(12):
        torch.testing.assert_close(a.next_batch()[1], b.next_batch()[1])


def test_loader_errors():
    with pytest.raises(ValueError, match="rank 2 is outside world size 2"):
        data.ShardedLoader(blocks(), 2, rank=2, world_size=2)
    with pytest.raises(ValueError, match="needs more than the 40 blocks"):
        data.ShardedLoader(blocks(), 32, world_size=2)
    a = data.ShardedLoader(blocks(), 4, seed=2)
    with pytest.raises(ValueError, match="saved with batch_size=4"):
        data.ShardedLoader(blocks(), 2, seed=2).load_state_dict(a.state_dict())
