"""Flax models against ``transformers`` (CPU torch): logits parity through ``from_hf``, exact
state-dict round trips, scanned == unscanned, parameter counts, bf16."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models.hf import config_errors

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SMALL = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
)
CASES = {
    "llama2-mha-untied": models.ModelConfig(model_type="llama", **SMALL),
    "llama3.2-gqa-tied-rope-scaling": models.ModelConfig(
        model_type="llama",
        num_key_value_heads=2,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        **SMALL,
    ),
    "qwen2.5-gqa4-bias-tied": models.ModelConfig(
        model_type="qwen2", num_key_value_heads=1, rope_theta=1e6, tie_word_embeddings=True, **SMALL
    ),
    "qwen3-explicit-head-dim": models.ModelConfig(
        model_type="qwen3", num_key_value_heads=2, head_dim=24, rope_theta=1e6, **SMALL
    ),
    "llama-attention-bias": models.ModelConfig(model_type="llama", attention_bias=True, **SMALL),
    "qwen3-attention-bias-eps": models.ModelConfig(
        model_type="qwen3", attention_bias=True, rms_norm_eps=1e-5, head_dim=16, **SMALL
    ),
    "qwen2-explicit-head-dim": models.ModelConfig(model_type="qwen2", head_dim=24, **SMALL),
    "deepseek-v2-mla": models.ModelConfig(
        model_type="deepseek_v2",
        q_lora_rank=40,
        kv_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        **SMALL,
    ),
}
# HF's latent norms keep eps 1e-6 whatever rms_norm_eps says.
CASES["deepseek-v2-mla-eps"] = dataclasses.replace(CASES["deepseek-v2-mla"], rms_norm_eps=1e-2)
# A value head wider than the query/key head (16 + 8).
CASES["deepseek-v2-mla-wide-v"] = dataclasses.replace(CASES["deepseek-v2-mla"], v_head_dim=40)
# Queries without the low-rank path (DeepSeek-V2-Lite's), biases, tied embeddings.
CASES["deepseek-v2-no-q-lora-bias-tied"] = dataclasses.replace(
    CASES["deepseek-v2-mla"], q_lora_rank=None, attention_bias=True, tie_word_embeddings=True
)


def _hf_model(cfg, seed=0):
    torch.manual_seed(seed)
    hf_cfg = models.to_hf_config(cfg)
    hf_cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
    with torch.no_grad():  # random norms and biases too, so every parameter is exercised
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _state_dict(model):
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow
def test_logits_match_transformers(case):
    cfg = CASES[case]
    model = _hf_model(cfg)
    # past llama3 scaling's original_max_position_embeddings (32)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 40))
    with torch.no_grad():
        want = model(torch.from_numpy(tokens)).logits.numpy()
    for scan in (False, True):
        c = dataclasses.replace(cfg, scan_layers=scan)
        params = models.from_hf(c, _state_dict(model))
        got = np.asarray(models.forward(c, params, jnp.asarray(tokens, jnp.int32)))
        rel = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert rel < 1e-4, (case, scan, rel)


@pytest.mark.parametrize("case", list(CASES))
def test_state_dict_round_trip_is_exact(case):
    cfg = CASES[case]
    sd = _state_dict(_hf_model(cfg, seed=1))
    for scan in (False, True):
        back = models.to_hf(
            dataclasses.replace(cfg, scan_layers=scan),
            models.from_hf(dataclasses.replace(cfg, scan_layers=scan), sd),
        )
        assert set(back) == {k for k in sd if not k.endswith("inv_freq")}
        for k, v in back.items():
            np.testing.assert_array_equal(v, sd[k], err_msg=k)


@pytest.mark.parametrize("case", list(CASES))
def test_config_from_hf_round_trip(case):
    cfg = CASES[case]
    back = models.config_from_hf(models.to_hf_config(cfg))
    # every field (rope_scaling, head_dim, MLA dims, eps ...) except the name; HF always spells
    # out num_key_value_heads
    want = dataclasses.replace(cfg, num_key_value_heads=cfg.kv_heads, name=back.name)
    assert dataclasses.asdict(back) == dataclasses.asdict(want)


def test_mla_without_q_lora_matches_transformers():
    cfg = dataclasses.replace(CASES["deepseek-v2-mla"], q_lora_rank=None)
    model = _hf_model(cfg, seed=2)
    assert "model.layers.0.self_attn.q_proj.weight" in model.state_dict()
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        want = model(torch.from_numpy(tokens)).logits.numpy()
    got = np.asarray(models.forward(cfg, models.from_hf(cfg, _state_dict(model)), jnp.asarray(tokens)))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-4


def test_from_hf_takes_a_bf16_torch_state_dict_as_is():
    """``model.state_dict()`` of a bf16 model (torch tensors numpy cannot take) loads exactly."""
    cfg = CASES["llama2-mha-untied"]
    model = _hf_model(cfg, seed=4).to(torch.bfloat16)
    sd = model.state_dict()
    assert any(v.dtype == torch.bfloat16 for v in sd.values())
    got = models.from_hf(cfg, sd)
    want = models.from_hf(cfg, {k: v.float().numpy() for k, v in sd.items()})
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    # A tensor that requires grad (a parameter, not a state-dict copy) loads too.
    params = dict(model.named_parameters())
    embed = models.from_hf(cfg, {**sd, "model.embed_tokens.weight": params["model.embed_tokens.weight"]})
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), embed, got))


def test_a_base_model_state_dict_and_a_config_dict_load_as_transformers_loads_them():
    """``LlamaModel``'s state dict names its tensors without the ``model.`` prefix (and has no LM
    head): with the head added, it loads as the causal LM's does. A config may be given as the
    dict ``config.json`` holds."""
    cfg = CASES["llama2-mha-untied"]
    sd = _state_dict(_hf_model(cfg, seed=3))
    base = {k.removeprefix("model."): v for k, v in sd.items()}
    got, want = models.from_hf(cfg, base), models.from_hf(cfg, sd)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    as_dict = models.to_hf_config(cfg).to_dict()
    assert models.config_from_hf(as_dict, name=cfg.name) == models.config_from_hf(
        models.to_hf_config(cfg), name=cfg.name
    )
    with pytest.raises(ValueError, match="a config dict needs its model_type"):
        models.config_from_hf({k: v for k, v in as_dict.items() if k != "model_type"})
    with pytest.raises(ValueError, match=r"unexpected keys for config .*\] and 2 more"):
        models.from_hf(cfg, {**sd, **{f"extra.{i}": np.zeros(1) for i in range(10)}})


def test_from_hf_names_a_tensor_that_does_not_fit_by_its_hf_name_and_shape():
    """A wrong shape was named by the Flax path with the transposed shape, and a float8 tensor
    ended in torch's own TypeError."""
    cfg = CASES["llama2-mha-untied"]
    sd = _state_dict(_hf_model(cfg, seed=3))
    name = "model.layers.1.mlp.up_proj.weight"
    want = tuple(sd[name].shape)
    cut = {**sd, name: sd[name][:, :-1]}
    message = (
        rf"from_hf: '{re.escape(name)}' has shape \({want[0]}, {want[1] - 1}\), config .* expects "
        rf"\({want[0]}, {want[1]}\)"
    )
    for scan in (True, False):
        with pytest.raises(ValueError, match=message):
            models.from_hf(dataclasses.replace(cfg, scan_layers=scan), cut)
    fp8 = {**_hf_model(cfg, seed=3).state_dict()}
    fp8[name] = fp8[name].to(torch.float8_e4m3fn)
    with pytest.raises(
        ValueError, match=rf"from_hf: '{re.escape(name)}' is a torch tensor of torch.float8_e4m3fn"
    ):
        models.from_hf(cfg, fp8)


