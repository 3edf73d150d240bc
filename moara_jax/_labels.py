"""Module labels from parameter paths (HF naming), used for per-module ranks."""

from __future__ import annotations

import re
from typing import Any

import jax

LLAMA_MODULE_TYPES = ("q", "k", "v", "o", "up", "gate", "down")
MLA_MODULE_TYPES = ("q_a", "q_b", "kv_a", "kv_b", "o", "up", "gate", "down")
MODULE_TYPES = ("q", "k", "v", "o", "up", "gate", "down", "q_a", "q_b", "kv_a", "kv_b")
OTHER = "other"

_HF_NAMES = {
    "q_proj": "q",
    "k_proj": "k",
    "v_proj": "v",
    "o_proj": "o",
    "up_proj": "up",
    "gate_proj": "gate",
    "down_proj": "down",
    "q_a_proj": "q_a",
    "q_b_proj": "q_b",
    "kv_a_proj_with_mqa": "kv_a",
    "kv_b_proj": "kv_b",
}
# A target is the linear layer's matrix; its bias (Qwen2.5's q/k/v) is not.
_MATRIX_LEAVES = ("kernel", "weight")


def path_names(path: Any) -> tuple[str, ...]:
    """Path components as strings, from a JAX key path, a tuple of names, or ``'a/b/c'``/``'a.b.c'``."""
    if isinstance(path, str):
        if path.startswith("["):  # jax.tree_util.keystr: "['layers']['q_proj']['kernel']"
            parts = re.findall(r"\['([^']*)'\]|\[(\d+)\]|\.([A-Za-z_]\w*)", path)
            return tuple(a or b or c for a, b, c in parts)
        return tuple(p for p in path.replace(".", "/").split("/") if p)
    names = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            names.append(str(k.key))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            names.append(k.name)
        elif isinstance(k, jax.tree_util.SequenceKey):
            names.append(str(k.idx))
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            names.append(str(k.key))
        else:
            names.append(str(k))
    return tuple(names)


def module_label(path: Any) -> str:
    """Maps a parameter path to its module type, or ``'other'``.

    ``q_proj k_proj v_proj o_proj up_proj gate_proj down_proj`` give ``q k v o up gate down``;
    DeepSeek-V2 MLA's ``q_a_proj q_b_proj kv_a_proj_with_mqa kv_b_proj`` give ``q_a q_b kv_a kv_b``.
    Only the layer's matrix (``kernel``/``weight``, or the module path itself) is a target;
    biases, norms, embeddings and the LM head are ``'other'``.

    Example:
      >>> module_label("model/layers/0/self_attn/q_proj/kernel")
      'q'
      >>> module_label(("layers", "mlp", "down_proj", "bias"))
      'other'
    """
    names = path_names(path)
    if not names:
        return OTHER
    last = names[-1]
    if last in _HF_NAMES:
        return _HF_NAMES[last]
    if last not in _MATRIX_LEAVES:
        return OTHER
    for name in reversed(names[:-1]):
        if name in _HF_NAMES:
            return _HF_NAMES[name]
    return OTHER


def label_tree(params: Any, label_fn=module_label) -> Any:
    """The label of every leaf; leaves with fewer than 2 dimensions are always ``'other'``."""

    def f(path, x):
        label = label_fn(path)
        return label if label != OTHER and getattr(x, "ndim", 0) >= 2 else OTHER

    return jax.tree_util.tree_map_with_path(f, params)
