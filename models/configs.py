"""Model configurations: a frozen dataclass with Hugging Face field names, and named presets."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

FAMILIES = ("llama", "qwen2", "qwen3", "deepseek_v2")
REMAT_POLICIES = ("none", "full", "dots")
DTYPES = ("float32", "bfloat16", "float16")  # of the parameters and the computation, by name
ATTENTION_IMPLS = (None, "xla", "cudnn")  # None: cuDNN where it applies on a CUDA GPU, else XLA


# DeepSeek-V2's MLA dimensions: needed there (with q_lora_rank optional), unused elsewhere.
MLA_DIMENSIONS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only model. Field names follow ``transformers``' configs.

    ``model_type`` picks the family: ``llama`` (Llama 2 / 3.2), ``qwen2`` (q/k/v biases),
    ``qwen3`` (per-head q/k RMSNorm, explicit ``head_dim``) or ``deepseek_v2`` (MLA, dense MLP).
    Framework options: ``param_dtype``, ``dtype`` (compute), ``scan_layers``, ``remat``
    (``none | full | dots``), ``attention_impl``: ``None`` picks cuDNN's flash attention on a
    CUDA GPU where it applies (bf16/fp16 compute, head width a multiple of 8 up to 128) and XLA's
    otherwise (see ``models.attention_implementation``); ``'xla'`` or ``'cudnn'`` force one; and
    ``loss_chunk``: ``models.cross_entropy`` computes the LM head and the loss this many positions
    at a time and recomputes them in the backward pass, so no ``(batch, seq, vocab)`` logits are
    held (0: all positions at once).
    """

    model_type: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 1024
    intermediate_size: int = 2736
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    initializer_range: float = 0.02
    # DeepSeek-V2 Multi-head Latent Attention
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    # framework options
    param_dtype: str = "float32"
    dtype: str = "float32"
    scan_layers: bool = False
    remat: str = "none"
    attention_impl: str | None = None
    loss_chunk: int = 0
    name: str = field(default="custom", compare=False)

    def __post_init__(self):
        self._check_fields()
        self._check_unused()
        self._check_heads()
        if self.model_type == "deepseek_v2":
            self._check_mla()
        self._check_rope_scaling()
        if self.rope_scaling is not None:  # hashable, as a jit static argument must be
            object.__setattr__(self, "rope_scaling", RopeScaling(self.rope_scaling))

    def _check_fields(self) -> None:
        """Each field's type and range, alone."""
        if self.model_type not in FAMILIES:
            raise ValueError(f"model_type must be one of {FAMILIES}, got {self.model_type!r}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat must be one of {REMAT_POLICIES}, got {self.remat!r}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}")
        if isinstance(self.loss_chunk, bool) or not isinstance(self.loss_chunk, int) or self.loss_chunk < 0:
            raise ValueError(f"loss_chunk must be a non-negative integer, got {self.loss_chunk!r}")
        for f in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "max_position_embeddings",
        ):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f} must be a positive integer, got {v!r}")
        for f in (  # None: the family's default, or not MLA
            "num_key_value_heads",
            "head_dim",
            "q_lora_rank",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
        ):
            v = getattr(self, f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{f} must be a positive integer or null, got {v!r}")
        for f, what, ok in (
            ("rope_theta", "positive finite", lambda v: 0 < v < math.inf),
            ("rms_norm_eps", "positive", lambda v: v > 0),
            ("initializer_range", "non-negative", lambda v: v >= 0),
        ):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int | float) or not ok(v):
                raise ValueError(f"{f} must be a {what} number, got {v!r}")
        for f in ("tie_word_embeddings", "attention_bias", "scan_layers"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"{f} must be true or false, got {getattr(self, f)!r}")
        for f in ("param_dtype", "dtype"):
            if getattr(self, f) not in DTYPES:
                raise ValueError(f"{f} must be one of {DTYPES}, got {getattr(self, f)!r}")

    def _check_heads(self) -> None:
        """The heads against the width, RoPE's pairs and the key-value heads."""
        if self.hidden_size % self.num_attention_heads and (
            self.model_type in ("llama", "deepseek_v2") or self.head_dim is None
        ):
            # transformers' LlamaConfig and DeepseekV2Config refuse it even with head_dim set: such
            # a model could not be exported (qwen2 and qwen3 take head_dim instead).
            instead = ", or set head_dim" if self.model_type in ("qwen2", "qwen3") else ""
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads}){instead}"
            )
        rotary = self.qk_rope_head_dim if self.model_type == "deepseek_v2" else self.head_size
        if rotary is not None and rotary % 2:
            what = "qk_rope_head_dim" if self.model_type == "deepseek_v2" else "the head width"
            raise ValueError(f"{what} must be even for RoPE's pairs, got {rotary}")
        if self.num_attention_heads % self.kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.kv_heads})"
            )

    def _check_unused(self) -> None:
        """A field the family does not read is refused, not ignored."""
        candidates = ("head_dim",) if self.model_type == "deepseek_v2" else ("q_lora_rank", *MLA_DIMENSIONS)
        unused = [f for f in candidates if getattr(self, f) is not None]
        if unused:
            raise ValueError(f"{self.model_type} does not use {', '.join(unused)} (set to null)")

    def _check_mla(self) -> None:
        """DeepSeek-V2's MLA: its dimensions given, plain RoPE, a key and value per head."""
        for f in MLA_DIMENSIONS:
            if not getattr(self, f):
                raise ValueError(f"deepseek_v2 needs {f}")
        if self.rope_scaling:  # HF's yarn scaling also changes MLA's softmax scale
            raise ValueError("deepseek_v2: rope_scaling is not supported (plain RoPE only)")
        if self.kv_heads != self.num_attention_heads:  # HF would repeat MLA's keys again
            raise ValueError(
                f"deepseek_v2: num_key_value_heads must be null or num_attention_heads "
                f"({self.num_attention_heads}): MLA gives every head its own key and value, got "
                f"{self.num_key_value_heads}"
            )

    def _check_rope_scaling(self) -> None:
        """``rope_scaling``: none, or the ``llama3`` type with its four numbers."""
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise ValueError(f"rope_scaling must be a mapping or null, got {self.rope_scaling!r}")
        kind = rope_scaling_type(self.rope_scaling)
        if kind not in ("default", "llama3"):
            raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, llama3)")
        # Keys the model does not read are refused (an export would carry them to transformers,
        # which may read them otherwise, e.g. partial_rotary_factor).
        needed = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        known = {"rope_type", "type", *(needed if kind == "llama3" else ())}
        unknown = sorted(set(self.rope_scaling or {}) - known)
        if unknown:
            raise ValueError(
                f"rope_scaling of type {kind!r} takes {sorted(known)}, not {unknown} "
                "(RoPE's base is rope_theta)"
            )
        if kind == "llama3":
            # All four, as transformers requires them (an export without them would not load).
            missing = [k for k in needed if k not in self.rope_scaling]
            if missing:
                raise ValueError(f"rope_scaling of type 'llama3' needs {missing}")
            for k in needed:
                v = self.rope_scaling[k]
                if isinstance(v, bool) or not isinstance(v, int | float) or not (0 < v < math.inf):
                    raise ValueError(f"rope_scaling {k} must be a positive number, got {v!r}")
            if not self.rope_scaling["low_freq_factor"] < self.rope_scaling["high_freq_factor"]:
                raise ValueError("rope_scaling of type 'llama3' needs low_freq_factor < high_freq_factor")

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def replace(self, **overrides) -> ModelConfig:
        return replace_config(self, **overrides)


