import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainbook import configs

# Exact totals: the released checkpoints' parameter counts (Hugging Face model pages / safetensors
# index metadata). Mixtral: 46.7B total, 12.9B active per token (Jiang et al. 2024).
EXPECTED = {
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    "llama-3-405b": 405_853_388_800,
    "mistral-7b": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704,
}


@pytest.mark.parametrize("name", EXPECTED)
def test_preset_totals_are_exact(name):
    assert configs.param_counts(configs.get(name))["total"] == EXPECTED[name]


def test_components_add_up_and_moe_active():
    c = configs.param_counts(configs.get("mixtral-8x7b"))
    assert c["active"] == 12_879_925_248
    parts = ("embedding", "position", "attention", "mlp", "norms", "head")
    assert sum(c[k] for k in parts) == c["total"]
    gpt2 = configs.param_counts(configs.get("gpt2"))
    assert gpt2["head"] == 0 and gpt2["position"] == 1024 * 768  # tied head, learned positions
    assert gpt2["non_embedding"] == 85_056_000  # Kaplan's N for GPT-2 small


@pytest.mark.parametrize("file, total", [
    ("llama-3-8b.json", 8_030_261_248), ("mistral-7b.json", 7_241_732_096),
    ("mixtral-8x7b.json", 46_702_792_704), ("qwen2-0.5b.json", 494_032_768),
    ("gpt2.json", 124_439_808),
])
def test_hugging_face_configs(hf_dir, file, total):
    cfg = configs.from_hf_config(hf_dir / file)
    assert configs.param_counts(cfg)["total"] == total


def test_hf_config_matches_preset(hf_dir):
    cfg = configs.from_hf_config(hf_dir / "llama-3-8b.json")
    preset = configs.get("llama-3-8b")
    for f in ("vocab_size", "n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "rope_theta",
              "tied"):
        assert getattr(cfg, f) == getattr(preset, f), f


def test_qwen2_has_qkv_bias(hf_dir):
    cfg = configs.from_hf_config(hf_dir / "qwen2-0.5b.json")
    assert cfg.qkv_bias and cfg.tied


@pytest.mark.parametrize("changes, message", [
    (dict(d_model=4096, n_heads=24), "hidden size 4096 is not divisible by 24 heads"),
    (dict(n_kv_heads=5), "5 kv heads do not divide 32 query heads"),
    (dict(n_layers=0), "n_layers must be a positive integer"),
    (dict(flavour="mamba"), "flavour 'mamba' is unknown"),
    (dict(n_experts=2, top_k=3), "top_k 3 is larger than the number of experts 2"),
    (dict(head_dim=127), "RoPE needs an even head dimension"),
])
def test_bad_sizes_are_rejected_clearly(changes, message):
    with pytest.raises(ValueError, match=message):
        configs.get("llama-3-8b").with_(**changes)


def test_gpt2_flavour_rejects_gqa_and_moe():
    with pytest.raises(ValueError, match="no grouped-query attention"):
        configs.get("gpt2").with_(n_kv_heads=4)
    with pytest.raises(ValueError, match="no mixture of experts"):
        configs.get("gpt2").with_(n_experts=4, top_k=2)


def test_unknown_preset_and_bad_files(tmp_path):
    with pytest.raises(ValueError, match="unknown model 'llama-9'"):
        configs.resolve("llama-9")
    with pytest.raises(ValueError, match="no config.json"):
        configs.from_hf_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        configs.from_hf_config(bad)
    bert = tmp_path / "bert.json"
    bert.write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="model_type 'bert' is not supported"):
        configs.from_hf_config(bert)
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ValueError, match="lacks"):
        configs.from_hf_config(partial)


def test_folder_with_config_json(hf_dir, tmp_path):
    (tmp_path / "config.json").write_text((hf_dir / "mistral-7b.json").read_text())
    assert configs.resolve(tmp_path).d_model == 4096


@settings(max_examples=60, deadline=None)
@given(kv=st.integers(1, 8), group=st.integers(1, 4), hd=st.sampled_from([8, 16, 32]),
       layers=st.integers(1, 6), ff=st.integers(1, 512), experts=st.integers(1, 8), data=st.data())
def test_counts_are_linear_in_layers(kv, group, hd, layers, ff, experts, data):
    top_k = data.draw(st.integers(1, experts))
    cfg = configs.ModelConfig("x", "llama", 100, layers, kv * group * hd, kv * group, kv, ff,
                              n_experts=experts, top_k=top_k)
    one = configs.param_counts(cfg.with_(n_layers=1))
    c = configs.param_counts(cfg)
    per_layer = one["total"] - one["embedding"] - one["head"] - cfg.d_model
    assert c["total"] == c["embedding"] + c["head"] + cfg.d_model + layers * per_layer
    assert c["active"] <= c["total"]


def test_one_name_per_size_and_defaults_follow_with():
    """n_kv_heads, d_ff and head_dim are always whole numbers once built; a size left to its
    default is derived again by `with_`, an explicit one is kept."""
    cfg = configs.ModelConfig("t", "llama", 256, 2, 64, 4)
    assert (cfg.n_kv_heads, cfg.d_ff, cfg.head_dim) == (4, 256, 16)
    wider = cfg.with_(d_model=128, n_heads=8)
    assert (wider.n_kv_heads, wider.d_ff, wider.head_dim) == (8, 512, 16)
    explicit = configs.ModelConfig("t", "llama", 256, 2, 64, 4, n_kv_heads=2, d_ff=100)
    assert explicit.with_(d_model=128).d_ff == 100 and explicit.with_(n_heads=8).n_kv_heads == 2
    assert configs.ModelConfig(**cfg.to_dict()) == cfg and "_derived" not in cfg.to_dict()
    for gone in ("kv_heads", "dim_head", "ffn_dim"):  # the look-alike second names
        assert not hasattr(cfg, gone)


def test_rope_theta_is_read_from_transformers_v5_rope_parameters():
    """v5 configs keep theta in rope_parameters (v4 at the top level): both are read."""
    from transformers import LlamaConfig

    v5 = LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": 5e5}).to_dict()
    assert "rope_theta" not in v5 or v5.get("rope_theta") is None
    assert configs.from_hf_config(v5).rope_theta == 5e5
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"} | {"rope_theta": 2e5}
    assert configs.from_hf_config(v4).rope_theta == 2e5
