"""LoRA and QLoRA from scratch (book/alignment/lora) against peft and transformers' 4-bit
loading: peft's defaults, the adapter's initialisation and scaling, injection by name into the
reference model and into a transformers model, the same counts as peft (also on the meta device
for Llama 3 8B), the same outputs, gradients and merged model; QLoRA's codes, logits and
gradients against bitsandbytes' Linear4bit + peft; the memory estimate against MemTracker; the
`lora` command."""

import inspect
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from trainbook import configs
from trainbook.__main__ import main
from trainbook.align import base
from trainbook.align import lora as L
from trainbook.align import lora_check as LC
from trainbook.align import lora_memory as LM
from trainbook.align import lora_quality as Q
from trainbook.compute import memory as M
from trainbook.model import Transformer

peft = pytest.importorskip("peft")
TINY = configs.get("tiny-llama")
TINY64 = TINY.with_(d_ff=384)  # rows a multiple of 64: see test_nf4's CPU-kernel test


# ---------------------------------------------------------------------------------------------
# peft's defaults
# ---------------------------------------------------------------------------------------------

def test_peft_defaults_are_what_the_chapter_says():
    c = peft.LoraConfig()
    assert c.r == L.PEFT_DEFAULT_R and c.lora_alpha == L.PEFT_DEFAULT_ALPHA
    assert c.lora_dropout == L.PEFT_DEFAULT_DROPOUT and c.use_rslora is L.PEFT_DEFAULT_RSLORA
    assert c.bias == L.PEFT_DEFAULT_BIAS and c.init_lora_weights is True
    assert c.use_dora is False and c.target_modules is None
    sig = inspect.signature(peft.get_peft_model).parameters
    assert sig["autocast_adapter_dtype"].default is L.PEFT_AUTOCAST_ADAPTER_DTYPE
    from peft.tuners.lora.layer import LoraLayer

    src = inspect.getsource(LoraLayer.reset_lora_parameters)
    assert "kaiming_uniform_(self.lora_A[adapter_name].weight, a=math.sqrt(5))" in src
    assert "nn.init.zeros_(self.lora_B[adapter_name].weight)" in src
    from peft.utils.other import prepare_model_for_kbit_training

    kbit = inspect.signature(prepare_model_for_kbit_training).parameters
    assert kbit["use_gradient_checkpointing"].default is True


def test_peft_scaling_rules_match_ours():
    lin = nn.Sequential(nn.Linear(32, 16))
    for rslora, want in ((False, 16 / 4), (True, 16 / 2)):
        pm = peft.get_peft_model(nn.Sequential(nn.Linear(32, 16)),
                                 peft.LoraConfig(r=4, lora_alpha=16, target_modules=["0"],
                                                 use_rslora=rslora))
        assert pm.base_model.model[0].scaling["default"] == want
        assert L.LoRALinear(lin[0], 4, 16, rslora=rslora).scaling == want


# ---------------------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------------------

def test_init_scaling_and_forward():
    torch.manual_seed(0)
    base = nn.Linear(64, 32)
    layer = L.LoRALinear(base, r=4, alpha=8)
    assert layer.scaling == 2.0 and not base.weight.requires_grad
    assert layer.lora_A.shape == (4, 64) and layer.lora_B.shape == (32, 4)
    assert bool((layer.lora_B == 0).all())
    assert layer.lora_A.abs().max() <= 1 / math.sqrt(64)  # kaiming(a=sqrt 5) = U(+-1/sqrt in)
    x = torch.randn(5, 64)
    torch.testing.assert_close(layer(x), base(x))  # B = 0: the base model exactly
    with torch.no_grad():
        layer.lora_B.normal_()
    want = base(x) + 2.0 * x @ layer.lora_A.T @ layer.lora_B.T
    torch.testing.assert_close(layer(x), want)


def test_merge_unmerge_round_trip():
    torch.manual_seed(1)
    layer = L.LoRALinear(nn.Linear(64, 32), r=8, alpha=16)
    with torch.no_grad():
        layer.lora_B.normal_()
    x = torch.randn(3, 64)
    before, w0 = layer(x), layer.base.weight.detach().clone()
    layer.merge()
    assert layer.merged
    torch.testing.assert_close(layer(x), before)
    torch.testing.assert_close(layer.base(x), before)
    layer.unmerge()
    torch.testing.assert_close(layer.base.weight, w0)


