"""Module labels from parameter paths (HF naming), used for per-module ranks."""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np

from moara_jax._warnings import warn

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
# A target is the linear layer's matrix, a Flax ``kernel`` (fan_in, fan_out); its bias (Qwen2.5's
# q/k/v) is not. A ``weight`` is not either: that name usually holds PyTorch's (fan_out, fan_in)
# (Equinox's Linear, a converted HF state dict), which the decomposition would read transposed.
_MATRIX_LEAVES = ("kernel",)
# The attribute under which Flax boxes hold the array (linen's ``Partitioned``, nnx's ``Variable``).
_BOX_ATTR = "value"


def unboxed(path: Any) -> tuple:
    """A JAX key path without a trailing ``GetAttrKey('value')``, the box around a Flax linen
    ``nn.Partitioned`` or nnx ``Variable``: a boxed tree's paths become those of the same tree
    unboxed (what ``nnx.Optimizer``'s ``init`` and ``update`` see differ in this alone)."""
    path = tuple(path)
    if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == _BOX_ATTR:
        return path[:-1]
    return path


def path_key(path) -> tuple[str, ...]:
    """A key path as names (dict keys, attribute names, sequence indices)."""
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def find_param(key: tuple[str, ...], params: dict):
    """The value of ``params`` (keyed by :func:`path_key`) whose key occurs in ``key`` ending
    latest, the longest such, or None: optax states hold per-parameter trees whose paths end
    with the parameter's, or with it and a field (a quantized basis's codes); a chain's index at
    the front of every path is no parameter's (list parameters are keyed '0', '1', ...)."""
    for j in range(len(key), 0, -1):
        for i in range(j):
            if key[i:j] in params:
                return params[key[i:j]]
    return None


def is_box(x: Any) -> bool:
    """Whether ``x`` is a box around one value, as Flax's are: a node whose only child is its
    ``.value`` (linen's ``nn.Partitioned``, nnx's ``Variable``)."""
    if x is None or isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
        return False
    children = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)[0]
    return len(children) == 1 and children[0][0] != () and unboxed(children[0][0]) == ()


def path_names(path: Any) -> tuple[str, ...]:
    """Path components as strings, from a JAX key path, a tuple of names, or ``'a/b/c'``/``'a.b.c'``.

    A trailing attribute ``value`` (``GetAttrKey('value')``, or ``.value`` at the end of a
    ``keystr``) is dropped: it is the box around the array, not a name of it: Flax linen's
    ``nn.Partitioned`` (``nn.with_partitioning``, kept boxed) and Flax nnx's variables
    (``nnx.state(model, nnx.Param)``, what ``nnx.Optimizer`` passes to ``init``).

    Args:
      path: a JAX key path (dict keys, attribute names and sequence indices), a tuple of names,
        a ``jax.tree_util.keystr`` (``"['layers'][0].value"``), or names joined by ``/`` or
        ``.``.

    Returns:
      The names as a tuple of strings (indices as digits; empty parts of a ``/``- or
      ``.``-joined string dropped).

    Raises:
      TypeError: for a number (an integer or an array): ``optax.inject_hyperparams`` calls a
        ``label_fn`` with the step count unless it is named in ``static_args``.

    Example:
      >>> path_names("['q_proj']['kernel'].value")
      ('q_proj', 'kernel')
    """
    if isinstance(path, (int, np.integer, np.ndarray, jax.Array)) and not isinstance(path, bool):
        raise TypeError(
            f"a parameter path was expected, got the number {path!r}: optax.inject_hyperparams "
            "calls every callable argument (label_fn too) as a schedule of the step; pass "
            "static_args=moara_jax.MOARA_ADAMW_STATIC_ARGS"
        )
    if isinstance(path, str):
        if path.startswith("["):  # jax.tree_util.keystr: "['layers']['q_proj']['kernel']"
            parts = re.findall(r"\['([^']*)'\]|\[(\d+)\]|\.([A-Za-z_]\w*)", path)
            if parts and parts[-1][2] == _BOX_ATTR:
                parts = parts[:-1]
            return tuple(a or b or c for a, b, c in parts)
        return tuple(p for p in path.replace(".", "/").split("/") if p)
    return path_key(unboxed(path))


