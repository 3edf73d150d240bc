"""Budget-preserving static rank allocation (Section 3.2, Algorithm 1 Phase 3)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import jax

from moara_jax._labels import OTHER, label_tree, module_label, unboxed, warn_if_no_targets
from moara_jax._matrices import MatrixAxesOrFn, leaf_views
from moara_jax._projection import effective_rank
from moara_jax._validate import is_int
from moara_jax._warnings import warn as _warn

DEFAULT_DONORS = ("q", "k")
MLA_DONORS = ("q_b", "kv_b")
DEFAULT_RECEIVERS = ("down",)


def _positive_int(name: str, value: Any) -> int:
    if not is_int(value):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _check_known(name: str, group: tuple[str, ...], types: tuple[str, ...]) -> None:
    unknown = [t for t in group if t not in types]
    if unknown:
        raise ValueError(f"{name}: unknown module types {unknown}; known: {list(types)}")


def _check_present(
    name: str, group: tuple[str, ...], types: tuple[str, ...], default: bool = False, present: bool = True
) -> None:
    """Every type of ``group`` among the parameters' ``types`` (``present``; else every type the
    labels can give), or a ``ValueError`` naming the argument (and saying so when it is the
    default, left unset)."""
    if not present:
        return _check_known(name, group, types)
    absent = [t for t in group if t not in types]
    if absent:
        what = f"the default {name} {list(group)} are" if default else f"module types {absent} are"
        raise ValueError(
            f"{name}: {what} not in the parameters, whose module types are {list(types)}"
            + (f"; pass {name}= naming types present" if default else "")
        )


def type_names(name: str, value: Iterable[str]) -> tuple[str, ...]:
    """``value`` as a tuple of module type names; a string (whose characters a tuple would take
    for names) refused, naming the argument."""
    if isinstance(value, str):
        raise ValueError(f"{name} must be module type names, e.g. ({value!r},), not the string {value!r}")
    return tuple(value)


def allocate_ranks(
    r_base: int,
    module_types: Iterable[str],
    donors: Iterable[str] = DEFAULT_DONORS,
    receivers: Iterable[str] = DEFAULT_RECEIVERS,
    delta: int | None = None,
    warn: bool = True,
) -> dict[str, int]:
    """Per-module-type ranks: donors ``r_base - delta``, receivers ``r_base + delta |D| / |R|``.

    All other types keep ``r_base``, so the sum over module types equals ``len(types) * r_base``.

    Args:
      r_base: the uniform baseline rank, a positive integer.
      module_types: the model's module types, e.g. ``('q','k','v','o','up','gate','down')``
        (repeats count once).
      donors, receivers: disjoint subsets of ``module_types``, both empty (no rank moves) or
        both non-empty; default ``('q', 'k')`` and ``('down',)``.
      delta: rank each donor gives, a non-negative integer; defaults to ``r_base // 2``.
      warn: say with a warning when the default ``delta`` moves no rank (``r_base`` 1).

    Returns:
      ``{module_type: rank}`` for each of ``module_types``, in their order: ``r_base - delta``
      for donors, ``r_base + delta |D| / |R|`` for receivers, ``r_base`` for the rest (Python
      ints).

    Raises:
      ValueError: naming the argument, for a non-positive or non-integer ``r_base``, a negative or
        non-integer ``delta``, a string where names are expected, a donor or receiver not in
        ``module_types``, a repeated donor or receiver, overlapping sets, one set empty and the
        other not, ``delta >= r_base``, or ``delta * |D|`` not divisible by ``|R|``.

    Example:
      >>> allocate_ranks(256, ("q", "k", "v", "o", "up", "gate", "down"))["down"]
      512
    """
    r_base = _positive_int("r_base", r_base)
    types = tuple(dict.fromkeys(type_names("module_types", module_types)))
    donors, receivers = type_names("donors", donors), type_names("receivers", receivers)
    for name, group in (("donors", donors), ("receivers", receivers)):
        _check_known(name, group, types)
        if len(set(group)) != len(group):
            raise ValueError(f"{name}: repeated module types in {list(group)}")
    if set(donors) & set(receivers):
        raise ValueError(f"donors and receivers overlap: {sorted(set(donors) & set(receivers))}")
    if bool(donors) != bool(receivers):
        raise ValueError("donors and receivers must both be empty or both be non-empty")
    if warn and delta is None and donors and r_base == 1:
        _warn(
            "rank allocation: r_base 1 leaves no rank to move (the default delta, r_base // 2, is 0), "
            "so every module type keeps rank 1; use r_base >= 2, or turn rank allocation off"
        )
    delta = r_base // 2 if delta is None else delta
    if not is_int(delta, minimum=0):
        raise ValueError(f"delta must be a non-negative integer, got {delta!r}")
    delta = int(delta)
    if delta >= r_base:
        raise ValueError(f"delta ({delta}) must be smaller than r_base ({r_base})")
    gain, rem = divmod(delta * len(donors), max(len(receivers), 1))
    if rem:
        raise ValueError(
            f"delta * |donors| = {delta * len(donors)} is not divisible by |receivers| = "
            f"{len(receivers)}; choose delta so the budget splits into whole ranks"
        )
    ranks = {t: r_base for t in types}
    for t in donors:
        ranks[t] = r_base - delta
    for t in receivers:
        ranks[t] = r_base + gain
    return ranks


def default_donors(module_types: Iterable[str]) -> tuple[str, ...]:
    """The default donors among ``module_types``: ``q`` and ``k``, each replaced by its MLA
    counterpart (``q_b``, ``kv_b``) where the types lack it, and left out where they lack both.
    ``('q', 'k')`` for Llama and Qwen, ``('q_b', 'kv_b')`` for DeepSeek-V2's MLA, and
    ``('q', 'kv_b')`` for an MLA model whose query has no low-rank factors (DeepSeek-V2-Lite:
    a plain ``q_proj``).

    Args:
      module_types: the module types present, e.g. those :func:`label_tree` gives the
        parameters (any iterable of names; a string is a ``ValueError``, as elsewhere).

    Returns:
      A tuple of at most two names, in the order (``q`` or ``q_b``, ``k`` or ``kv_b``); ``()``
      when the types have none of the four.
    """
    types = set(type_names("module_types", module_types))
    pairs = zip(DEFAULT_DONORS, MLA_DONORS, strict=True)
    return tuple(d if d in types else mla for d, mla in pairs if d in types or mla in types)


def resolve_module_ranks(
    module_types: Iterable[str],
    *,
    r_base: int,
    rank_allocation: bool = True,
    ranks: Mapping[str, int] | None = None,
    donors: Iterable[str] | None = None,
    receivers: Iterable[str] | None = None,
    delta: int | None = None,
    warn: bool = False,
    present: bool = True,
) -> dict[str, int]:
    """The requested rank of each present module type (before per-matrix clipping).

    ``donors``/``receivers`` ``None``: the defaults (:func:`default_donors`, ``('down',)``).
    With the default donors and receivers, a tree that lacks all the donors or all the receivers
    moves no rank (every type keeps ``r_base``), and one that has only one of the default donors
    moves rank from it alone; ``warn=True`` says either with a warning (and where ``r_base`` 1
    leaves the default ``delta`` none to move, :func:`allocate_ranks`). Donors or
    receivers named by the caller must all be present (``ValueError`` otherwise), and so must the
    default receivers when donors are named. ``ranks`` must be a mapping of positive integers;
    ``warn=True`` warns of the types it names that are not present (they set no rank). The rule's
    settings (``donors``, ``receivers``, ``delta``) with no rule to apply them to
    (``rank_allocation=False``, or ``ranks`` given) are refused: they would change no rank.

    Args:
      module_types: the parameters' module types, or with ``present=False`` every type the
        labels can give (the arguments checked before the parameters are known: a donor or
        receiver not among them is unknown). ``'other'`` and repeats are dropped.
      r_base: the uniform baseline rank, a positive integer (``ValueError`` otherwise).
      rank_allocation: apply the donor/receiver rule (:func:`allocate_ranks`); ``False``: every
        type gets ``r_base``.
      ranks: explicit ``{module_type: rank}`` (positive integers); overrides the rule, and the
        types it leaves out get ``r_base``.
      donors, receivers, delta: the rule's settings, as :func:`allocate_ranks` takes them;
        ``None``: the defaults above (``delta``: ``r_base // 2``).
      warn: give the warnings described above.
      present: whether ``module_types`` are the parameters' own (named donors and receivers must
        be among them) or every type the labels can give (they must only be known).

    Returns:
      ``{module_type: rank}`` for each type of ``module_types`` but ``'other'``, in their order
      (Python ints); ``{}`` for none.
    """
    types = tuple(t for t in dict.fromkeys(type_names("module_types", module_types)) if t != OTHER)
    r_base = _positive_int("r_base", r_base)
    given = [k for k, v in (("donors", donors), ("receivers", receivers), ("delta", delta)) if v is not None]
    if given and (ranks is not None or not rank_allocation):
        instead = "ranks= gives every rank" if ranks is not None else "rank_allocation=False moves no rank"
        raise ValueError(f"{', '.join(given)} set, but {instead}: leave {' and '.join(given)} unset")
    if ranks is not None:
        return _explicit_ranks(ranks, types, r_base, warn)
    if not rank_allocation or not types:
        return {t: r_base for t in types}
    if receivers is None and donors is None:
        # The default set applies to the types the model has (a partial tree moves no rank).
        receivers = tuple(t for t in DEFAULT_RECEIVERS if t in types)
    else:
        default = receivers is None
        receivers = DEFAULT_RECEIVERS if default else type_names("receivers", receivers)
        _check_present("receivers", receivers, types, default, present)
    if donors is not None:
        _check_present("donors", type_names("donors", donors), types, present=present)
    if donors is None:
        donors = default_donors(types)
        if warn and donors and receivers and len(donors) < len(DEFAULT_DONORS):
            _warn(
                f"moara_adamw: of the default donors {DEFAULT_DONORS} (MLA: {MLA_DONORS}) the parameters "
                f"have {list(donors)} alone: they donate, and {list(receivers)} receive what they give "
                f"(the parameters' module types: {list(types)}). Pass donors= to choose others."
            )
        if not donors or not receivers:
            if warn:
                _warn_no_allocation(types, donors, receivers, r_base)
            donors, receivers = (), ()
    return allocate_ranks(r_base, types, donors, receivers, delta, warn=warn)


def _explicit_ranks(ranks: Mapping, types: tuple[str, ...], r_base: int, warn: bool) -> dict[str, int]:
    """The ranks ``ranks=`` gives (``r_base`` for the types it leaves out), checked; ``warn``:
    warns of the types it names that the parameters lack (they set no rank)."""
    if not isinstance(ranks, Mapping):
        raise ValueError(f"ranks must map module types to ranks, e.g. {{'down': 256}}, got {ranks!r}")
    for t, r in ranks.items():
        _positive_int(f"ranks[{t!r}]", r)
    absent = [t for t in ranks if t not in types]
    if warn and absent:
        _warn(
            f"moara_adamw: ranks names module types the parameters do not have, {absent}: they "
            f"set no rank (the parameters' module types: {list(types)})"
        )
    return {t: int(ranks.get(t, r_base)) for t in types}


def _warn_no_allocation(
    types: tuple[str, ...], donors: tuple[str, ...], receivers: tuple[str, ...], r_base: int
) -> None:
    missing = []
    if not donors:
        missing.append(f"donors {DEFAULT_DONORS} (MLA: {MLA_DONORS})")
    if not receivers:
        missing.append(f"receivers {DEFAULT_RECEIVERS}")
    _warn(
        f"moara_adamw: rank allocation is on, but the parameters have none of the default "
        f"{' and none of the default '.join(missing)}, so no rank moves: the module types present, "
        f"{list(types)}, all keep r_base = {r_base}. Pass donors= and receivers= naming types "
        "present, ranks=, or rank_allocation=False.",
    )


def tree_ranks(
    tree: Any, label_fn=module_label, *, warn: bool = False, **allocation
) -> tuple[Any, dict[str, int]]:
    """The label tree of ``tree`` and the requested rank of each module type present in it
    (``allocation``: the keyword arguments of :func:`resolve_module_ranks`). ``warn=True``
    warns when no leaf is a target (:func:`warn_if_no_targets`) or the default allocation
    moves no rank."""
    labels = label_tree(tree, label_fn)
    present = [lab for lab in dict.fromkeys(jax.tree.leaves(labels)) if lab != OTHER]
    if warn:
        warn_if_no_targets(tree, labels, label_fn)
    return labels, resolve_module_ranks(present, warn=warn, **allocation)


def rank_table(
    params: Any,
    *,
    r_base: int,
    rank_allocation: bool = True,
    ranks: Mapping[str, int] | None = None,
    donors: Iterable[str] | None = None,
    receivers: Iterable[str] | None = None,
    delta: int | None = None,
    label_fn=module_label,
    matrix_axes: MatrixAxesOrFn | None = None,
) -> list[dict[str, Any]]:
    """The rank of every target matrix: ``path, module, shape, requested, used`` (clipping shows
    as ``used < requested``). Works on ``jax.eval_shape`` output. With ``matrix_axes`` (the
    optimizer's, :class:`MatrixAxes`), ``shape`` is the matrix view the rank applies to.

    Args:
      params: the parameters: arrays, or their shapes and dtypes (``jax.eval_shape``'s); Flax
        boxes allowed.
      r_base, rank_allocation, ranks, donors, receivers, delta: the optimizer's rank settings,
        as :func:`moara_adamw` takes them (:func:`resolve_module_ranks`; named donors and
        receivers must be among the parameters' module types, ``ValueError`` otherwise).
      label_fn: maps a parameter path to a module type or ``'other'`` (default
        :func:`module_label`); leaves of fewer than 2 dimensions or with no entries are never
        targets (:func:`label_tree`).
      matrix_axes: the optimizer's ``matrix_axes``, if it was given one (:func:`as_matrices`).

    Returns:
      A list with one dict per target matrix, in ``jax.tree.leaves`` order: ``'path'`` (the
      parameter's ``jax.tree_util.keystr``, a Flax box's ``.value`` dropped), ``'module'`` (its
      module type), ``'shape'`` (a tuple of ints: the leaf's shape, or its matrix view's,
      leading stacked axes included), ``'requested'`` (the module type's rank) and ``'used'``
      (``min(requested, fan_in, fan_out)`` of the last two axes).
    """
    labels, requested = tree_ranks(
        params,
        label_fn,
        r_base=r_base,
        rank_allocation=rank_allocation,
        ranks=ranks,
        donors=donors,
        receivers=receivers,
        delta=delta,
    )
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    views = [None] * len(leaves) if matrix_axes is None else leaf_views(params, matrix_axes)
    rows = []
    for (path, x), view, lab in zip(leaves, views, jax.tree.leaves(labels), strict=True):
        if lab == OTHER:
            continue
        r = requested[lab]
        shape = tuple(int(s) for s in (x.shape if view is None else view.shape))
        rows.append(
            {
                "path": jax.tree_util.keystr(unboxed(path)),  # a Flax box's .value is no name
                "module": lab,
                "shape": shape,
                "requested": r,
                "used": effective_rank(shape, r),
            }
        )
    return rows