class RopeScaling(dict):
    """A ``rope_scaling`` mapping that is hashable and read-only, so that a :class:`ModelConfig`
    holding one is a static argument of ``jax.jit``; a ``dict`` still (JSON, ``==`` a dict)."""

    def __hash__(self):
        return hash(tuple(sorted((k, repr(v)) for k, v in self.items())))

    def _read_only(self, *args, **kwargs):
        raise TypeError("a ModelConfig's rope_scaling is read-only: use cfg.replace(rope_scaling=...)")

    __setitem__ = __delitem__ = __ior__ = _read_only
    clear = pop = popitem = setdefault = update = _read_only

    def __reduce__(self):  # pickles and copies as a plain dict would, then read-only again
        return (RopeScaling, (dict(self),))


def rope_scaling_type(scaling: dict | None) -> str:
    """HF's rope scaling type of a ``rope_scaling`` dict (``rope_type``, or the older ``type``);
    ``'default'`` for none."""
    scaling = scaling or {}
    return scaling.get("rope_type", scaling.get("type")) or "default"


def replace_config(cfg: ModelConfig, **overrides) -> ModelConfig:
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ValueError(f"unknown model config field(s) {unknown}; valid: {sorted(names)}")
    return dataclasses.replace(cfg, **overrides)


def _llama2(name, hidden, inter, heads, layers, **kw):
    return ModelConfig(
        model_type="llama",
        hidden_size=hidden,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        num_hidden_layers=layers,
        name=name,
        **kw,
    )