def test_bf16_base_gets_fp32_adapters_and_returns_bf16():
    layer = L.LoRALinear(nn.Linear(32, 32).to(torch.bfloat16), r=2)
    assert layer.lora_A.dtype == torch.float32
    assert layer(torch.randn(2, 32, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_dropout_applies_to_the_adapter_only():
    torch.manual_seed(2)
    layer = L.LoRALinear(nn.Linear(16, 16), r=2, dropout=0.5).train()
    x = torch.randn(4, 16)
    torch.testing.assert_close(layer(x), layer.base(x))  # B = 0: dropout cannot show
    with torch.no_grad():
        layer.lora_B.normal_()
    assert not torch.equal(layer(x), layer(x))  # two dropout masks
    layer.eval()
    torch.testing.assert_close(layer(x), layer(x))


# ---------------------------------------------------------------------------------------------
# Injection and counts
# ---------------------------------------------------------------------------------------------

def test_target_names_follow_peft_rules_and_both_spellings():
    model = Transformer(TINY)
    assert L.target_names(model, "q,v") == [f"blocks.{i}.attn.{n}" for i in range(4)
                                            for n in "qv"]
    assert L.target_names(model, ["q_proj", "v_proj"]) == L.target_names(model, "q,v")
    assert L.target_names(model, "attn.q") == L.target_names(model, "q")
    every = L.target_names(model, L.ALL_LINEAR)
    assert len(every) == 7 * 4 and "head" not in every


def test_counts_equal_a_hand_count_and_peft_on_llama_3_8b_meta():
    cfg = configs.get("llama-3-8b")
    with torch.device("meta"):
        model = Transformer(cfg)
    L.apply_lora(model, L.ALL_LINEAR, r=16)
    d, kv, ff = 4096, 8 * 128, 14336
    per_layer = 16 * ((d + d) * 2 + (d + kv) * 2 + (d + ff) * 3)
    trainable, total = L.counts(model)
    assert trainable == 32 * per_layer == 41_943_040
    assert total == configs.param_counts(cfg)["total"] + trainable
    assert L.peft_line(trainable, total) == (
        "trainable params: 41,943,040 || all params: 8,072,204,288 || trainable%: 0.5196")


@pytest.mark.parametrize("targets, r, alpha", [(L.ALL_LINEAR, 8, 16), ("q,v", 4, 8)])
def test_same_counts_outputs_gradients_and_merge_as_peft(targets, r, alpha):
    out = LC.compare_lora(TINY, targets, r, alpha)
    assert out["ours_counts"] == out["peft_counts"]
    assert out["logits_max_diff"] <= 1e-6 * max(1.0, out["logits_max_abs"])
    assert out["grad_max_diff"] <= 1e-6 * max(1.0, out["grad_max_abs"])
    assert out["merged_max_diff"] <= 1e-5 and out["lora_modules_left"] == 0


def test_lora_applies_to_a_transformers_model_and_matches_peft():
    from trainbook.bench.hf import to_hf

    torch.manual_seed(0)
    hf = to_hf(Transformer(TINY))
    ours = L.apply_lora(to_hf(Transformer(TINY)), "q,v", r=4, alpha=8)
    with LC.quiet():
        pm = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8,
                                                     target_modules=["q_proj", "v_proj"]))
    assert L.counts(ours) == tuple(pm.get_nb_trainable_parameters())
    assert set(L.lora_layers(ours)) == {n.removeprefix("base_model.model.")
                                        for n in LC.peft_layers(pm)}


def test_qlora_equals_transformers_4bit_and_peft():
    out = LC.compare_qlora(TINY64, double=False)
    assert out["base_layers"] == ["Linear4bit"] and out["codes_equal"]
    assert out["ours_counts"] == out["peft_counts"]
    assert out["weight_max_diff"] < 1e-7
    assert out["logits_max_diff"] <= 1e-5 * max(1.0, out["logits_max_abs"])
    assert out["grad_max_diff"] <= 1e-5 * max(1.0, out["grad_max_abs"])


def test_qlora_with_double_quant_is_close_to_bitsandbytes():
    out = LC.compare_qlora(TINY64, "q,v", r=4, alpha=8, double=True)
    assert out["codes_equal"] and out["ours_counts"] == out["peft_counts"]
    assert out["logits_max_diff"] < 0.01 * out["logits_max_abs"]


