"""The benchmark against Hugging Face transformers (trainbook.bench.hf, `benchtrain`): the two
models compute the same function, the library defaults it relies on still hold, bad input is one
clear error. No test asserts a speed: that depends on the machine."""

import json
import math
import tomllib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from trainbook import configs
from trainbook.__main__ import main
from trainbook.bench import hf
from trainbook.model import Transformer, lm_loss

ROOT = Path(__file__).resolve().parents[1]
MICRO = configs.get("tiny-llama").with_(name="micro-llama", vocab_size=64, n_layers=1, d_model=32,
                                        n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=16)
EQUIVALENCE = {
    "tiny-gpt2": configs.get("tiny-gpt2"),
    "tiny-llama": configs.get("tiny-llama"),
    "gqa-llama": configs.get("tiny-llama").with_(name="gqa-llama", n_heads=8, n_kv_heads=2,
                                                 rope_theta=500000.0, tie_embeddings=True),
    "untied-gpt2": configs.get("tiny-gpt2").with_(name="untied-gpt2", tie_embeddings=False,
                                                  d_ff=200),
}


def pair(cfg):
    """Our model with perturbed norms and biases (init makes them 1 and 0, which would hide a
    mis-mapped one), and its transformers copy."""
    torch.manual_seed(0)
    ours = Transformer(cfg)
    with torch.no_grad():
        for p in ours.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return ours, hf.to_hf(ours)


