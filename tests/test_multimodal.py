"""Multimodal training: the from-scratch ViT against transformers' ViT and CLIP on the same
weights, its FLOP count against torch's counter, image tokens of real encoders, the generated
data and interleaved batching, the LLaVA model and its stages' freezing, the stored runs (a
re-run prefix and the claims the chapter makes), and bad input."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from trainbook.align import task
from trainbook.configs import PRESETS
from trainbook.frontier import llava as L
from trainbook.frontier import multimodal_data as D
from trainbook.frontier import multimodal_runs as R
from trainbook.frontier import vision as V
from trainbook.frontier import vision_cost as C

TOK = task.chat_tokenizer()
DATA = Path(__file__).resolve().parents[1] / "book/frontier/data"
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             image_size=16, patch_size=4)


def hf_model(kind: str, seed: int = 0):
    from transformers import CLIPVisionConfig, CLIPVisionModel, ViTConfig, ViTModel

    torch.manual_seed(seed)
    m = ViTModel(ViTConfig(**SMALL), add_pooling_layer=False) if kind == "vit" else \
        CLIPVisionModel(CLIPVisionConfig(**SMALL))
    with torch.no_grad():  # random norms and biases too, so that every weight is exercised
        for p in m.parameters():
            p.normal_(0.0, 0.2)
    return m.eval()


def tiny_llava(seed: int = 0) -> L.LLaVA:
    cfg = R.RunConfig(seed=seed, d_model=32, n_layers=1, n_heads=2, d_ff=64, vision_d=32,
                      vision_layers=1)
    return R.build(cfg, R.language_model(cfg, TOK.vocab_size), TOK)


# ---- the encoder -------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["vit", "clip"])
def test_encoder_matches_transformers_on_the_same_weights(kind):
    ref = hf_model(kind)
    mine = V.from_hf(ref)
    x = torch.rand(3, 3, 16, 16)
    emb, out = V.hidden_states_of(ref, x)
    torch.testing.assert_close(mine.embed(x), emb, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mine(x), out, atol=1e-5, rtol=1e-5)


def test_patch_embedding_is_the_strided_convolution():
    ref = hf_model("vit")
    conv = ref.embeddings.patch_embeddings.projection
    mine = V.from_hf(ref)
    x = torch.rand(2, 3, 16, 16)
    want = conv(x).flatten(2).transpose(1, 2)  # (B, N, d)
    torch.testing.assert_close(mine.patch(V.patchify(x, 4)), want, atol=1e-6, rtol=1e-6)


def test_flops_formula_equals_torch_counter():
    for cfg in (V.ViTConfig(), V.ViTConfig(cls=False, image_size=24, patch_size=6, n_layers=1)):
        model = V.ViT(cfg)
        assert V.measured_forward_flops(model, torch.rand(2, 3, cfg.image_size,
                                                          cfg.image_size)) == \
            V.forward_flops(cfg, 2)["total"]


def test_image_tokens_of_real_encoders():
    e = C.ENCODERS
    assert C.image_tokens(e["CLIP ViT-L/14 @224"]) == 256
    assert C.image_tokens(e["CLIP ViT-L/14 @336"]) == 576
    assert e["CLIP ViT-L/14 @336"].n_tokens == 577
    assert C.image_tokens(e["SigLIP so400m/14 @384"]) == 729 == e["SigLIP so400m/14 @384"].n_tokens
    assert C.image_tokens(e["ViT-B/16 @224"], keep_cls=True) == 197
    assert C.image_tokens(e["CLIP ViT-L/14 @336"], tiles=5) == 2880
    s1 = C.step_flops(PRESETS["llama-2-7b"], e["CLIP ViT-L/14 @336"], 128, stage=1)
    s2 = C.step_flops(PRESETS["llama-2-7b"], e["CLIP ViT-L/14 @336"], 128, stage=2)
    assert s1["seq"] == s2["seq"] == 704 and s1["lm"] / s2["lm"] == pytest.approx(2 / 3)
    rows = C.table()
    assert [r["seq"] for r in rows] == sorted(r["seq"] for r in rows)  # more tokens, longer
    assert all(a["activations GiB"] < b["activations GiB"] for a, b in zip(rows, rows[1:]))


def test_command_reports_the_table():
    from trainbook.commands import multimodal as M

    r = M.report("llama-2-7b", 128)
    assert [row["image tokens"] for row in r["rows"]] == [196, 256, 576, 729, 2880]
    assert r["fits_max_seq_len"] is True
    assert M.report("tiny-gpt2", 0)["fits_max_seq_len"] is False  # 2880 > 1024 positions
    with pytest.raises(ValueError, match="unknown model"):
        M.report("no-such-model")


# ---- data and batching -------------------------------------------------------------------------

def test_data_is_deterministic_and_answers_match_scenes():
    a = D.make_examples(12, list(D.KINDS), seed=3)
    b = D.make_examples(12, list(D.KINDS), seed=3)
    assert all(torch.equal(x.images, y.images) and x.answer == y.answer for x, y in zip(a, b))
    for e in a:
        s = e.scenes[0]
        assert e.images.shape == (2 if e.kind == "same" else 1, 3, D.SIZE, D.SIZE)
        if e.kind == "caption":
            assert e.answer == s.caption() and e.answer.startswith(str(s.count))
        img = D.draw(s, torch.Generator().manual_seed(0))
        lit = (img - torch.tensor(D.COLOURS[s.colour])[:, None, None]).abs().amax(0) < 0.3
        per_object = {"square": 9, "cross": 5, "bar": 3}[s.shape]
        assert int(lit.sum()) == s.count * per_object  # the noise never makes a stray pixel
    assert sum(D.chance(k) for k in ("colour", "same")) == pytest.approx(0.75)
    test = D.make_examples(12, list(D.KINDS), seed=3, split="test")
    assert not any(torch.equal(x.images, y.images) for x, y in zip(a, test))


def test_interleaved_batch_places_each_image_in_its_slots():
    model = tiny_llava()
    n = model.tokens_per_image
    text_only = D.Example("text", "hello", "world", torch.zeros(0, 3, D.SIZE, D.SIZE), ())
    batch = [D.make_examples(1, ["same"])[0], text_only, D.make_examples(1, ["caption"])[0]]
    ids, mask, imgs = D.collate(TOK, batch, n)
    slots = ids == model.image_id
    assert slots.sum(1).tolist() == [2 * n, 0, n] and imgs.shape[0] == 3
    torch.testing.assert_close(imgs[2], batch[2].images[0])
    # the hidden states entering the blocks: the image tokens exactly where the placeholders are
    seen = {}
    handle = model.lm.blocks[0].register_forward_pre_hook(
        lambda m, args: seen.update(x=args[0]))  # returns None: the inputs stay as they are
    logits = model(ids, imgs)
    handle.remove()
    feats = model.image_tokens(imgs)
    torch.testing.assert_close(seen["x"][0, slots[0]], feats[:2].reshape(-1, feats.shape[-1]))
    torch.testing.assert_close(seen["x"][2, slots[2]], feats[2])
    assert logits.shape == (3, ids.shape[1], TOK.vocab_size)
    # a row's logits do not depend on the other rows' images
    alone, _, _ = D.collate(TOK, batch[2:], n)
    torch.testing.assert_close(model(alone, imgs[2:])[0], logits[2, :alone.shape[1]],
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="placeholders"):
        model(ids, imgs[:2])


def test_stage1_moves_only_the_projector_and_stage2_never_the_encoder():
    model = tiny_llava()
    train = D.make_examples(16, ["caption", "colour"], seed=1)
    for stage, want in ((1, ["projector"]), (2, ["lm", "projector"])):
        before = L.snapshot(model)
        R.train_stage(model, TOK, stage, 2, 1e-2, train, seed=0, batch_size=4)
        assert sorted({n.split(".")[0] for n in L.changed(model, before)}) == want
        assert all(n.startswith(tuple(want)) for n in L.set_stage(model, stage))


def test_caption_fields_and_accuracy_keys():
    assert L.caption_fields("2 red squares top left", "2 red squares top left") == 1.0
    assert L.caption_fields("1 red square top right", "2 red squares top left") == 0.5
    assert L.caption_fields("", "2 red squares top left") == 0.0
    model = tiny_llava()
    acc = L.accuracy(model, TOK, D.make_examples(6, list(D.KINDS), seed=0, split="test"))
    assert set(acc) == {*D.KINDS, "caption_fields", "questions"}


# ---- the stored runs ---------------------------------------------------------------------------

def stored() -> dict:
    return R.read_runs(DATA / "multimodal-llava.json")


def test_stored_runs_support_the_chapter():
    rec = stored()
    assert len(rec["runs"]) >= 3
    for r in rec["runs"]:
        ev = {e["stage"]: e for e in r["evals"]}
        assert r["stage1_changed"] == ["projector"] and r["stage2_changed"] == ["lm", "projector"]
        assert ev[1]["caption_fields"] > ev[0]["caption_fields"] + 0.2  # stage 1 aligns
        assert ev[2]["questions"] > ev[1]["questions"] + 0.2  # stage 2 teaches the questions
        probes = [p for p in r["probes"] if p["stage"] == 1]
        assert probes[-1]["caption_loss"] < 0.5 * probes[0]["caption_loss"]
        assert len(r["stage1_losses"]) == r["config"]["stage1_steps"]


def test_stored_run_prefix_reproduces():
    """The first text-stage steps of seed 0, re-run, give the stored losses."""
    rec = stored()["runs"][0]
    cfg = R.RunConfig(**{**rec["config"], "text_steps": 8})
    tok = task.chat_tokenizer()
    lm = R.language_model(cfg, tok.vocab_size)
    train = D.make_examples(cfg.n_train, list(D.KINDS), cfg.seed, "train")
    losses = R.text_stage(lm, tok, cfg, train)
    assert losses == pytest.approx(rec["text_losses"][:8], rel=1e-4)


# ---- bad input ---------------------------------------------------------------------------------

def test_bad_input_is_rejected_with_a_clear_message():
    with pytest.raises(ValueError, match="not divisible by patch size"):
        V.ViTConfig(image_size=16, patch_size=5)
    with pytest.raises(ValueError, match="act"):
        V.ViTConfig(act="relu")
    with pytest.raises(ValueError, match="batch, channels"):
        V.patchify(torch.zeros(3, 16, 16), 4)
    with pytest.raises(ValueError, match="patch size"):
        V.patchify(torch.zeros(1, 3, 16, 16), 3)
    with pytest.raises(ValueError, match="images must be"):
        V.ViT(V.ViTConfig())(torch.zeros(1, 3, 8, 8))
    with pytest.raises(TypeError):
        V.ViT({"d_model": 4})
    with pytest.raises(ValueError, match="ViTModel or CLIPVisionModel"):
        V.from_hf(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="model_type"):
        V.config_from_hf(object())
    with pytest.raises(ValueError, match="images must be"):
        V.forward_flops(V.ViTConfig(), 0)
    with pytest.raises(TypeError):
        V.measured_forward_flops(torch.nn.Linear(2, 2), torch.zeros(1))
    with pytest.raises(ValueError, match="tiles"):
        C.image_tokens(C.ENCODERS["ViT-B/16 @224"], tiles=0)
    with pytest.raises(TypeError):
        C.image_tokens("CLIP")
    with pytest.raises(ValueError, match="stage"):
        C.step_flops(PRESETS["llama-2-7b"], C.ENCODERS["ViT-B/16 @224"], 10, stage=3)
    with pytest.raises(ValueError, match="text_tokens"):
        C.step_flops(PRESETS["llama-2-7b"], C.ENCODERS["ViT-B/16 @224"], -1)
    with pytest.raises(TypeError):
        C.activation_gib("llama", 10)
    with pytest.raises(ValueError, match="kind"):
        D.chance("size")
    with pytest.raises(ValueError, match="kinds"):
        D.make_examples(3, ["size"])
    with pytest.raises(ValueError, match="split"):
        D.make_examples(3, ["caption"], split="val")
    with pytest.raises(ValueError, match="n must be"):
        D.make_examples(0, ["caption"])
    with pytest.raises(ValueError, match="colour"):
        D.random_scene(random.Random(0), "purple")
    with pytest.raises(TypeError):
        D.draw("scene")
    ex = D.make_examples(1, ["caption"])[0]
    with pytest.raises(ValueError, match="tokens_per_image"):
        D.encode(TOK, ex, 0)
    with pytest.raises(ValueError, match="marks"):
        D.encode(TOK, D.Example("caption", "describe", "x", ex.images, ex.scenes), 4)
    with pytest.raises(ValueError, match="placeholder"):
        D.encode(TOK, D.Example("caption", "<image>\x00", "x", ex.images, ex.scenes), 4)
    with pytest.raises(ValueError, match="at least one"):
        D.collate(TOK, [], 4)
    with pytest.raises(TypeError):
        D.as_text("x")
    with pytest.raises(ValueError, match="kind"):
        L.projector(4, 4, "qformer")
    with pytest.raises(ValueError, match="d_vision"):
        L.projector(0, 4)
    model = tiny_llava()
    with pytest.raises(ValueError, match="stage"):
        L.set_stage(model, 0)
    with pytest.raises(TypeError):
        L.set_stage(torch.nn.Linear(2, 2), 1)
    with pytest.raises(ValueError, match="batch, time"):
        model(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="image_id"):
        L.LLaVA(model.vision, model.lm, 10_000)
    with pytest.raises(ValueError, match="snapshot"):
        L.changed(model, {})
    with pytest.raises(ValueError, match="no examples"):
        L.answers(model, TOK, [])
    with pytest.raises(ValueError, match="caption"):
        L.caption_fields("a", "b")
    with pytest.raises(ValueError, match="steps"):
        R.RunConfig(stage1_steps=0)
    with pytest.raises(TypeError):
        R.run({"seed": 0})
    with pytest.raises(ValueError, match="seeds"):
        R.write_runs("x.json", seeds=[])
    with pytest.raises(ValueError, match="workers"):
        R.write_runs("x.json", seeds=[0], workers=0)
    with pytest.raises(ValueError, match=".json"):
        R.write_runs("x.txt", seeds=[0])
    with pytest.raises(ValueError, match="write_runs"):
        R.read_runs(DATA / "does-not-exist.json")
