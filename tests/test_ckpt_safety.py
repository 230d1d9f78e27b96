"""Nothing lost, nothing silent (issue 26): a checkpoint is trusted only after every file of it
is verified; a run owns its checkpoint folder, so a new run cannot overwrite or prune another
run's checkpoints; every run saves its last step; a checkpoint without checksums resumes only
when asked to. Each case here loaded, overwrote or lost data silently before the fix."""

import dataclasses

import pytest
import torch

from trainbook import launch
from trainbook.failures import checkpointing as C
from trainbook.failures import ckpt_tools as T
from trainbook.train import load_checkpoint, train
from trainbook.train.checkpoint import SUMS, CorruptCheckpoint, read_sums, verify_sharded
from trainbook.train.ownership import OWNER, read_owner


def tiny(folder, **kw):
    return C.tiny_config(steps=4, ckpt_dir=str(folder), ckpt_every=2, **kw)


def run(cfg):
    with launch.threads(1):
        return train(cfg)


def flip_bytes(path, n=4):
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + n] = bytes(b ^ 0xFF for b in data[middle:middle + n])
    path.write_bytes(bytes(data))


def test_a_corrupt_shard_is_refused_before_anything_loads(tmp_path):
    run(tiny(tmp_path / "a"))
    dcp = T.to_dcp(tmp_path / "a" / "step-000004.pt", tmp_path / "dcp" / "step-000004")
    verify_sharded(dcp)  # intact: passes
    [shard] = sorted(dcp.glob("*.distcp"))
    flip_bytes(shard)
    with pytest.raises(CorruptCheckpoint, match=f"{shard.name}: sha256"):
        verify_sharded(dcp)
    with pytest.raises(CorruptCheckpoint, match="is corrupt"):  # the trainer's resume
        run(dataclasses.replace(tiny(tmp_path / "b"), resume_from=str(dcp), steps=6))


def corrupt_and_resume(folder: str) -> str:
    """On 2 FSDP ranks: train with DCP checkpoints, flip bytes in one shard (rank 0), resume;
    the error every rank raises."""
    import torch.distributed as dist

    from trainbook.train import latest_checkpoint

    cfg = C.tiny_config(steps=2, ckpt_dir=folder, ckpt_every=2, dp_shard=2, batch_size=2)
    with launch.threads(1):
        train(cfg)
    dist.barrier()
    if dist.get_rank() == 0:
        flip_bytes(sorted(latest_checkpoint(folder).glob("__1_*.distcp"))[0])
    dist.barrier()
    try:
        with launch.threads(1):
            train(dataclasses.replace(cfg, steps=4, resume=True))
    except CorruptCheckpoint as e:
        return str(e)
    return "resumed"


def test_a_corrupt_shard_is_refused_on_every_rank_under_fsdp(tmp_path):
    """Rank 1's shard is hashed by one rank only; both learn of it and both refuse."""
    res = launch.run(corrupt_and_resume, 2, args=(str(tmp_path),), timeout_s=240)
    for r in res:
        assert "is corrupt" in r.value and "__1_0.distcp" in r.value, r.value


def test_a_new_run_cannot_overwrite_or_prune_another_runs_checkpoints(tmp_path):
    old = run(dataclasses.replace(tiny(tmp_path), steps=6))
    before = sorted(p.name for p in tmp_path.glob("step-*"))
    assert before == ["step-000002.pt", "step-000004.pt", "step-000006.pt"]
    assert read_owner(tmp_path)["identity"]["seed"] == 0
    new = dataclasses.replace(tiny(tmp_path), seed=1, keep_last=1)
    with pytest.raises(ValueError, match=r"holds 3 checkpoint\(s\) of another run .*--overwrite"):
        run(new)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == before  # untouched
    assert load_checkpoint(tmp_path / "step-000006.pt")["history"] == old.history
    run(dataclasses.replace(new, overwrite=True))  # told to: it takes the folder over
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000004.pt"]
    assert load_checkpoint(tmp_path / "step-000004.pt")["train_config"]["seed"] == 1
    assert list(read_sums(tmp_path)) == ["step-000004.pt"]
    assert read_owner(tmp_path)["identity"]["seed"] == 1
    with pytest.raises(ValueError, match="pass one of them"):
        dataclasses.replace(new, overwrite=True, resume=True)


