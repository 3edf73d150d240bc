"""Hugging Face interoperability: configs and state dicts (numpy arrays keyed by HF names).

HF linear weights are ``(out, in)``; Flax kernels are ``(in, out)``: conversion transposes them.
Scanned layers are stacked on axis 0 of each leaf and split into ``model.layers.{i}.*`` keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from models.configs import FAMILIES, ModelConfig, replace_config
from models.model import abstract_params

# HF names that carry no parameters (buffers some versions keep in state dicts).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def key_names(path) -> tuple[str, ...]:
    return tuple(getattr(k, "key", getattr(k, "name", str(k))) for k in path)


def _leaf_name(names: tuple[str, ...]) -> tuple[str, bool]:
    """HF name (without the layer prefix) of a Flax leaf path, and whether it is transposed."""
    *mods, leaf = names
    if leaf == "kernel":
        return ".".join(mods) + ".weight", True
    if leaf in ("scale", "embedding"):
        return ".".join(mods) + ".weight", False
    if leaf == "bias":
        return ".".join(mods) + ".bias", False
    raise ValueError(f"unexpected parameter {'/'.join(names)}")


def check_shape(what: str, have: tuple, want, transpose: bool, expecting: str = "the config") -> None:
    """A ``ValueError`` naming ``what`` where an HF tensor's shape ``have`` is not the Flax leaf
    shape ``want`` (``transpose``: the tensor is the leaf's transpose, as a PyTorch weight)."""
    if (have[::-1] if transpose else have) != tuple(want):
        hf_shape = tuple(want)[::-1] if transpose else tuple(want)
        raise ValueError(f"{what} has shape {have}, {expecting} expects {hf_shape}")


def hf_entries(cfg: ModelConfig, path) -> list[tuple[str, int | None, bool]]:
    """``(hf_name, layer_index_or_None, transpose)`` for one Flax leaf (one per layer if scanned)."""
    names = key_names(path)
    if names[0] == "layers":  # scanned: ('layers', 'layer', ...)
        sub, transpose = _leaf_name(names[2:])
        return [(f"model.layers.{i}.{sub}", i, transpose) for i in range(cfg.num_hidden_layers)]
    if names[0].startswith("layers_"):
        sub, transpose = _leaf_name(names[1:])
        return [(f"model.layers.{names[0][7:]}.{sub}", None, transpose)]
    sub, transpose = _leaf_name(names)
    return [(sub if names[0] == "lm_head" else f"model.{sub}", None, transpose)]


def to_hf(cfg: ModelConfig, params: dict[str, Any]) -> dict[str, np.ndarray]:
    """State dict of numpy arrays with HF names (``lm_head.weight`` included when tied, as
    ``transformers``' ``state_dict()`` has it), in the parameters' dtypes. bfloat16 parameters
    give ``ml_dtypes`` bfloat16 arrays, which ``torch.from_numpy`` refuses: for torch, take
    ``torch.from_numpy(x.view(np.uint16)).view(torch.bfloat16)`` (the same bits), or
    :func:`write_hf_dir` and ``from_pretrained``."""
    out: dict[str, np.ndarray] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        arr = np.asarray(leaf)
        for name, layer, transpose in hf_entries(cfg, path):
            x = arr[layer] if layer is not None else arr
            out[name] = np.ascontiguousarray(x.T if transpose else x)
    if cfg.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def _as_numpy(x: Any) -> np.ndarray:
    """A state-dict value as numpy: torch tensors (bf16, on a GPU or requiring grad included,
    which ``np.asarray`` refuses) are detached and copied to the host, bf16 kept exactly."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # a torch tensor, without importing torch
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            return x.float().numpy().astype(jax.numpy.bfloat16)  # bf16 -> f32 -> bf16 is exact
        try:
            return x.numpy()
        except TypeError:  # a dtype numpy has not (float8, ...): named by the caller
            raise ValueError(f"a torch tensor of {x.dtype}, which numpy cannot hold") from None
    return np.asarray(x)


def _loaded(key: str, x: Any) -> np.ndarray:
    """``_as_numpy`` of state-dict entry ``key``, a dtype numpy has not refused naming it."""
    try:
        arr = _as_numpy(x)
    except ValueError as e:
        raise ValueError(
            f"from_hf: {key!r} is {e}; the weights must be float16, bfloat16, float32 or float64"
        ) from None
    if not np.issubdtype(arr.dtype, np.floating) and arr.dtype.name != "bfloat16":
        # an integer tensor (a quantized checkpoint's) would be cast to float as if it were weights
        raise ValueError(
            f"from_hf: {key!r} is {arr.dtype}; the weights must be float16, bfloat16, float32 or float64"
        )
    return arr


# A checkpoint of the base model (``LlamaModel``: no LM head) names its tensors without the
# ``model.`` prefix (transformers' ``base_model_prefix``); transformers loads either spelling.
BASE_PREFIX = "model."


def stored_name(name: str, names) -> str | None:
    """The key under which ``names`` holds HF tensor ``name``: ``name`` itself, or ``name``
    without the base model's ``model.`` prefix; ``None`` when neither is there."""
    if name in names:
        return name
    bare = name.removeprefix(BASE_PREFIX)
    return bare if bare != name and bare in names else None


def listed(names: list[str], first: int = 8) -> str:
    """``names`` for a message: the first ``first``, then how many more."""
    more = f" and {len(names) - first} more" if len(names) > first else ""
    return f"{names[:first]}{more}"


def unexpected_keys(cfg: ModelConfig, names, used: set[str]) -> list[str]:
    """The HF names among ``names`` that ``cfg``'s parameters did not use (sorted), leaving out
    parameter-free buffers and a tied model's copy of the LM head."""
    return sorted(
        k
        for k in names
        if k not in used
        and not k.endswith(_IGNORED_SUFFIXES)
        and not (cfg.tie_word_embeddings and k == "lm_head.weight")
    )


def from_hf(cfg: ModelConfig, state_dict: dict[str, Any]) -> dict[str, Any]:
    """Flax parameters from an HF state dict: numpy arrays, torch tensors (any dtype or device,
    e.g. ``model.state_dict()`` of a bf16 model) or anything ``np.asarray`` takes.

    Raises:
      ValueError: naming missing keys, unexpected keys, or a shape that does not match ``cfg``.
    """
    shapes = abstract_params(cfg)
    used = set()

    def fill(path, spec):
        parts = []
        scanned = key_names(path)[0] == "layers"
        want = spec.shape[1:] if scanned else spec.shape
        for name, _, transpose in hf_entries(cfg, path):
            key = stored_name(name, state_dict)
            if key is None:
                raise ValueError(f"from_hf: missing key {name!r} for config {cfg.name!r}")
            x = _loaded(key, state_dict[key])
            check_shape(f"from_hf: {key!r}", tuple(x.shape), want, transpose, f"config {cfg.name!r}")
            parts.append(x.T if transpose else x)
            used.add(key)
        arr = np.stack(parts) if scanned else parts[0]
        return jax.numpy.asarray(arr, spec.dtype)

    params = jax.tree_util.tree_map_with_path(fill, shapes)
    head = state_dict.get("lm_head.weight")
    embed = state_dict.get(stored_name("model.embed_tokens.weight", state_dict) or "")
    if cfg.tie_word_embeddings and head is not None and embed is not None:
        if not np.array_equal(_loaded("lm_head.weight", head), _loaded("model.embed_tokens.weight", embed)):
            raise ValueError(
                f"from_hf: config {cfg.name!r} ties the embeddings, but the state dict has its own "
                "lm_head.weight (load it with tie_word_embeddings=False)"
            )
    extra = unexpected_keys(cfg, state_dict, used)
    if extra:
        raise ValueError(f"from_hf: unexpected keys for config {cfg.name!r}: {listed(extra)}")
    return params


def _rope(hf_config) -> tuple[float, dict | None]:
    params = getattr(hf_config, "rope_parameters", None)
    if params:  # transformers >= 5
        theta = float(params.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 10000.0)
        kind = params.get("rope_type", "default")
        scaling = None if kind == "default" else {k: v for k, v in params.items() if k != "rope_theta"}
        return theta, scaling
    return float(getattr(hf_config, "rope_theta", 10000.0)), getattr(hf_config, "rope_scaling", None)


def config_errors() -> tuple[type[Exception], ...]:
    """What ``transformers`` raises for a config it refuses: ``ValueError``, and, from
    transformers 5, ``huggingface_hub``'s strict-dataclass errors (a field of the wrong type, a
    shape its validators refuse), which are not ``ValueError``s."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # older huggingface_hub, with transformers 4
        return (ValueError,)
    return (ValueError, StrictDataclassError)


def config_error_line(error: Exception) -> str:
    """One line of a refusal of ``transformers``' (a strict-dataclass error spans lines)."""
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip())