# ---- the same function ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(EQUIVALENCE))
def test_logits_and_loss_match_transformers(name):
    cfg = EQUIVALENCE[name]
    ours, theirs = pair(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, _ = ours(idx)
        out = theirs(input_ids=idx, labels=idx)  # HF shifts labels inside: position t predicts t+1
        _, shifted_loss = ours(idx[:, :-1], idx[:, 1:])  # ours takes targets already shifted
    assert (logits - out.logits).abs().max().item() < 1e-5
    assert abs(out.loss.item() - shifted_loss.item()) < 1e-5
    assert abs(out.loss.item() - lm_loss(logits[:, :-1], idx[:, 1:]).item()) < 1e-5


def test_copy_is_independent_and_tied_like_ours():
    ours, theirs = pair(EQUIVALENCE["tiny-gpt2"])
    assert theirs.lm_head.weight is theirs.transformer.wte.weight
    with torch.no_grad():
        ours.embed.weight.zero_()
    assert theirs.transformer.wte.weight.abs().sum() > 0  # a copy, not shared storage
    assert theirs.training


def test_unsupported_configs_are_refused():
    with pytest.raises(ValueError, match="mixture of experts"):
        hf.hf_config(configs.get("tiny-mixtral"))
    with pytest.raises(ValueError, match="Qwen2"):
        hf.hf_config(configs.get("tiny-llama").with_(qkv_bias=True))


# ---- the library defaults this rests on ----------------------------------------------------------

def test_transformers_version_floor_matches_the_extra_and_the_pin():
    have = tuple(int(p) for p in transformers.__version__.split(".")[:2])
    assert have >= hf.TRANSFORMERS_FLOOR
    floor = ".".join(map(str, hf.TRANSFORMERS_FLOOR))
    project = tomllib.loads((ROOT / "code" / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["hf"] == [f"transformers>={floor}"]
    assert not any("transformers" in d for d in project["dependencies"])  # optional, not core
    pins = (ROOT / "requirements.txt").read_text().split()
    assert f"transformers=={transformers.__version__}" in pins


def test_gpt2_defaults():
    default = transformers.GPT2Config()
    assert default.activation_function == hf.GPT2_ACTIVATION
    for f in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):
        assert getattr(default, f) == hf.HF_GPT2_DEFAULT_DROPOUT
    x = torch.linspace(-6, 6, 1001)
    gelu = transformers.activations.ACT2FN[hf.GPT2_ACTIVATION]
    assert torch.allclose(gelu(x), F.gelu(x, approximate="tanh"), atol=1e-6)  # what ours uses


def test_llama_defaults():
    default = transformers.LlamaConfig()
    assert dict(default.rope_parameters) == hf.HF_LLAMA_DEFAULT_ROPE
    assert default.rms_norm_eps == hf.HF_LLAMA_DEFAULT_RMS_EPS
    assert default.hidden_act == "silu"


def test_hf_config_fields_for_full_size_presets():
    """Config objects only (no weights): every field that matters, read back."""
    g = hf.hf_config(configs.get("gpt2"))
    assert (g.n_embd, g.n_layer, g.n_head, g.n_inner, g.n_positions, g.vocab_size) == \
        (768, 12, 12, 3072, 1024, 50257)
    assert g.tie_word_embeddings and g.layer_norm_epsilon == 1e-5 and not g.use_cache
    assert g.resid_pdrop == g.embd_pdrop == g.attn_pdrop == 0
    assert g._attn_implementation == hf.ATTN_IMPLEMENTATION
    ll = hf.hf_config(configs.get("llama-3-8b"))
    assert (ll.hidden_size, ll.num_hidden_layers, ll.num_attention_heads, ll.num_key_value_heads,
            ll.head_dim, ll.intermediate_size, ll.max_position_embeddings, ll.vocab_size) == \
        (4096, 32, 32, 8, 128, 14336, 8192, 128256)
    assert dict(ll.rope_parameters) == {"rope_type": "default", "rope_theta": 500000.0}
    assert ll.rms_norm_eps == 1e-5 and not ll.tie_word_embeddings and not ll.attention_bias
    assert ll._attn_implementation == hf.ATTN_IMPLEMENTATION


@pytest.mark.parametrize("name", ["tiny-gpt2", "gqa-llama"])
def test_attention_implementation_is_honoured(name, monkeypatch):
    """The transformers copy runs SDPA with no mask and is_causal=True: our kernel call."""
    _, theirs = pair(EQUIVALENCE[name])
    assert theirs.config._attn_implementation == hf.ATTN_IMPLEMENTATION
    calls, sdpa = [], F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        theirs(input_ids=torch.zeros(1, 8, dtype=torch.long))
    assert len(calls) == EQUIVALENCE[name].n_layers
    assert all(c.get("attn_mask") is None and c.get("is_causal") is True for c in calls)


# ---- train_speed ---------------------------------------------------------------------------------

def test_train_speed_runs_and_reports():
    r = hf.train_speed(MICRO, batch=1, seq_len=8, steps=1, repeats=2, warmup=0)
    assert (r.model, r.device, r.precision, r.repeats) == ("micro-llama", "cpu", "fp32", 2)
    assert len(r.ours_samples) == len(r.hf_samples) == 2
    assert r.ours_tokens_per_s > 0 and r.hf_tokens_per_s > 0
    assert math.isclose(r.ratio, r.ours_tokens_per_s / r.hf_tokens_per_s)
    assert json.loads(json.dumps(r.to_dict()))["params"] == r.params


@pytest.mark.parametrize("kwargs, match", [
    ({"batch": 0}, "batch"), ({"steps": -1}, "steps"), ({"repeats": True}, "repeats"),
    ({"repeats": 1.5}, "repeats"), ({"warmup": -1}, "warmup"), ({"seq_len": 17}, "max_seq_len"),
    ({"seq_len": 0}, "seq_len"), ({"device": "tpu"}, "device"),
])
def test_train_speed_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        hf.train_speed(MICRO, **{"batch": 1, "seq_len": 8, "steps": 1, "repeats": 1, **kwargs})


def test_train_speed_rejects_unknown_and_unsupported_models():
    with pytest.raises(ValueError, match="bench sizes: small-gpt2"):
        hf.train_speed("no-such-model")
    with pytest.raises(ValueError, match="mixture of experts"):
        hf.train_speed("tiny-mixtral")


# ---- the command ---------------------------------------------------------------------------------

def run_command(argv, capsys):
    try:
        code = main(["benchtrain", *argv])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv", [
    ["--models", "tiny-gpt2", "no-such-model"], ["--models", "tiny-mixtral"],
    ["--models", "tiny-gpt2", "tiny-gpt2"], ["--seq-len", "1000"], ["--device", "tpu"],
    ["--batch", "0"], ["--repeats", "x"], ["--output", "."],
])
def test_command_bad_input_is_one_error_line(argv, capsys):
    code, out, err = run_command(argv, capsys)
    assert code == 2
    assert out == ""  # refused before any work
    assert len([line for line in err.splitlines() if "error:" in line]) == 1
    assert "Traceback" not in err


def test_command_json_output(tmp_path, capsys):
    threads = torch.get_num_threads()
    path = tmp_path / "out" / "bench.json"
    code, out, err = run_command(["--models", "tiny-gpt2", "--batch", "1", "--seq-len", "8",
                                  "--steps", "1", "--repeats", "1", "--warmup", "0",
                                  "--threads", "1", "--json", "--output", str(path)], capsys)
    assert code == 0
    doc = json.loads(out)
    assert doc == json.loads(path.read_text())
    assert "benchtrain" in doc["command"] and "--threads 1" in doc["command"]
    assert doc["transformers"] == transformers.__version__ and doc["torch"] == torch.__version__
    assert doc["threads"] == 1 and doc["device"] == "cpu" and doc["date"].endswith("+00:00")
    assert [r["model"] for r in doc["rows"]] == ["tiny-gpt2"]
    assert "benchtrain" not in err  # no progress bar with --json
    assert torch.get_num_threads() == threads  # --threads is undone