def test_token_ids_outside_the_vocabulary_are_refused_not_read_as_nan_or_wrapped():
    """An id past the table gave NaN logits at every position (through attention) and a
    negative one read the table's last row; both are refused when the ids are concrete, as
    transformers refuses them. Traced ids (under jit) are not checked."""
    cfg = models.get_config("llama2-tiny")
    params = models.init_params(cfg, jax.random.PRNGKey(0))
    good = jnp.asarray([[1, 2, 3]])
    for bad in (cfg.vocab_size, -1):
        tokens = good.at[0, 2].set(bad)
        with pytest.raises(
            ValueError,
            match=rf"tokens hold ids from {min(bad, 1)} to {max(bad, 2)}, outside the model's "
            rf"vocabulary \[0, {cfg.vocab_size}\)",
        ):
            models.forward(cfg, params, tokens)
        with pytest.raises(ValueError, match="labels hold ids"):
            models.token_nll(cfg, params, good, tokens)
    assert bool(
        jnp.isnan(jax.jit(lambda t: models.forward(cfg, params, t))(good.at[0, 2].set(cfg.vocab_size))).any()
    )
    with pytest.raises(ValueError, match=r"tokens must be \(batch, seq\) integers, got shape \(3,\)"):
        models.forward(cfg, params, good[0])
    assert models.forward(cfg, params, good).shape == (1, 3, cfg.vocab_size)