def _sliding_layers(hf_config) -> list[int]:
    """The layers that attend through a sliding window: those ``layer_types`` names so
    (transformers >= 4.54), else, with ``use_sliding_window``, those from ``max_window_layers``
    on (Qwen2's rule before ``layer_types``)."""
    types = getattr(hf_config, "layer_types", None)
    if types is not None:
        return [i for i, kind in enumerate(types) if kind == "sliding_attention"]
    if not getattr(hf_config, "use_sliding_window", False):
        return []
    start = getattr(hf_config, "max_window_layers", 0) or 0
    return list(range(start, hf_config.num_hidden_layers))


def unsupported_family(kind: str) -> str:
    """The refusal of an HF ``model_type`` of no family this library has."""
    return f"unsupported HF model_type {kind!r} (supported: {', '.join(FAMILIES)})"


def config_from_hf(hf_config, **overrides) -> ModelConfig:
    """A :class:`ModelConfig` from a ``transformers`` config (Llama, Qwen2, Qwen3, DeepseekV2),
    or from its dict (``config.json``'s content, with its ``model_type``)."""
    hf_config = _transformers_config(hf_config)
    _refuse_unsupported(hf_config)
    kind = hf_config.model_type
    theta, scaling = _rope(hf_config)
    fields = dict(
        model_type=kind,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_hidden_layers=hf_config.num_hidden_layers,
        num_attention_heads=hf_config.num_attention_heads,
        num_key_value_heads=getattr(hf_config, "num_key_value_heads", None),
        max_position_embeddings=hf_config.max_position_embeddings,
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=hf_config.rms_norm_eps,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(hf_config, "attention_bias", False)),
        initializer_range=hf_config.initializer_range,
        name=f"hf-{kind}",
    )
    head_dim = getattr(hf_config, "head_dim", None)
    if (
        kind != "deepseek_v2"
        and head_dim
        and (kind == "qwen3" or head_dim != hf_config.hidden_size // hf_config.num_attention_heads)
    ):
        fields["head_dim"] = head_dim
    if kind == "deepseek_v2":
        for f in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            fields[f] = getattr(hf_config, f)
    return replace_config(ModelConfig(**fields), **overrides)


def _transformers_config(hf_config):
    """``hf_config`` as a ``transformers`` config (a ``config.json`` dict built with
    ``AutoConfig.for_model``); a ``ValueError`` for anything else."""
    if not isinstance(hf_config, Mapping) and not hasattr(hf_config, "model_type"):
        raise ValueError(
            f"config_from_hf takes a transformers config or a config.json dict, got {hf_config!r} "
            "(a directory or file: models.read_hf_config)"
        )
    if not isinstance(hf_config, Mapping):
        return hf_config
    import transformers

    fields = dict(hf_config)
    if "model_type" not in fields:
        raise ValueError("config_from_hf: a config dict needs its model_type (as config.json has)")
    try:
        return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    except config_errors() as e:
        raise ValueError(f"config_from_hf: {config_error_line(e)}") from None


def _refuse_unsupported(hf_config) -> None:
    """A ``ValueError`` saying what a ``transformers`` config asks for that the models here do
    not have: another family, quantized weights, sliding-window attention, another activation,
    MLP biases, attention dropout, DeepSeek-V2's experts."""
    kind = hf_config.model_type
    if kind not in FAMILIES:
        raise ValueError(unsupported_family(kind))
    quantized = getattr(hf_config, "quantization_config", None)
    if quantized:
        method = quantized.get("quant_method") if isinstance(quantized, Mapping) else None
        raise ValueError(
            f"quantized checkpoints are not supported (quantization_config, quant_method {method!r}): "
            "load it with transformers, dequantize it and save_pretrained it again"
        )
    sliding = _sliding_layers(hf_config)
    if sliding:
        raise ValueError(
            f"sliding-window attention is not supported: layers {sliding} use it (use_sliding_window, "
            "max_window_layers, layer_types)"
        )
    act = getattr(hf_config, "hidden_act", "silu")
    if act not in ("silu", "swish"):  # transformers' ACT2FN: both are SiLU
        raise ValueError(f"only the SiLU (SwiGLU) MLP is supported, got hidden_act={act!r}")
    if getattr(hf_config, "mlp_bias", False):
        raise ValueError("MLP biases are not supported (mlp_bias=True)")
    dropout = getattr(hf_config, "attention_dropout", 0.0) or 0.0
    if dropout:  # an export would say 0.0: the models here have no dropout
        raise ValueError(
            f"attention dropout is not supported (attention_dropout={dropout!r}): the models train "
            "without dropout; set it to 0.0 to load the weights"
        )
    dense = getattr(hf_config, "first_k_dense_replace", 0)
    if kind == "deepseek_v2" and dense < hf_config.num_hidden_layers:
        raise ValueError(
            "only the dense DeepSeek-V2 variant is supported (first_k_dense_replace >= "
            f"num_hidden_layers): this one has mixture-of-experts layers from layer {dense} "
            f"(first_k_dense_replace={dense}, num_hidden_layers={hf_config.num_hidden_layers})"
        )


def to_hf_config(cfg: ModelConfig):
    """The ``transformers`` config for ``cfg`` (imports ``transformers``).

    Raises:
      ValueError: ``transformers`` refuses the config (in one line)."""
    try:
        return _to_hf_config(cfg)
    except config_errors() as e:
        refusal = config_error_line(e)
        raise ValueError(f"transformers refuses the {cfg.model_type} config: {refusal}") from None


def _to_hf_config(cfg: ModelConfig):
    import transformers

    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        initializer_range=cfg.initializer_range,
    )
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        rope = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    if cfg.model_type == "llama":
        return transformers.LlamaConfig(
            **common, head_dim=cfg.head_size, attention_bias=cfg.attention_bias, rope_parameters=rope
        )
    if cfg.model_type == "qwen2":
        return transformers.Qwen2Config(**common, head_dim=cfg.head_size, rope_parameters=rope)
    if cfg.model_type == "qwen3":
        return transformers.Qwen3Config(
            **common, head_dim=cfg.head_size, attention_bias=cfg.attention_bias, rope_parameters=rope
        )
    return transformers.DeepseekV2Config(
        **common,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        first_k_dense_replace=cfg.num_hidden_layers,
        attention_bias=cfg.attention_bias,
        rope_parameters=rope,
    )
