"""The trainer's seams for Parts 3 and 4: hooks, --skip-batches, --qk-norm, --z-loss,
--embed-scale and the options' bad input. The monitors, the FP8 emulation and the chapters' tools
have test files of their own."""

import dataclasses
import math

import pytest
import torch

from trainbook import configs
from trainbook.bench import hf
from trainbook.model import Transformer, count_parameters, lm_loss
from trainbook.pretrain.loss import z_loss as z_loss_from_scratch
from trainbook.train import TrainConfig, train
from trainbook.train.config import parse_skips
from trainbook.train.hooks import Hook, StopTraining


def tiny(cache_dir, **kw):
    base = dict(model="tiny-llama", d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64,
                tokenizer="bytes", seq_len=32, batch_size=4, steps=12, warmup_steps=2, lr=3e-3,
                log_every=0, progress=False, eval_batches=2, cache_dir=cache_dir)
    base.update(kw)
    return TrainConfig(**base)


class Recorder(Hook):
    """Every call, in order, with what the hook saw."""

    def __init__(self, stop_at=None):
        self.calls, self.stop_at, self.params_before = [], stop_at, None

    def on_model(self, model):
        self.calls.append(("on_model", type(model).__name__))

    def before_update(self, ctx):
        self.calls.append(("before", ctx.step))
        self.params_before = [p.detach().clone() for p in ctx.model.parameters()]
        assert all(p.grad is not None for p in ctx.model.parameters())
        assert math.isfinite(ctx.loss) and ctx.grad_norm > 0 and ctx.record is None
        if ctx.step == self.stop_at:
            raise StopTraining(f"planted stop at {ctx.step}")

    def after_update(self, ctx):
        self.calls.append(("after", ctx.step))
        assert ctx.record["step"] == ctx.step and ctx.record["loss"] == pytest.approx(ctx.loss)
        ctx.record["seen_by_hook"] = True

    def on_end(self, result):
        self.calls.append(("end", len(result.history)))


def test_hooks_are_called_in_order_and_can_add_to_the_record(cache_dir):
    rec = Recorder()
    r = train(tiny(cache_dir, steps=3), hooks=[rec])
    assert rec.calls == [("on_model", "Transformer"), ("before", 1), ("after", 1), ("before", 2),
                         ("after", 2), ("before", 3), ("after", 3), ("end", 3)]
    assert all(row["seen_by_hook"] for row in r.history) and r.stopped is None


def test_stop_before_the_update_leaves_the_weights_untouched(cache_dir):
    rec = Recorder(stop_at=5)
    r = train(tiny(cache_dir), hooks=[rec])
    assert r.stopped == "planted stop at 5" and len(r.history) == 4
    for p, b in zip(r.model.parameters(), rec.params_before):
        assert torch.equal(p, b)
    assert ("end", 4) in rec.calls and ("after", 5) not in rec.calls


def test_hooks_do_not_change_the_run(cache_dir):
    plain = train(tiny(cache_dir))
    watched = train(tiny(cache_dir), hooks=[Recorder()])
    assert plain.losses() == watched.losses()


@pytest.mark.parametrize("clip", [0.0, 1.0, 0.05])  # off, rarely and always clipping
def test_grad_norms_monitor_gives_each_blocks_norm_before_clipping(cache_dir, clip):
    plain = train(tiny(cache_dir, steps=4, grad_clip=clip))
    r = train(tiny(cache_dir, steps=4, grad_clip=clip, monitor="grad-norms"))
    assert r.losses() == plain.losses()  # a monitor only watches
    blocks = ["gnorm.embed", "gnorm.blocks.0", "gnorm.blocks.1", "gnorm.norm", "gnorm.head"]
    for row in r.history:
        assert [k for k in row if k.startswith("gnorm.")] == blocks
        total = math.sqrt(sum(row[b] ** 2 for b in blocks))
        assert total == pytest.approx(row["grad_norm"], rel=1e-5)  # unclipped, even when clipped
    if clip == 0.05:
        assert all(row["grad_norm"] > clip for row in r.history)