def test_an_overwriting_run_that_dies_before_its_first_checkpoint_destroys_nothing(tmp_path):
    run(tiny(tmp_path))
    before = {p.name: p.read_bytes() for p in tmp_path.glob("step-*")}

    class Boom(Exception):
        pass

    from trainbook.train.hooks import Hook

    class DieAtStep1(Hook):
        def before_update(self, ctx):
            raise Boom

    with pytest.raises(Boom), launch.threads(1):
        train(dataclasses.replace(tiny(tmp_path), overwrite=True), hooks=[DieAtStep1()])
    assert {p.name: p.read_bytes() for p in tmp_path.glob("step-*")} == before


def test_every_run_saves_its_last_step(tmp_path):
    run(dataclasses.replace(tiny(tmp_path), steps=5))
    assert sorted(p.name for p in tmp_path.glob("step-*")) == \
        ["step-000002.pt", "step-000004.pt", "step-000005.pt"]
    assert load_checkpoint(tmp_path / "step-000005.pt")["step"] == 5


def test_a_checkpoint_without_checksums_resumes_only_when_allowed(tmp_path, capsys):
    run(tiny(tmp_path))
    (tmp_path / SUMS).unlink()  # copied elsewhere without it
    resume = dataclasses.replace(tiny(tmp_path), steps=6, resume=True)
    with pytest.raises(CorruptCheckpoint, match="no recorded checksum.*--allow-unverified"):
        run(resume)
    path = tmp_path / "step-000004.pt"
    state = torch.load(path, weights_only=True)
    state["model"] = {k: torch.zeros_like(v) for k, v in state["model"].items()}
    torch.save(state, path)  # the damage nothing could detect
    with pytest.raises(CorruptCheckpoint, match="no recorded checksum"):
        run(dataclasses.replace(resume, resume=False, resume_from=str(path),
                                ckpt_dir=str(tmp_path / "elsewhere")))
    capsys.readouterr()
    result = run(dataclasses.replace(resume, allow_unverified=True))
    assert len(result.history) == 6
    assert "warning: checkpoint" in capsys.readouterr().err  # loaded, and said so


def test_resume_on_a_folder_without_checkpoints_says_so(tmp_path, capsys):
    run(dataclasses.replace(tiny(tmp_path / "empty"), resume=True, steps=2))
    assert "no checkpoint in" in capsys.readouterr().out
    assert (tmp_path / "empty" / OWNER).is_file()


def test_resume_compares_the_corpus_by_content_not_by_its_path(tmp_path, monkeypatch):
    from trainbook.data import load_corpus

    corpus = tmp_path / "data" / "corpus.txt"
    corpus.parent.mkdir()
    corpus.write_text(load_corpus("tinyshakespeare")[:50_000])
    run(tiny(tmp_path / "ckpt", corpus=str(corpus)))
    monkeypatch.chdir(tmp_path / "data")  # the same file, named from another folder
    resumed = run(dataclasses.replace(tiny(tmp_path / "ckpt", corpus="corpus.txt"), steps=6,
                                      resume=True))
    assert len(resumed.history) == 6
    corpus.write_text(load_corpus("tinyshakespeare")[50_000:100_000])  # same name, other bytes
    with pytest.raises(ValueError, match="the training data differs"):
        run(dataclasses.replace(tiny(tmp_path / "ckpt", corpus="corpus.txt"), steps=8,
                                resume=True))


def test_a_tokenizer_that_knows_almost_none_of_the_corpus_is_refused(tmp_path):
    """A WordLevel vocabulary of 50 words maps most of Shakespeare to [UNK]: the loss falls to
    nearly zero by predicting [UNK], a run that "trains well" and learns nothing."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from trainbook.data import BPETokenizer, build_dataset, load_corpus

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([load_corpus()[:2000]],
                            trainers.WordLevelTrainer(vocab_size=50, special_tokens=["[UNK]"]))
    path = tmp_path / "wordlevel.json"
    tok.save(str(path))
    with pytest.raises(ValueError, match=r"maps \d+\.\d% of the corpus's tokens to its unknown "
                                         r"token '\[UNK\]'"):
        build_dataset(BPETokenizer.from_file(path), 32)
    with pytest.raises(ValueError, match="unknown token"):
        run(C.tiny_config(steps=2, tokenizer=str(path)))
    assert BPETokenizer.train(load_corpus()[:20000], 300).unk is None  # byte-level: never