@pytest.mark.parametrize(
    "override, message",
    [
        ({"num_key_value_heads": -2}, "num_key_value_heads must be a positive integer or null, got -2"),
        ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer or null, got 0"),
        ({"head_dim": 0}, "head_dim must be a positive integer or null, got 0"),
        ({"head_dim": 7}, "the head width must be even for RoPE's pairs, got 7"),
        ({"max_position_embeddings": 0}, "max_position_embeddings must be a positive integer, got 0"),
        ({"num_hidden_layers": True}, "num_hidden_layers must be a positive integer, got True"),
    ],
)
def test_bad_model_sizes_are_refused_with_the_config(override, message):
    """Refused when the config is made (a ``--set model.overrides`` typo), not as a shape error
    deep in the first forward pass."""
    with pytest.raises(ValueError, match=re.escape(message)):
        models.get_config("llama3.2-tiny", **override)


@pytest.mark.parametrize(
    "preset, shape",
    [
        ("llama2-tiny", {"hidden_size": 66, "num_attention_heads": 4, "head_dim": 16}),
        ("llama2-tiny", {"hidden_size": 64, "num_attention_heads": 4, "head_dim": 16}),
        ("qwen3-tiny", {"hidden_size": 66, "num_attention_heads": 4, "head_dim": 16}),
        (
            "qwen2.5-tiny",
            {"hidden_size": 66, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
        ),
        ("deepseek-v2-tiny", {"hidden_size": 66, "num_attention_heads": 4, "num_key_value_heads": None}),
        ("deepseek-v2-tiny", {"hidden_size": 64, "num_attention_heads": 3, "num_key_value_heads": None}),
        ("deepseek-v2-tiny", {"qk_rope_head_dim": 7}),
        ("deepseek-v2-tiny", {"qk_rope_head_dim": 6}),
    ],
)
def test_a_model_shape_is_refused_exactly_when_transformers_refuses_it(preset, shape):
    """A model is never trained that transformers' config refuses, so that it could not be
    exported: LlamaConfig and DeepseekV2Config require the hidden size to be a multiple of the
    heads even with ``head_dim`` set, Qwen's do not; MLA's rotary width must be even."""
    try:
        cfg = models.get_config(preset, **shape)
    except ValueError as e:
        ours = str(e)
    else:
        ours = None
    base = models.to_hf_config(models.get_config(preset)).to_dict()
    keys = {k: v for k, v in shape.items() if v is not None}
    try:
        type(models.to_hf_config(models.get_config(preset)))(**{**base, **keys})
    except config_errors() as e:
        theirs = str(e)
    else:
        theirs = None
    assert (ours is None) == (theirs is None), (ours, theirs)
    if ours is None:
        models.to_hf_config(cfg)  # and its own config is taken too


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("param_dtype", "bf16", "param_dtype must be one of ('float32', 'bfloat16', 'float16'), got 'bf16'"),
        ("dtype", "float64", "dtype must be one of ('float32', 'bfloat16', 'float16'), got 'float64'"),
        ("dtype", "int8", "dtype must be one of"),
    ],
)
def test_dtypes_are_named_not_failed_on_in_the_first_forward(field, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        models.get_config("llama2-tiny", **{field: value})


def test_unsupported_hf_features_are_refused():
    # Qwen2's window from max_window_layers on: refused where a layer uses it, read where none does.
    qwen = {k: v for k, v in models.to_hf_config(CASES["qwen2.5-gqa4-bias-tied"]).to_dict().items()}
    qwen.pop("layer_types", None)  # made again from the settings below
    layers = qwen["num_hidden_layers"]
    windowed = transformers.Qwen2Config(
        **{**qwen, "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}
    )
    with pytest.raises(
        ValueError,
        match=re.escape(f"sliding-window attention is not supported: layers {list(range(1, layers))}"),
    ):
        models.config_from_hf(windowed)
    unused = transformers.Qwen2Config(
        **{**qwen, "use_sliding_window": True, "sliding_window": 16, "max_window_layers": layers}
    )
    assert models.config_from_hf(unused) == models.config_from_hf(transformers.Qwen2Config(**qwen))
    # The dense DeepSeek-V2 only: the message says where the experts begin.
    moe = models.to_hf_config(CASES["deepseek-v2-mla"])
    moe.first_k_dense_replace = 1
    with pytest.raises(
        ValueError, match=r"mixture-of-experts layers from layer 1 \(first_k_dense_replace=1, num_hidden"
    ):
        models.config_from_hf(moe)
    with pytest.raises(ValueError, match="rope_scaling"):
        models.get_config("deepseek-v2-tiny", rope_scaling={"rope_type": "yarn", "factor": 4.0})
    # MLA's per-head keys: grouped heads were accepted, ignored, and the export failed in HF.
    heads = models.get_config("deepseek-v2-tiny").num_attention_heads
    assert models.get_config("deepseek-v2-tiny", num_key_value_heads=heads).kv_heads == heads
    with pytest.raises(
        ValueError, match=r"deepseek_v2: num_key_value_heads must be null or num_attention_heads"
    ):
        models.get_config("deepseek-v2-tiny", num_key_value_heads=heads // 2)
    # Refused with the config, before any parameter exists (HF's linear/dynamic/yarn scalings).
    for kind in ("linear", "dynamic", "yarn"):
        scaled = models.to_hf_config(CASES["llama2-mha-untied"])
        if getattr(scaled, "rope_parameters", None):  # transformers >= 5
            scaled.rope_parameters = {**scaled.rope_parameters, "rope_type": kind, "factor": 2.0}
        else:
            scaled.rope_scaling = {"rope_type": kind, "factor": 2.0}
        with pytest.raises(ValueError, match=f"unsupported rope_scaling type '{kind}'"):
            models.config_from_hf(scaled)
    with pytest.raises(ValueError, match="needs \\['low_freq_factor', 'high_freq_factor', 'original_max_pos"):
        models.get_config("llama3.2-tiny", rope_scaling={"rope_type": "llama3", "factor": 8.0})
    complete = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
    }
    no_high = {"rope_type": "llama3", **{k: v for k, v in complete.items() if k != "high_freq_factor"}}
    with pytest.raises(ValueError, match="needs \\['high_freq_factor'\\]"):  # transformers requires it too
        models.get_config("llama3.2-tiny", rope_scaling=no_high)
    with pytest.raises(ValueError, match="low_freq_factor < high_freq_factor"):
        models.get_config(
            "llama3.2-tiny", rope_scaling={"rope_type": "llama3", **complete, "low_freq_factor": 4.0}
        )
    swish = models.to_hf_config(CASES["llama2-mha-untied"])
    swish.hidden_act = "swish"  # transformers' name for SiLU too
    assert models.config_from_hf(swish) == models.config_from_hf(
        models.to_hf_config(CASES["llama2-mha-untied"])
    )
    gelu = models.to_hf_config(CASES["llama2-mha-untied"])
    gelu.hidden_act = "gelu"
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        models.config_from_hf(gelu)
    biased = models.to_hf_config(CASES["llama2-mha-untied"])
    biased.mlp_bias = True
    with pytest.raises(ValueError, match="mlp_bias"):
        models.config_from_hf(biased)
    dropped = models.to_hf_config(CASES["llama2-mha-untied"])
    dropped.attention_dropout = 0.3  # accepted and exported as 0.0, it was
    with pytest.raises(ValueError, match=r"attention dropout is not supported \(attention_dropout=0.3\)"):
        models.config_from_hf(dropped)


def test_a_separate_lm_head_is_not_dropped_under_a_tied_config():
    untied = CASES["llama2-mha-untied"]
    sd = _state_dict(_hf_model(untied, seed=3))
    tied = dataclasses.replace(untied, tie_word_embeddings=True)
    with pytest.raises(ValueError, match="own lm_head.weight"):
        models.from_hf(tied, sd)


PAPER = [
    "llama2-60m",
    "llama2-130m",
    "llama2-350m",
    "llama2-1b",
    "llama2-7b",
    "llama3.2-300m",
    "qwen2.5-350m",
    "qwen3-350m",
    "deepseek-v2-350m",
]


@pytest.mark.parametrize("name", PAPER)
def test_param_count_equals_transformers(name):
    cfg = models.get_config(name)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(models.to_hf_config(cfg))
    assert models.param_count(cfg) == sum(p.numel() for p in hf.parameters())


def test_llama3_2_preset_has_the_released_rope():
    """The Llama 3.2 preset's RoPE is the released models' (llama3 scaling): its frequencies are
    transformers' for the exported config, and differ from unscaled RoPE at the same theta."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from models.layers import inv_frequencies

    cfg = models.get_config("llama3.2-300m")
    hf_config = models.to_hf_config(cfg)
    assert hf_config.rope_scaling["rope_type"] == "llama3"
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    got = inv_frequencies(cfg.head_size, cfg.rope_theta, cfg.rope_scaling)
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-6)
    assert not np.allclose(got, inv_frequencies(cfg.head_size, cfg.rope_theta, None), rtol=1e-3)


@pytest.mark.slow
def test_scanned_and_unscanned_params_give_same_logits():
    cfg = models.get_config("qwen3-tiny")
    unscanned = models.init_params(cfg, jax.random.PRNGKey(0))
    sd = models.to_hf(cfg, unscanned)
    scanned_cfg = cfg.replace(scan_layers=True)
    scanned = models.from_hf(scanned_cfg, sd)
    tokens = jnp.arange(24, dtype=jnp.int32).reshape(2, 12)
    np.testing.assert_allclose(
        models.forward(cfg, unscanned, tokens),
        models.forward(scanned_cfg, scanned, tokens),
        rtol=1e-5,
        atol=1e-5,
    )
    remat = scanned_cfg.replace(remat="full")
    np.testing.assert_allclose(
        models.forward(remat, scanned, tokens),
        models.forward(scanned_cfg, scanned, tokens),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize("name", ["llama2-tiny", pytest.param("deepseek-v2-tiny", marks=pytest.mark.slow)])
def test_bf16_forward_is_finite_and_close(name):
    cfg = models.get_config(name)
    params = models.init_params(cfg, jax.random.PRNGKey(0))
    tokens = jnp.arange(32, dtype=jnp.int32).reshape(2, 16)
    f32 = models.forward(cfg, params, tokens)
    bf_cfg = cfg.replace(param_dtype="bfloat16", dtype="bfloat16")
    bf_params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    bf16 = models.forward(bf_cfg, bf_params, tokens)
    assert bf16.dtype == jnp.float32 and np.isfinite(np.asarray(bf16)).all()
    assert np.linalg.norm(bf16 - f32) / np.linalg.norm(f32) < 2e-2


def test_config_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown model 'llama9'"):
        models.get_config("llama9")
    with pytest.raises(ValueError, match="hiden_size"):
        models.get_config("tiny", hiden_size=3)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        models.get_config("tiny", num_key_value_heads=3)
    with pytest.raises(ValueError, match="missing key"):
        models.from_hf(models.get_config("tiny"), {})


LLAMA3 = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def test_a_config_with_rope_scaling_is_a_static_argument_of_jit():
    """A Llama 3 config (rope_scaling set) is hashable, as jit's static arguments must be (its
    dict made jax.jit(forward, static_argnums=0) fail); it reads, serializes and compares as a dict."""
    import copy
    import json
    import pickle

    cfg = models.get_config("llama3.2-tiny", rope_scaling=dict(LLAMA3))
    params = models.init_params(cfg, jax.random.PRNGKey(0))
    tokens = jnp.zeros((1, 8), jnp.int32)
    logits = jax.jit(models.forward, static_argnums=0)(cfg, params, tokens)
    # jit fuses what the eager call runs op by op: float32 rounding may differ by an ulp (1.2e-7
    # measured in one of the suite's runs), so the two are compared within a few ulps.
    np.testing.assert_allclose(logits, models.forward(cfg, params, tokens), rtol=0, atol=1e-6)
    assert (
        cfg.rope_scaling == LLAMA3
        and json.loads(json.dumps(dataclasses.asdict(cfg)["rope_scaling"])) == LLAMA3
    )
    assert hash(cfg) == hash(models.get_config("llama3.2-tiny", rope_scaling=dict(LLAMA3)))
    assert pickle.loads(pickle.dumps(cfg)) == cfg == copy.deepcopy(cfg)
    with pytest.raises(TypeError, match="read-only"):
        cfg.rope_scaling["factor"] = 8.0


@pytest.mark.parametrize(
    "preset, overrides, message",
    [
        (
            "llama3.2-tiny",
            {"rope_scaling": {**LLAMA3, "partial_rotary_factor": 0.5}},
            "not ['partial_rotary_factor']",
        ),
        ("llama2-tiny", {"rope_scaling": {"rope_type": "default", "factor": 8.0}}, "not ['factor']"),
        ("llama2-tiny", {"rope_theta": float("inf")}, "rope_theta must be a positive finite number"),
        ("deepseek-v2-tiny", {"head_dim": 8}, "deepseek_v2 does not use head_dim"),
        (
            "llama2-tiny",
            {"kv_lora_rank": 16, "qk_rope_head_dim": 3},
            "llama does not use kv_lora_rank, qk_rope",
        ),
        ("qwen3-tiny", {"q_lora_rank": 8}, "qwen3 does not use q_lora_rank"),
    ],
)
def test_settings_the_model_would_ignore_are_refused(preset, overrides, message):
    """Fields and rope_scaling keys a family does not read are refused in one line: ignored,
    they changed nothing here and an export carried them to transformers (partial_rotary_factor
    in a llama3 rope_scaling made transformers fail on the export)."""
    with pytest.raises(ValueError, match=re.escape(message)):
        models.get_config(preset, **overrides)


def test_from_hf_refuses_integer_tensors_and_config_from_hf_a_name():
    cfg = models.get_config("tiny")
    sd = {
        k: np.asarray(v) for k, v in models.to_hf(cfg, models.init_params(cfg, jax.random.PRNGKey(0))).items()
    }
    key = next(k for k in sd if "q_proj" in k)
    with pytest.raises(ValueError, match=re.escape(f"from_hf: {key!r} is int8; the weights must be")):
        models.from_hf(cfg, {**sd, key: sd[key].astype(np.int8)})
    with pytest.raises(ValueError, match="config_from_hf takes a transformers config or a config.json dict"):
        models.config_from_hf("meta-llama/Llama-3.2-1B")


def test_linear_layers_are_labelled_for_the_optimizer():
    import moara_jax as mj

    for name, types in (("llama2-tiny", mj.LLAMA_MODULE_TYPES), ("deepseek-v2-tiny", mj.MLA_MODULE_TYPES)):
        for scan in (False, True):
            params = models.abstract_params(models.get_config(name, scan_layers=scan))
            labels = set(jax.tree.leaves(mj.label_tree(params))) - {"other"}
            assert labels == set(types), (name, labels)


def test_attention_default_is_cudnn_only_where_it_applies():
    bf16 = models.get_config("llama2-350m", param_dtype="bfloat16", dtype="bfloat16")
    pick = models.attention_implementation
    assert pick(bf16, "cuda") == "cudnn"
    assert pick(bf16, "cpu") == pick(bf16, "tpu") == pick(bf16, "rocm") == "xla"
    assert pick(bf16.replace(dtype="float32"), "cuda") == "xla"  # cuDNN's flash attention: bf16/fp16
    assert pick(bf16.replace(head_dim=36), "cuda") == "xla"  # not a multiple of 8
    assert pick(bf16.replace(head_dim=160), "cuda") == "xla"  # wider than 128
    assert pick(bf16.replace(head_dim=128), "cuda") == "cudnn"
    assert pick(bf16, "cuda", compute_capability=7.5) == "xla"  # before Ampere: no flash attention
    assert pick(bf16, "cuda", compute_capability=9.0) == "cudnn"
    # MLA runs at the wider of its query/key (64 + 32) and value (64) widths.
    mla = models.get_config("deepseek-v2-350m", dtype="bfloat16")
    assert pick(mla, "cuda") == "cudnn" and pick(mla.replace(qk_rope_head_dim=36), "cuda") == "xla"
    # An explicit choice is kept wherever it is asked for.
    assert pick(bf16.replace(attention_impl="xla"), "cuda") == "xla"
    assert pick(bf16.replace(attention_impl="cudnn"), "cpu") == "cudnn"
    # Without a platform, the default backend's (this machine's) decides.
    expected = "cudnn" if models.layers.default_platform() == "cuda" else "xla"
    assert pick(bf16) == expected
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        models.get_config("tiny", attention_impl="flash")


def test_default_attention_on_cpu_is_the_xla_path():
    cfg = models.get_config("llama2-tiny", param_dtype="bfloat16", dtype="bfloat16")
    if models.layers.default_platform() == "cuda":
        pytest.skip("on a CUDA GPU the default is cuDNN (tests/test_gpu.py compares the two)")
    params = models.init_params(cfg, jax.random.PRNGKey(0))
    tokens = jnp.arange(64, dtype=jnp.int32).reshape(2, 32)
    default = models.forward(cfg, params, tokens)
    xla = models.forward(cfg.replace(attention_impl="xla"), params, tokens)
    np.testing.assert_array_equal(np.asarray(default), np.asarray(xla))