def test_qlora_quantises_every_linear_layer_and_adapts_the_targets():
    model = L.qlora(Transformer(TINY64), "q", r=2)
    kinds = {n: type(m).__name__ for n, m in model.named_modules() if n.startswith("blocks.0.")}
    assert kinds["blocks.0.attn.q.base"] == "NF4Linear" and kinds["blocks.0.attn.q"] == \
        "LoRALinear"
    assert kinds["blocks.0.mlp.down"] == "NF4Linear" and isinstance(model.head, nn.Linear)
    assert L.counts(model)[1] == configs.param_counts(TINY64)["total"] + L.counts(model)[0]
    with pytest.raises(ValueError, match="4-bit weight"):
        L.merge_and_unload(model)


def test_token_rows_train_only_the_chosen_rows():
    torch.manual_seed(3)
    model = Transformer(TINY)
    ids = torch.randint(0, TINY.vocab_size, (2, 12))
    before = model(ids)[0].detach()
    model.requires_grad_(False)  # as after apply_lora
    L.train_tokens(model, [0, 1, 2])
    torch.testing.assert_close(model(ids)[0], before)  # deltas start at zero
    assert L.counts(model)[0] == 2 * 3 * TINY.d_model
    with torch.no_grad():
        model.head.delta.normal_()
    logits = model(ids)[0]
    changed = (logits - before).abs().amax((0, 1)) > 0
    assert changed.nonzero().flatten().tolist() == [0, 1, 2]  # only those columns
    emb = model.embed
    with torch.no_grad():
        emb.delta.normal_()
    x = torch.tensor([[0, 5, 2]])
    out = emb(x)
    torch.testing.assert_close(out[0, 1], emb.base.weight[5])
    torch.testing.assert_close(out[0, 2], emb.base.weight[2] + emb.delta[2])


# ---------------------------------------------------------------------------------------------
# LoRA against full fine-tuning (the stored comparison)
# ---------------------------------------------------------------------------------------------

QUALITY = Path(__file__).resolve().parents[1] / "book" / "alignment" / "data"


def test_stored_quality_records_are_consistent():
    records, setup = Q.read_quality(QUALITY)
    assert sorted(r["seed"] for r in records) == list(setup.seeds)
    for rec in records:
        rows = {r["method"]: r for r in rec["rows"]}
        assert list(rows) == [name for name, _, _ in setup.variants()]
        for name, rank, tokens in setup.variants():
            row = rows[name]
            assert (row["trainable"], row["total"]) == L.counts(Q.prepare(rank, tokens))
            assert len(row["losses"]) == setup.steps and row["points"][-1]["step"] == setup.steps
            assert row["points"][0]["chat accuracy"] == 0.0  # the base model never stops
        assert rec["base_sha256"] == base.shipped_record()["sha256"]
    assert len(Q.summary(records, setup)) == len(setup.seeds) * len(setup.variants())


@pytest.mark.records
@pytest.mark.timeout(180)
def test_stored_quality_run_reproduces():
    """The first steps of one stored run (LoRA + chat tokens, seed 1), again: the same losses."""
    records, setup = Q.read_quality(QUALITY)
    name, rank, tokens = setup.variants()[-1]
    rec = next(r for r in records if r["seed"] == 1)
    stored = next(r for r in rec["rows"] if r["method"] == name)["losses"][:25]
    again = Q.first_losses(setup, rank, tokens, 1, 25)
    assert again == pytest.approx(stored, rel=1e-3, abs=1e-4)


# ---------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------

def test_memory_full_is_the_estimator_and_lora_states_are_16_bytes_per_adapter_param():
    full = LM.fine_tune_memory("llama-3-8b", "full")
    est = M.estimate(M.MemoryInputs(model=configs.get("llama-3-8b"), seq_len=2048,
                                    recompute="full"))
    assert full.peak == est.peak
    lora = LM.fine_tune_memory("llama-3-8b", "lora")
    assert lora.trainable == 41_943_040
    assert lora.grads + lora.optimizer == 12 * lora.trainable
    assert lora.weights == 2 * 8_030_261_248 + 4 * lora.trainable
    q = LM.fine_tune_memory("llama-3-8b", "qlora")
    assert q.weights < 0.4 * lora.weights and q.transient == 2 * 4096 * 14336


def test_memory_table_verdicts_on_one_h100():
    rows = {(r["model"], r["method"]): r for r in LM.memory_table()}
    assert rows[("llama-3-8b", "full")]["fits"] == "does not fit"
    assert rows[("llama-3-8b", "lora")]["fits"] == "fits"
    assert rows[("llama-3-70b", "lora")]["fits"] == "does not fit"
    assert rows[("llama-3-70b", "qlora")]["fits"] == "fits"
    assert 35 < rows[("llama-3-70b", "qlora")]["weights"] < 45  # GiB