def module_label(path: Any) -> str:
    """Maps a parameter path to its module type, or ``'other'``.

    ``q_proj k_proj v_proj o_proj up_proj gate_proj down_proj`` give ``q k v o up gate down``;
    DeepSeek-V2 MLA's ``q_a_proj q_b_proj kv_a_proj_with_mqa kv_b_proj`` give ``q_a q_b kv_a kv_b``.
    Only the layer's matrix (a ``kernel``, or the module path itself) is a target; biases,
    norms, embeddings and the LM head are ``'other'``. A trailing box attribute (``.value`` of a
    Flax linen ``nn.Partitioned`` or an nnx ``Variable``) is ignored (:func:`path_names`).

    Layout contract: a target is read as Flax's ``(..., fan_in, fan_out)`` (leading axes are
    stacked layers). A leaf named ``weight`` is not a target: that name usually holds PyTorch's
    ``(fan_out, fan_in)`` (Equinox's ``Linear``, a converted HF state dict), which the block
    decomposition and the projection side would read transposed. Transpose such matrices into
    ``kernel`` leaves, or pass a ``label_fn`` of your own to ``moara_adamw`` for leaves already
    in ``(fan_in, fan_out)`` layout.

    Args:
      path: a parameter path, in any form :func:`path_names` takes (a JAX key path, a tuple of
        names, a ``keystr``, a ``/``- or ``.``-joined string).

    Returns:
      The module type: that of the path's last name when it is an HF layer name, else, when the
      last name is ``kernel``, that of the nearest HF layer name before it; ``'other'`` when
      neither holds.

    Example:
      >>> module_label("model/layers/0/self_attn/q_proj/kernel")
      'q'
      >>> module_label(("layers", "mlp", "down_proj", "bias"))
      'other'
      >>> module_label("model.layers.0.self_attn.q_proj.weight")  # PyTorch layout: not a target
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
    """The label of every leaf; leaves with fewer than 2 dimensions, or with no entries, are
    always ``'other'``.

    Args:
      params: the parameters: arrays, or their shapes and dtypes (``jax.eval_shape``'s); Flax
        boxes allowed.
      label_fn: maps a leaf's JAX key path (a Flax box's trailing ``.value`` dropped) to a module
        type or ``'other'``; called for every leaf, and must return a string (``ValueError``
        otherwise). Default :func:`module_label`.

    Returns:
      A pytree of ``params``' structure with a string at each leaf: ``label_fn``'s label for a
      matrix (2 or more dimensions, none of size 0), ``'other'`` for every other leaf.
    """

    def f(path, x):
        label = label_fn(unboxed(path))
        if not isinstance(label, str):
            raise ValueError(
                f"label_fn returned {label!r} for {jax.tree_util.keystr(path)}: a module type "
                f"(a string), or {OTHER!r} for a parameter left to AdamW"
            )
        matrix = getattr(x, "ndim", 0) >= 2 and 0 not in x.shape
        return label if label != OTHER and matrix else OTHER

    return jax.tree_util.tree_map_with_path(f, params)


# How many of the matrices left to AdamW a warning names.
_SHOWN = 3


def warn_if_no_targets(tree: Any, labels: Any, label_fn=module_label) -> None:
    """Warns when ``tree`` has matrices (leaves of 2 or more dimensions) and ``labels`` (its
    :func:`label_tree`) makes none of them a target: every parameter would silently get plain
    AdamW. The warning names a few of those matrices and how to make them targets."""
    if any(lab != OTHER for lab in jax.tree.leaves(labels)):
        return
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    matrices = [(path, x.shape) for path, x in leaves if getattr(x, "ndim", 0) >= 2]
    if not matrices:
        return
    shown = ", ".join(f"{jax.tree_util.keystr(path)} {tuple(shape)}" for path, shape in matrices[:_SHOWN])
    more = f" and {len(matrices) - _SHOWN} more" if len(matrices) > _SHOWN else ""
    if label_fn is module_label:
        how = (
            "module_label targets a 'kernel' (Flax layout (..., fan_in, fan_out)) under a layer "
            f"named like Hugging Face's ({', '.join(_HF_NAMES)}): name the layers so, or pass "
            "label_fn= mapping each target's path to a module type"
        )
    else:
        how = "label_fn returned 'other' for every one of them"
    if any(path_names(path)[-1:] == ("weight",) for path, _ in matrices):
        how += (
            ". Leaves named 'weight' are never targets of module_label: they usually hold "
            "PyTorch's (fan_out, fan_in) layout; transpose them into (fan_in, fan_out) 'kernel' leaves"
        )
    warn(
        f"moara_adamw: no parameter is a target matrix, so every parameter gets plain AdamW; the "
        f"matrices left to AdamW include {shown}{more}. {how}.",
    )