_QWEN_350M = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_attention_heads=16,
    num_key_value_heads=4,
    num_hidden_layers=24,
    tie_word_embeddings=True,
    scan_layers=True,
)

PRESETS: dict[str, ModelConfig] = {
    # GaLore / paper Llama 2 sizes (T5 vocabulary, MHA, untied)
    "llama2-60m": _llama2("llama2-60m", 512, 1376, 8, 8),
    "llama2-130m": _llama2("llama2-130m", 768, 2048, 12, 12),
    "llama2-350m": _llama2("llama2-350m", 1024, 2736, 16, 24, scan_layers=True),
    "llama2-1b": _llama2("llama2-1b", 2048, 5461, 32, 24, scan_layers=True),
    "llama2-7b": _llama2("llama2-7b", 4096, 11008, 32, 32, scan_layers=True),
    "llama3.2-300m": ModelConfig(
        model_type="llama",
        hidden_size=1024,
        intermediate_size=2736,
        num_attention_heads=16,
        num_key_value_heads=4,
        num_hidden_layers=24,
        rope_theta=500000.0,
        # The released Llama 3.2 models' RoPE (their config.json): the llama3 scaling
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=True,
        scan_layers=True,
        name="llama3.2-300m",
    ),
    "qwen2.5-350m": ModelConfig(
        model_type="qwen2", rope_theta=1000000.0, attention_bias=True, name="qwen2.5-350m", **_QWEN_350M
    ),
    "qwen3-350m": ModelConfig(
        model_type="qwen3", rope_theta=1000000.0, head_dim=64, name="qwen3-350m", **_QWEN_350M
    ),
    "deepseek-v2-350m": ModelConfig(
        model_type="deepseek_v2",
        hidden_size=1024,
        intermediate_size=2736,
        num_attention_heads=16,
        num_key_value_heads=16,
        num_hidden_layers=24,
        q_lora_rank=768,
        kv_lora_rank=256,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        scan_layers=True,
        name="deepseek-v2-350m",
    ),
}
_TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=512,
)
PRESETS.update(
    {
        "llama2-tiny": ModelConfig(model_type="llama", name="llama2-tiny", **_TINY),
        "llama3.2-tiny": ModelConfig(
            model_type="llama",
            num_key_value_heads=2,
            rope_theta=500000.0,
            tie_word_embeddings=True,
            name="llama3.2-tiny",
            **_TINY,
        ),
        "qwen2.5-tiny": ModelConfig(
            model_type="qwen2",
            num_key_value_heads=2,
            attention_bias=True,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
            name="qwen2.5-tiny",
            **_TINY,
        ),
        "qwen3-tiny": ModelConfig(
            model_type="qwen3",
            num_key_value_heads=2,
            head_dim=32,
            rope_theta=1000000.0,
            name="qwen3-tiny",
            **_TINY,
        ),
        "deepseek-v2-tiny": ModelConfig(
            model_type="deepseek_v2",
            q_lora_rank=48,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            name="deepseek-v2-tiny",
            **_TINY,
        ),
    }
)
PRESETS["tiny"] = dataclasses.replace(PRESETS["llama2-tiny"], name="tiny")


def list_configs() -> list[str]:
    """Names accepted by :func:`get_config`."""
    return sorted(PRESETS)


def get_config(name: str, /, **overrides) -> ModelConfig:
    """A named preset, with fields overridden (e.g. ``vocab_size=259``, ``dtype='bfloat16'``).

    Raises:
      ValueError: an unknown name (listing the valid ones) or an unknown override field.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(list_configs())}")
    return replace_config(PRESETS[name], **overrides)