def test_skip_batches_trains_on_later_data_and_resumes_the_same(cache_dir, tmp_path):
    """Steps 4-6's batches are never seen: step 4 trains on what was step 7's batch; resuming
    from a checkpoint taken before the skip gives the same run."""
    full = train(tiny(cache_dir, steps=10))
    skipped = train(tiny(cache_dir, steps=10, skip_batches="4-6"))
    assert skipped.losses()[:3] == full.losses()[:3]
    assert skipped.losses()[3] != full.losses()[3]
    first = train(tiny(cache_dir, steps=10, skip_batches="4-6", ckpt_dir=str(tmp_path),
                       stop_after=2))
    resumed = train(dataclasses.replace(first.config, stop_after=None, resume=True))
    assert resumed.losses() == skipped.losses()


@pytest.mark.parametrize("text, parsed", [("", []), ("5", [(5, 5)]),
                                          ("3-4, 9-12", [(3, 4), (9, 12)])])
def test_parse_skips(text, parsed):
    assert parse_skips(text) == parsed


@pytest.mark.parametrize("changes, message", [
    (dict(skip_batches="a-b"), "not a step range; write FIRST-LAST"),
    (dict(skip_batches="9-3"), "1 <= FIRST <= LAST"),
    (dict(skip_batches="5-9,7-8"), "must be in order and not overlap"),
    (dict(monitor="spikes,loud"), "unknown monitor 'loud'"),
    (dict(dtype="fp8"), "dtype must be one of fp32, bf16, fp16, fp8-emulated"),
    (dict(fp8_recipe="perchannel"), "fp8_recipe must be one of"),
    (dict(z_loss=-1e-4), "z_loss must be >= 0"),
    (dict(embed_scale=0.0), "embed_scale must be positive"),
])
def test_bad_options_say_what_to_do(changes, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**changes)


def test_fsdp_tp_pp_refuse_what_is_wired_for_one_process():
    from trainbook.train import layout_for, model_config
    for kw, option in ((dict(dtype="fp8-emulated", dp_shard=2), "--dtype fp8-emulated"),
                       (dict(monitor="nan", dp_shard=2), "--monitor nan"),
                       (dict(monitor="grad-norms", tp=2), "--monitor grad-norms"),
                       (dict(z_loss=1e-4, tp=2), "--z-loss"), (dict(qk_norm=True, pp=2,
                                                                    grad_accum=2), "--qk-norm")):
        cfg = TrainConfig(**kw)
        with pytest.raises(ValueError, match=option):
            layout_for(cfg, 2, model_config(cfg, 256))


def test_qk_norm_embed_scale_and_z_loss_reach_the_model(cache_dir):
    r = train(tiny(cache_dir, steps=2, qk_norm=True, embed_scale=4.0, z_loss=1e-3))
    m = r.model
    assert m.cfg.qk_norm and m.cfg.embed_scale == 4.0 and m.z_loss == 1e-3
    assert m.blocks[0].attn.q_norm.weight.shape == (16,)  # head_dim: d_model 32 / 2 heads
    assert count_parameters(m) == configs.param_counts(m.cfg)["total"]
    x = torch.randint(0, 256, (2, 32))
    assert torch.allclose(m.embed_inputs(x)[0], 4.0 * m.embed(x))


def test_z_loss_is_part_2s_z_loss_and_only_in_training_mode():
    torch.manual_seed(0)
    logits, y = torch.randn(2, 5, 11) * 4, torch.randint(0, 11, (2, 5))
    y[0, :2] = -100
    ce = lm_loss(logits, y)
    assert torch.allclose(lm_loss(logits, y, z_loss=1e-2) - ce,
                          z_loss_from_scratch(logits, y, coef=1e-2), rtol=1e-6)
    per_token = lm_loss(logits, y, reduction="none", z_loss=1e-2)
    assert per_token.shape == (10,) and per_token[:2].abs().max() == 0
    m = Transformer(configs.get("tiny-llama").with_(vocab_size=64, n_layers=1))
    m.z_loss = 1.0
    idx = torch.randint(0, 64, (1, 8))
    assert m.train()(idx, idx)[1] > m.eval()(idx, idx)[1]  # validation reports pure CE


