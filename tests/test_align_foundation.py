"""Part 7's foundation: the chat tokenizer against transformers' chat template, the task's splits
and verifier, the policy's log-probabilities and sampling, the SFT loss, the base model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from trainbook import configs
from trainbook.align import base, policy, sft, task
from trainbook.model import Transformer

TOK = task.chat_tokenizer()


def tiny_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    cfg = configs.get("tiny-llama").with_(vocab_size=task.VOCAB_SIZE, d_model=32, n_layers=1,
                                         n_heads=2, n_kv_heads=2, d_ff=64, max_seq_len=32)
    return Transformer(cfg).eval()


def test_special_tokens_come_first_and_every_byte_is_one_token():
    assert [TOK.hf.token_to_id(s) for s in task.SPECIAL] == list(range(5))
    assert TOK.vocab_size == 261
    text = "07+58=65 é\n"
    assert len(TOK.encode(text)) == len(text.encode()) and TOK.decode(TOK.encode(text)) == text
    # tokenizers' default: a special token's string in user text IS the special token
    assert TOK.encode("a<|eos|>") == [TOK.encode("a")[0], task.EOS]


def test_chat_ids_equal_transformers_chat_template(tmp_path):
    from transformers import AutoTokenizer

    TOK.save_pretrained(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (task.BOS, task.EOS, task.PAD)
    messages = [{"role": "user", "content": "07+58"}, {"role": "assistant", "content": "65"}]
    ids, mask = TOK.chat_ids("07+58", "65")
    assert hf.apply_chat_template(messages, tokenize=True)["input_ids"] == ids
    prompt = hf.apply_chat_template(messages[:1], tokenize=True, add_generation_prompt=True)
    assert prompt["input_ids"] == TOK.prompt_ids("07+58")
    assert mask == [0] * len(TOK.prompt_ids("07+58")) + [1, 1, 1]
    assert task.ChatTokenizer.from_pretrained(tmp_path).encode("12") == TOK.encode("12")


def test_train_and_test_never_share_an_item():
    train = set(task.all_problems(2, "train"))
    test = set(task.all_problems(2, "test"))
    assert not train & test and len(train) + len(test) == 100 * 100
    assert 0.07 < len(test) / 10_000 < 0.13
    assert set(task.make_problems(200, 2, seed=1, split="test")) <= test
    assert task.make_problems(50, 3, seed=4) == task.make_problems(50, 3, seed=4)


@given(st.integers(0, 999), st.integers(0, 999))
@settings(max_examples=50, deadline=None)
def test_verify_accepts_the_sum_only(a, b):
    p = task.problem(a, b, 3)
    assert len(p.prompt) == 7 and task.verify(p, f" {a + b} ") == 1.0
    assert task.verify(p, str(a + b + 1)) == 0.0 and task.verify(p, "") == 0.0


def test_pretraining_text_is_raw_lines_of_training_items():
    lines = task.pretraining_text(20, 2, seed=3).splitlines()
    assert len(lines) == 20
    for line in lines:
        prompt, answer = line.split("=")
        a, b = map(int, prompt.split("+"))
        assert int(answer) == a + b and task.split_of(a, b) == "train"


def test_token_logprobs_equal_log_softmax_of_the_logits():
    model = tiny_model()
    ids, mask = policy.pad([TOK.chat_ids("07+58", "65")[0], TOK.chat_ids("1+2", "3")[0]])
    logits, _ = model(ids)
    want = torch.log_softmax(logits[:, :-1].float(), -1).gather(2, ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(policy.token_logprobs(model, ids), want)
    seq = policy.sequence_logprobs(model, ids, mask)
    torch.testing.assert_close(seq, (want * mask[:, 1:]).sum(-1))


def test_right_padding_does_not_change_a_sequences_logprobs():
    model = tiny_model()
    ids, mask = TOK.chat_ids("07+58", "65")
    alone = policy.sequence_logprobs(model, *policy.pad([ids], [mask]))
    padded = policy.sequence_logprobs(model, *policy.pad([ids, ids + [70] * 5],
                                                         [mask, mask + [0] * 5]))
    torch.testing.assert_close(padded[0], alone[0])


def test_sampling_is_seeded_stops_at_eos_and_greedy_is_argmax():
    model = tiny_model(1)
    prompts = task.encode_prompts(TOK, task.make_problems(6, 2))
    g = lambda: torch.Generator().manual_seed(7)  # noqa: E731
    a = policy.sample(model, TOK, prompts, 5, generator=g())
    b = policy.sample(model, TOK, prompts, 5, generator=g())
    assert a.completions == b.completions
    for c in a.completions:
        assert len(c) <= 5 and (task.EOS not in c or c.index(task.EOS) == len(c) - 1)
    greedy = policy.sample(model, TOK, prompts[:1], 3, greedy=True)
    ids = torch.tensor([prompts[0]])
    for t in greedy.completions[0]:
        assert t == int(model(ids)[0][0, -1].argmax())
        ids = torch.cat([ids, torch.tensor([[t]])], 1)
    seqs, mask = a.sequences()
    assert mask.sum().item() == sum(len(c) for c in a.completions)


def test_sft_loss_is_the_token_mean_over_assistant_tokens():
    model = tiny_model()
    ex = sft.examples(TOK, task.make_problems(4, 2))
    ids, mask = policy.pad([e[0] for e in ex], [e[1] for e in ex])
    loss = sft.masked_lm_loss(model, ids, mask)
    logits = model(ids)[0][:, :-1]
    nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    want = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()
    torch.testing.assert_close(loss, want)


def test_sft_learns_the_chat_format_on_a_tiny_model():
    model = tiny_model()
    items = task.make_problems(64, 1, seed=2)
    losses = sft.sft(model, TOK, items, sft.SFTConfig(steps=60, batch_size=16, lr=3e-3))
    assert losses[-1] < 0.5 * losses[0]


def test_bad_input_is_rejected_with_a_clear_message():
    model = tiny_model()
    with pytest.raises(ValueError, match="split must be"):
        task.make_problems(3, split="dev")
    with pytest.raises(ValueError, match="n must be"):
        task.make_problems(0)
    with pytest.raises(ValueError, match="digits"):
        task.make_problems(3, digits=9)
    with pytest.raises(ValueError, match="use digits <= 3"):
        task.all_problems(4, "test")
    with pytest.raises(ValueError, match="not a chat tokenizer"):
        from tokenizers import Tokenizer, models
        task.ChatTokenizer(Tokenizer(models.BPE()))
    with pytest.raises(ValueError, match="max_new_tokens"):
        policy.sample(model, TOK, [[1, 3]], 0)
    with pytest.raises(ValueError, match="temperature"):
        policy.sample(model, TOK, [[1, 3]], 2, temperature=0.0)
    with pytest.raises(ValueError, match="no empty sequence"):
        policy.pad([[1], []])
    with pytest.raises(ValueError, match="time >= 2"):
        policy.token_logprobs(model, torch.tensor([[1]]))
    with pytest.raises(ValueError, match="selects no token"):
        sft.masked_lm_loss(model, torch.tensor([[1, 2, 3]]), torch.tensor([[1, 0, 0]]))
    with pytest.raises(ValueError, match="SFTConfig.lr must be a positive number"):
        sft.SFTConfig(lr=0.0)
    with pytest.raises(ValueError, match="BaseRecipe.steps must be a positive whole number"):
        base.BaseRecipe(steps=0)
    with pytest.raises(ValueError, match="recipe must be a BaseRecipe"):
        base.pretrain({"steps": 3})
    with pytest.raises(ValueError, match="no items"):
        policy.accuracy(model, TOK, [])


def test_shipped_base_model_matches_its_record():
    """The weights in the package are the ones the record describes (SHA-256), and they score
    what the record says on the same test items: base.write_shipped wrote both."""
    rec = base.shipped_record()
    assert rec["recipe"] == base.dataclasses.asdict(base.BaseRecipe())
    model = base.base_model()
    assert sum(p.numel() for p in model.parameters()) == rec["parameters"]
    test = task.make_problems(base.EVAL_ITEMS, rec["recipe"]["digits"], 0, "test")
    assert base.raw_accuracy(model, TOK, test) == pytest.approx(rec["raw_accuracy"], abs=0.005)
    assert policy.accuracy(model, TOK, test) == pytest.approx(rec["chat_accuracy"], abs=0.005)
    assert rec["raw_accuracy"] > 0.3 and rec["chat_accuracy"] < 0.05  # knows sums, not chat


def test_a_corrupted_shipped_file_is_refused(tmp_path):
    import shutil

    for f in ("base.safetensors", "base.json"):
        shutil.copy(base.WEIGHTS / f, tmp_path / f)
    data = bytearray((tmp_path / "base.safetensors").read_bytes())
    data[-1] ^= 1
    (tmp_path / "base.safetensors").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="does not match the SHA-256"):
        base.load_shipped(tmp_path)
    with pytest.raises(ValueError, match="write one with base.write_shipped"):
        base.shipped_record(tmp_path / "nowhere")


def test_the_recipe_pretrains_with_the_books_trainer():
    short = base.BaseRecipe(steps=30, lines=2000, d_model=32, n_layers=1, n_heads=2, d_ff=64)
    result = base.pretrain(short)
    losses = result.losses()
    assert len(losses) == 30 and losses[-1] < 0.75 * losses[0]
    assert result.model.cfg.vocab_size == task.VOCAB_SIZE
