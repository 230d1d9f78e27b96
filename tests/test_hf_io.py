"""The reference model to a Hugging Face folder and back (trainbook.align.hf_io, the export-hf and
import-hf commands): transformers loads the export with the same logits, each architecture that
transformers builds from a config imports with the same logits, and what the reference model
cannot compute is refused with the reason. Nothing is downloaded: every model is built from a
config here, tiny, with random or briefly trained weights."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from trainbook import configs
from trainbook.__main__ import main
from trainbook.align import base, hf_io, hf_tokenizer, policy, task
from trainbook.data import ByteTokenizer
from trainbook.model import Transformer
from trainbook.train import TrainConfig, train

tf = pytest.importorskip("transformers")
TOL = 1e-5  # fp32 logits: the bar the issue sets
COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def ids(vocab: int, t: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, t), generator=torch.Generator().manual_seed(seed))


def saved(tmp_path, config, cls, name="m", **save_kw):
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():  # random (not zero) biases and norms, so a dropped tensor shows
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n or "ln_" in n:
                p.normal_(0.0, 0.3)
    folder = tmp_path / name
    model.save_pretrained(folder, **save_kw)
    return model, folder


def gap(ours: torch.nn.Module, theirs: torch.nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        return (policy.logits_of(ours, x) - policy.logits_of(theirs, x)).abs().max().item()


ARCHS = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM,
              dict(rope_parameters={"rope_type": "default", "rope_theta": 5000.0})),
    "llama-tied": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(tie_word_embeddings=True)),
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, dict(sliding_window=None)),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(head_dim=16)),
}


@pytest.mark.parametrize("arch", [*ARCHS, "gpt2"])
def test_each_architecture_imports_with_the_same_logits(arch, tmp_path):
    if arch == "gpt2":
        config = tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                               bos_token_id=0, eos_token_id=0)
        theirs, folder = saved(tmp_path, config, tf.GPT2LMHeadModel)
    else:
        cfg_cls, cls, extra = ARCHS[arch]
        theirs, folder = saved(tmp_path, cfg_cls(**COMMON, **extra), cls)
    ours = hf_io.import_hf(folder)
    assert gap(ours, theirs, ids(64)) < TOL
    assert ours.cfg.qkv_bias == (arch == "qwen2") and ours.cfg.qk_norm == (arch == "qwen3")
    if arch == "llama":
        assert ours.cfg.rope_theta == 5000.0  # v5 keeps theta inside rope_parameters


def test_a_sharded_checkpoint_imports(tmp_path):
    theirs, folder = saved(tmp_path, tf.LlamaConfig(**COMMON), tf.LlamaForCausalLM,
                           max_shard_size="20KB")
    assert (folder / hf_io.INDEX).is_file() and not (folder / hf_io.WEIGHTS).exists()
    assert gap(hf_io.import_hf(folder), theirs, ids(64)) < TOL


def test_a_bare_gpt2_model_without_prefix_imports(tmp_path):
    """The original GPT-2 checkpoints are GPT2Model (no `transformer.` prefix, no lm_head)."""
    config = tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=32)
    torch.manual_seed(0)
    lm = tf.GPT2LMHeadModel(config).eval()
    lm.transformer.save_pretrained(tmp_path / "bare")
    (tmp_path / "bare" / "config.json").write_text(json.dumps(
        {**json.loads((tmp_path / "bare" / "config.json").read_text()), "model_type": "gpt2"}))
    assert gap(hf_io.import_hf(tmp_path / "bare"), lm, ids(64)) < TOL


def test_a_sliding_window_caps_the_context_where_it_is_exact(tmp_path):
    theirs, folder = saved(tmp_path, tf.MistralConfig(**{**COMMON, "sliding_window": 8}),
                           tf.MistralForCausalLM)
    ours = hf_io.import_hf(folder)
    assert ours.cfg.max_seq_len == 8
    assert gap(ours, theirs, ids(64, t=8)) < TOL
    with pytest.raises(ValueError, match="exceeds max_seq_len 8"):
        ours(ids(64, t=9))


def tiny_llama(vocab: int, flavour: str = "tiny-llama") -> Transformer:
    torch.manual_seed(0)
    extra = dict(n_kv_heads=2) if flavour == "tiny-llama" else {}
    cfg = configs.get(flavour).with_(vocab_size=vocab, d_model=32, n_layers=2, n_heads=4,
                                     d_ff=128, max_seq_len=32, **extra)
    return Transformer(cfg).eval()


@pytest.mark.parametrize("flavour", ["tiny-llama", "tiny-gpt2"])
def test_export_loads_in_transformers_with_the_same_logits_and_back(flavour, tmp_path):
    model = tiny_llama(task.VOCAB_SIZE, flavour)
    files = {f.name for f in hf_io.export(model, tmp_path / "hf", task.chat_tokenizer())}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= files
    x = ids(task.VOCAB_SIZE, 16)
    assert hf_io.logit_gap(model, tmp_path / "hf", x) < TOL
    back = hf_io.import_hf(tmp_path / "hf")
    same = {"name": "", "tie_embeddings": None}  # None means the flavour's default
    assert back.cfg.to_dict() | same == model.cfg.to_dict() | same
    assert back.cfg.tied == model.cfg.tied
    for (n, a), (m, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert n == m and torch.equal(a, b)


def test_qwen2_biases_export_too(tmp_path):
    theirs, folder = saved(tmp_path, tf.Qwen2Config(**COMMON), tf.Qwen2ForCausalLM)
    ours = hf_io.import_hf(folder)
    hf_io.export(ours, tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["model_type"] == "qwen2"
    assert hf_io.logit_gap(ours, tmp_path / "again", ids(64)) < TOL


def test_the_base_model_generates_the_same_in_transformers(tmp_path):
    """The exported chat tokenizer and generation config: transformers' greedy generate from
    the raw prompt gives our greedy sample, and the chat template gives our prompt ids."""
    model, tok = base.base_model(), task.chat_tokenizer()
    hf_io.export(model, tmp_path / "base", tok)
    hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    hf_tok = tf.AutoTokenizer.from_pretrained(tmp_path / "base")
    assert hf.generation_config.eos_token_id == task.EOS
    prompt = tok.encode("\n07+58=")
    ours = policy.sample(model, tok, [prompt], 4, greedy=True, stop_id=tok.encode("\n")[0])
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=len(ours.completions[0]),
                      do_sample=False, eos_token_id=tok.encode("\n")[0], pad_token_id=task.PAD)
    assert out[0, len(prompt):].tolist() == ours.completions[0] and ours.texts[0] == "65\n"
    chat = hf_tok.apply_chat_template([{"role": "user", "content": "07+58"}], tokenize=True,
                                      add_generation_prompt=True)["input_ids"]
    assert chat == tok.prompt_ids("07+58")


BYTES_HF = hf_tokenizer.hf_tokenizer(ByteTokenizer())


@given(st.text(max_size=40))
@settings(max_examples=40, deadline=None)
def test_the_byte_tokenizer_exports_with_the_same_ids(text):
    hf = BYTES_HF
    assert hf.encode(text).ids == ByteTokenizer().encode(text)
    assert hf.decode(hf.encode(text).ids) == text


def test_the_tokenizer_a_checkpoint_records_comes_back(tmp_path):
    from trainbook.data import make_tokenizer

    corpus = tmp_path / "c.txt"
    corpus.write_text("to be, or not to be: that is the question\n" * 40)
    bpe = hf_tokenizer.tokenizer_of({"train_config": {"tokenizer": "bpe", "vocab_size": 300,
                                                      "corpus": str(corpus)}})
    text = "to be, or not: the question"
    assert bpe.encode(text) == make_tokenizer("bpe", 300, str(corpus)).encode(text)
    hf_tokenizer.save_tokenizer(bpe, tmp_path / "t")
    assert hf_tokenizer.load_tokenizer(tmp_path / "t").encode(text) == bpe.encode(text)
    auto = tf.AutoTokenizer.from_pretrained(tmp_path / "t")
    assert auto(text)["input_ids"] == bpe.encode(text)
    chat = hf_tokenizer.tokenizer_of({"tokenizer_json": task.chat_tokenizer().hf.to_str()})
    assert isinstance(chat, task.ChatTokenizer)
    assert isinstance(hf_tokenizer.tokenizer_of({}, "chat"), task.ChatTokenizer)
    assert hf_tokenizer.tokenizer_of({}) is None and hf_tokenizer.load_tokenizer(tmp_path) is None


def train_checkpoint(tmp_path, **kw) -> str:
    cfg = TrainConfig(model="tiny-llama", d_model=32, n_layers=1, n_heads=2, n_kv_heads=2,
                      d_ff=64, tokenizer="bytes", seq_len=32, batch_size=4, steps=3,
                      warmup_steps=1, log_every=0, eval_batches=1, progress=False,
                      ckpt_dir=str(tmp_path / "ckpt"), device="cpu", **kw)
    train(cfg)
    return str(tmp_path / "ckpt" / "step-000003.pt")


@pytest.mark.timeout(240)
def test_the_commands_round_trip_a_trained_checkpoint(tmp_path, capsys):
    """train (briefly) -> export-hf -> transformers, and import-hf -> the same weights ->
    export-hf again: the folders hold the same tensors."""
    from safetensors.torch import load_file

    from trainbook.failures.ckpt_tools import load_model

    ckpt = train_checkpoint(tmp_path)
    assert main(["export-hf", "--checkpoint", ckpt, "--out", str(tmp_path / "hf"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["max_logit_difference"] < TOL and out["tokenizer"] == "ByteTokenizer"
    hf_tok = tf.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tok("To be, or not")["input_ids"] == ByteTokenizer().encode("To be, or not")
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back.pt"),
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["max_logit_difference"] < TOL
    a, b = load_model(ckpt)[0], load_model(tmp_path / "back.pt")[0]
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                  b.state_dict().values()))
    assert main(["export-hf", "--checkpoint", str(tmp_path / "back.pt"), "--out",
                 str(tmp_path / "hf2"), "--no-check"]) == 0
    one, two = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("hf", "hf2"))
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    assert (tmp_path / "hf2" / "tokenizer.json").read_text() == \
        (tmp_path / "hf" / "tokenizer.json").read_text()


# ---------------------------------------------------------------------------------------------
# What cannot be represented, and bad input
# ---------------------------------------------------------------------------------------------

def llama_dict(**changes) -> dict:
    return {**tf.LlamaConfig(**COMMON).to_dict(), **changes}


@pytest.mark.parametrize("changes, match", [
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}), "llama3"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "yarn"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(attention_bias=True), "o_proj"),
    (dict(model_type="mixtral", num_local_experts=4), "mixture"),
    (dict(model_type="phi3"), "phi3"),
    (dict(partial_rotary_factor=0.5), "partial rotary"),
])
def test_what_the_reference_model_cannot_compute_is_refused(changes, match):
    with pytest.raises(ValueError, match=match):
        hf_io.import_config(llama_dict(**changes))


def test_gpt2_variants_that_differ_are_refused():
    g = tf.GPT2Config(n_embd=32, n_layer=1, n_head=4).to_dict()
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        hf_io.import_config({**g, "scale_attn_by_inverse_layer_idx": True})
    with pytest.raises(ValueError, match="relu"):
        hf_io.import_config({**g, "activation_function": "relu"})


def test_missing_extra_and_absent_weights_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    _, folder = saved(tmp_path, tf.LlamaConfig(**COMMON), tf.LlamaForCausalLM)
    sd = load_file(str(folder / hf_io.WEIGHTS))
    save_file({k: v for k, v in sd.items() if "layers.1.mlp.up" not in k},
              str(folder / hf_io.WEIGHTS))
    with pytest.raises(ValueError, match="lacks model.layers.1.mlp.up_proj.weight"):
        hf_io.import_hf(folder)
    save_file({**sd, "model.vision_tower.weight": torch.zeros(2)}, str(folder / hf_io.WEIGHTS))
    with pytest.raises(ValueError, match="vision_tower"):
        hf_io.import_hf(folder)
    (folder / hf_io.WEIGHTS).unlink()
    (folder / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="pytorch_model.bin.*save_pretrained"):
        hf_io.import_hf(folder)
    with pytest.raises(ValueError, match="no config.json"):
        hf_io.import_hf(tmp_path)
    with pytest.raises(ValueError, match="not a folder"):
        hf_io.import_hf(folder / "config.json")


def test_export_refuses_bad_input(tmp_path):
    model = tiny_llama(64)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("old")
    with pytest.raises(ValueError, match="not an empty folder"):
        hf_io.export(model, tmp_path / "full")
    with pytest.raises(ValueError, match="261 tokens but the model only 64"):
        hf_io.export(model, tmp_path / "new", task.chat_tokenizer())
    with pytest.raises(ValueError, match="reference Transformer"):
        hf_io.export(torch.nn.Linear(2, 2), tmp_path / "new")
    with pytest.raises(ValueError, match="cannot save a str"):
        hf_tokenizer.hf_tokenizer("bytes")
    with pytest.raises(ValueError, match="folder path"):
        hf_io.export(model, None)
    with pytest.raises(ValueError, match="not chat, bytes"):
        hf_tokenizer.tokenizer_of({}, "wordpiece")
    with pytest.raises(ValueError, match="not on this machine"):
        hf_tokenizer.tokenizer_of({"train_config": {"tokenizer": str(tmp_path / "gone.json")}})
    with pytest.raises(ValueError, match="ids must be"):
        hf_io.logit_gap(model, tmp_path, torch.zeros(3))


@pytest.mark.parametrize("argv, names", [
    (["export-hf", "--checkpoint", "missing.pt", "--out", "o"], "missing.pt"),
    (["export-hf", "--checkpoint", "c.pt", "--out", "o", "--tokenizer", "wordpiece"],
     "wordpiece"),
    (["export-hf", "--checkpoint", "c.pt", "--out", "full"], "full"),
    (["import-hf", "--out", "m.pt"], "FOLDER"),
    (["import-hf", "missing", "--out", "m.pt"], "missing"),
    (["import-hf", "cfg", "--out", "m.pt"], "llama3"),
    (["import-hf", "cfg", "--out", "cfg/m.pt"], "inside"),
])
def test_the_commands_reject_bad_input_in_one_line(argv, names, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.pt").write_bytes(b"")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("old")
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(llama_dict(
        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0})))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and names in err[0]


def test_library_facts_the_import_relies_on():
    """transformers' defaults and names hf_io's constants mirror: an upgrade that changes one
    fails here instead of mapping weights wrongly."""
    from transformers.activations import ACT2FN
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

    assert (hf_io.WEIGHTS, hf_io.INDEX) == (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME)
    assert tf.LlamaConfig().hidden_act == hf_io.LLAMA_ACT
    assert tf.LlamaConfig().rope_parameters["rope_type"] == hf_io.ROPE_DEFAULT
    assert tf.GPT2Config().activation_function in hf_io.GPT2_ACTS
    assert tf.MistralConfig().sliding_window == 4096  # why a Mistral import caps its context
    x = torch.linspace(-6, 6, 101)
    for act in hf_io.GPT2_ACTS:
        assert torch.allclose(ACT2FN[act](x), F.gelu(x, approximate="tanh"), atol=1e-6)