def test_qk_norm_matches_transformers_qwen3():
    cfg = configs.get("tiny-llama").with_(vocab_size=128, n_layers=2, qk_norm=True)
    torch.manual_seed(0)
    ours = Transformer(cfg)
    with torch.no_grad():
        for b in ours.blocks:  # away from the all-ones init, so a missing norm would show
            b.attn.q_norm.weight.normal_(1, 0.3)
            b.attn.k_norm.weight.normal_(1, 0.3)
    theirs = hf.to_hf(ours)
    assert type(theirs).__name__ == "Qwen3ForCausalLM"
    x = torch.randint(0, 128, (2, 24))
    assert torch.allclose(ours(x)[0], theirs(x).logits, atol=1e-5, rtol=0)


def test_qwen3_config_imports_with_qk_norm(hf_dir):
    cfg = configs.from_hf_config(hf_dir / "qwen3-0.6b.json")
    assert cfg.qk_norm and cfg.tied and cfg.head_dim == 128 and not cfg.qkv_bias
    counts = configs.param_counts(cfg)
    # Qwen3-0.6B's model card: 0.6B parameters, 0.44B non-embedding
    assert round(counts["total"] / 1e9, 1) == 0.6
    assert round(counts["non_embedding"] / 1e9, 2) == 0.44
    assert counts["attention"] == 28 * (1024 * 128 * (16 + 8 + 8) + 16 * 128 * 1024 + 2 * 128)


def test_embed_scale_and_gpt2_qk_norm_have_no_hf_equivalent():
    with pytest.raises(ValueError, match="embed_scale 2 has no"):
        hf.hf_config(configs.get("tiny-llama").with_(embed_scale=2.0))
    with pytest.raises(ValueError, match="GPT-2 has no QK-norm"):
        hf.hf_config(configs.get("tiny-gpt2").with_(qk_norm=True))
    with pytest.raises(ValueError, match="embed_scale must be a positive number"):
        configs.get("tiny-llama").with_(embed_scale=-1.0)


def test_clipping_off_measures_an_overflowing_norm_without_making_nan():
    """--grad-clip 0: a gradient norm that overflows fp32 stays inf and the gradients stay
    finite (clip_grad_norm_ with max_norm inf would multiply them by inf / inf = NaN)."""
    from trainbook.train.engine import Plain
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), 3e38)
    model = torch.nn.Linear(1, 1)
    model.weight, model.bias = p, None
    engine = Plain(model, model, False, None, torch.amp.GradScaler("cpu", enabled=False))
    norm = engine.clip(torch.optim.SGD([p], lr=0.1), float("inf"))
    assert norm.isinf() and torch.isfinite(p.grad).all()


def test_emulated_fp16_trains_with_loss_scaling(cache_dir):
    """--dtype fp8-emulated --fp8-recipe fp16 rounds gradients to fp16 inside the linear layers:
    the trainer scales the loss as it does for autocast fp16 (GradScaler's scale is logged)."""
    class Scale(Hook):
        def __init__(self):
            self.scales = []

        def before_update(self, ctx):
            self.scales.append(ctx.loss_scale)

    seen = Scale()
    r = train(tiny(cache_dir, steps=3, dtype="fp8-emulated", fp8_recipe="fp16"), hooks=[seen])
    assert seen.scales[0] == 2.0 ** 16 and math.isfinite(r.losses()[-1])
    seen = Scale()
    train(tiny(cache_dir, steps=3, dtype="fp8-emulated", fp8_recipe="tensorwise"), hooks=[seen])
    assert seen.scales == [1.0, 1.0, 1.0]