@pytest.mark.timeout(240)
@pytest.mark.parametrize("method", LM.METHODS)
def test_memory_estimate_against_memtracker(method):
    """Full fine-tuning within 5%; LoRA/QLoRA an upper bound within 15% (the reference model's
    frozen RMSNorm weights keep fewer tensors than the estimate counts)."""
    measured = LM.measure(TINY64, method, micro_batch=2, seq_len=64)["peak"]
    est = LM.fine_tune_memory(TINY64, method, micro_batch=2, seq_len=64, recompute="none",
                              dtype="fp32", activations="reference").peak
    if method == "full":
        assert abs(est / measured - 1) < 0.05
    else:
        assert 1.0 <= est / measured < 1.15


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("call, match", [
    (lambda: L.LoRALinear(nn.Linear(4, 4), r=0), "rank r"),
    (lambda: L.LoRALinear(nn.Linear(4, 4), alpha=float("nan")), "alpha"),
    (lambda: L.LoRALinear(nn.Linear(4, 4), dropout=1.0), "dropout"),
    (lambda: L.LoRALinear(nn.Conv1d(4, 4, 1)), "wraps nn.Linear"),
    (lambda: L.apply_lora(Transformer(TINY), "qq"), "match no linear layer"),
    (lambda: L.apply_lora(Transformer(TINY), []), "targets must name"),
    (lambda: L.apply_lora(Transformer(TINY), "all-linear,q"), "give it alone"),
    (lambda: L.apply_lora(Transformer(TINY), "q", r=10_000), "exceeds"),
    (lambda: L.apply_lora(L.apply_lora(Transformer(TINY), "q"), "q"), "already has LoRA"),
    (lambda: L.merge_and_unload(Transformer(TINY)), "no LoRA adapters"),
    (lambda: L.peft_line(0, 0), "positive"),
    (lambda: L.train_tokens(Transformer(configs.get("tiny-gpt2")), [0]), "untied"),
    (lambda: L.TokenRows(nn.Embedding(8, 4), [8]), "distinct token ids"),
    (lambda: L.TokenRows(nn.Conv1d(2, 2, 1), [0]), "nn.Embedding"),
    (lambda: Q.QualitySetup(ranks=()), "ranks"),
    (lambda: Q.QualitySetup(seeds=(-1,)), "seeds"),
    (lambda: Q.write_quality("/tmp", 7), "not one of the setup's seeds"),
    (lambda: Q.QualitySetup(lr_lora=0.0), "lr_lora"),
    (lambda: LC.hf_module_name("head"), "reference Llama block"),
    (lambda: LC.compare_lora(configs.get("tiny-gpt2")), "GPT-2"),
    (lambda: LC.compare_lora(TINY, seq_len=10_000), "max_seq_len"),
    (lambda: LM.fine_tune_memory("llama-3-8b", "dora"), "method"),
    (lambda: LM.fine_tune_memory("llama-3-8b", "lora", dtype="fp16"), "bf16 or fp32"),
    (lambda: LM.memory_table(("llama-3-8b", "llama-3-70b"),
                             shapes=LM.target_shapes(TINY)), "one model"),
])
def test_bad_input_is_rejected_with_a_fix(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------

def test_command_json(capsys):
    assert main(["lora", "--model", "llama-3-8b", "--rank", "16", "--targets", "q", "v",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["trainable"] == 32 * 16 * ((4096 + 4096) + (4096 + 1024))
    assert out["peft_line"].startswith("trainable params: 6,815,744 || all params: ")
    assert [r["method"] for r in out["memory_gib"]] == list(LM.METHODS)


def test_command_text_and_config_json(tmp_path, capsys):
    cfg = {"model_type": "llama", "vocab_size": 512, "num_hidden_layers": 2, "hidden_size": 128,
           "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 384,
           "max_position_embeddings": 256}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["lora", "--model", str(tmp_path / "config.json"), "--rank", "4",
                 "--targets", "q_proj", "--quant", "nf4", "--seq-len", "128"]) == 0
    out = capsys.readouterr().out
    assert "trainable params: 2,048 ||" in out and "QLORA r=4" in out


@pytest.mark.parametrize("argv, words", [
    (["--targets", "c_attn"], "match no linear layer"),
    (["--rank", "100000"], "exceeds"),
    (["--dropout", "1.5"], "dropout"),
    (["--seq-len", "100000"], "max_seq_len"),
    (["--gpu", "h900"], "h900"),
])
def test_command_bad_input_is_one_error_line(argv, words, capsys):
    assert main(["lora", "--model", "llama-3-8b", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and words in err[0]
