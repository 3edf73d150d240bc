"""The host protocol: what a low-rank method ("host", the paper's cross-method study) tells the
core, so that ``moara_adamw``, ``state_bytes``, the alignment diagnostic and the trainer ask the
host instead of testing its type.

A host is a frozen dataclass of its settings that subclasses :class:`Host` and overrides
:meth:`Host.stages`; every other method has GaLore's behaviour as its default.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax
import numpy as np
import optax

from moara_jax._adam import decay_after_step, inner_adam
from moara_jax._labels import is_box
from moara_jax._projection import SVD_METHODS
from moara_jax._validate import (
    check_adam,
    check_update_proj_gap,
    dtype_arg,
    is_int,
    number,
    real_number,
)


def is_zero(weight_decay) -> bool:
    """A weight decay of 0 given as a number (an injected array may change: never zero)."""
    return number(weight_decay) and weight_decay == 0


DecayMask = Callable[[Any], Any]  # a tree -> a tree of booleans of its structure


def decay_mask_fn(mask: Any) -> DecayMask | None:
    """``moara_adamw``'s ``weight_decay_mask`` (a tree of booleans with the parameters' structure
    or a prefix of it, or a function of the parameters returning one, as ``optax.masked`` takes)
    as the hosts take it: a function of a tree giving one boolean per leaf, like ``targets``."""
    if mask is None:
        return None

    def fn(tree):
        # A box in the mask (one built by mapping over boxed parameters) is looked through: under
        # ``matrix_axes`` a viewed leaf has lost its box, and elsewhere the tree's own restores it.
        given = jax.tree.map(
            lambda m: jax.tree.leaves(m)[0] if is_box(m) else m,
            mask(tree) if callable(mask) else mask,
            is_leaf=is_box,
        )
        try:
            return jax.tree.map(lambda m, sub: jax.tree.map(lambda _: m, sub), given, tree)
        except ValueError:  # JAX's many-line structure error
            top = lambda t: sorted(map(str, t)) if isinstance(t, Mapping) else type(t).__name__  # noqa: E731
            levels = f" (its top level {top(given)}, the parameters' {top(tree)})"
            raise ValueError(
                "weight_decay_mask: not the parameters' tree nor a prefix of it"
                f"{levels if top(given) != top(tree) else ''}: give a boolean for each parameter, "
                "or for a subtree of them"
            ) from None

    return fn


def with_decay_mask(host: Host, name: str, decay_mask: DecayMask | None, *args: Any) -> Any:
    """``host.name(*args)`` (``finish`` or ``other_adam``), given ``decay_mask=`` only when there
    is a mask: a host written before masks existed runs as before without one, and is refused
    one it cannot take."""
    method = getattr(host, name)
    if decay_mask is None:
        return method(*args)
    parameters = inspect.signature(method).parameters.values()
    if not any(p.name == "decay_mask" or p.kind is p.VAR_KEYWORD for p in parameters):
        raise ValueError(
            f"weight_decay_mask: host {host.name!r} cannot take it: add a decay_mask=None parameter "
            f"to {type(host).__name__}.{name} (a tree -> booleans function, None for every "
            "parameter) and decay only where it is True"
        )
    return method(*args, decay_mask=decay_mask)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageOptions:
    """The hyperparameters of a host's stages: their one definition, defaults and checks.

    ``moara_adamw``, ``scale_by_moara``, ``scale_by_galore`` and ``host_stages`` take them as
    keyword arguments whose defaults are these fields' (read from this class), build one
    ``StageOptions`` and pass it down to the host's :meth:`Host.stages`. A new hyperparameter is a
    field here, a keyword of each public function that exposes it, and its use in the stages.

    Python values are checked here, so a bad value fails at the public call whatever the host;
    arrays (hyperparameters injected by ``optax.inject_hyperparams``) are not. ``rank`` is checked
    by the projection that uses it (it may be a function of the path).

    Attributes:
      rank: the projection rank, or a function of the parameter's key path giving it.
      update_proj_gap: steps between basis refreshes (GaLore's ``T``).
      scale: GaLore's scale (Fira's ``alpha``), applied by ``recompose``.
      b1, b2, eps: the Adam of the low-rank values and block magnitudes (paper: 0.9, 0.999, 1e-6).
      mu_dtype: the moments' dtype (``None``: the parameter's, float32 for float16).
      mag_dtype: the block magnitudes' moments' dtype.
      proj_type: which side is projected (``'std'``: galore-torch's rule).
      svd, seed, canonical_signs, name: how bases are made and named, as :func:`moara_jax.project`
        takes them (:attr:`basis`).
    """

    rank: int | Callable[[Any], int]
    update_proj_gap: int = 200
    scale: float = 0.25
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-6
    mu_dtype: Any = None
    mag_dtype: Any = "float32"
    proj_type: str = "std"
    svd: str = "exact"
    seed: int = 0
    canonical_signs: bool = False
    name: str | Callable[[Any], str] | None = None

    def __post_init__(self):
        if not isinstance(self.update_proj_gap, (jax.Array, np.ndarray)):
            check_update_proj_gap(self.update_proj_gap)
        injected = isinstance(self.scale, (jax.Array, np.ndarray))
        if not injected and not (real_number(self.scale) and self.scale >= 0):
            raise ValueError(f"scale must be a non-negative number, got {self.scale!r}")
        check_adam(self.b1, self.b2, self.eps)
        dtype_arg("mu_dtype", self.mu_dtype)
        dtype_arg("mag_dtype", self.mag_dtype)
        if self.svd not in SVD_METHODS:
            raise ValueError(f"svd must be one of {SVD_METHODS}, got {self.svd!r}")
        if not isinstance(self.seed, (jax.Array, np.ndarray)) and not is_int(self.seed, minimum=-(2**63)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")

    @property
    def basis(self) -> dict[str, Any]:
        """The keyword arguments of every projection stage that say how bases are made."""
        return dict(svd=self.svd, seed=self.seed, canonical_signs=self.canonical_signs, name=self.name)


class Host:
    """Base class of a host's settings (subclass it as a frozen dataclass).

    Class attributes:
      name: the registry name (``moara_adamw(host=name)``, ``optimizer.host`` in the trainer).
      proj_types: the ``proj_type`` values its projection takes (``None``: whatever
        :func:`moara_jax.project` takes).
      state_types: the optimizer-state ``NamedTuple`` types its stages keep beyond the core's
        (``ProjectState``, ``InnerAdamState``); ``state_bytes`` sorts their fields by name
        (``basis``, ``dir_mu``, ``basis_mu``, ``error``, ...; see ``moara_jax._accounting``).
      basis_states: the state types holding projection bases in a ``basis`` field, each with the
        rule ``shape -> side`` that says which side of a matrix its basis projects (the
        alignment diagnostic and ``projection_bases`` read them).
    """

    name: ClassVar[str]
    proj_types: ClassVar[tuple[str, ...] | None] = ("std",)
    state_types: ClassVar[tuple[type, ...]] = ()
    basis_states: ClassVar[dict[type, Callable[[tuple], Any]]] = {}

    def stages(self, o: StageOptions) -> tuple[optax.GradientTransformation, ...]:
        """The stages between ``decompose`` (if any) and ``recompose`` for the target matrices:
        they take the (decomposed) gradient and emit ``LowRank`` values (or nodes holding
        them) that ``recompose`` maps back."""
        raise NotImplementedError

    def other_adam(
        self,
        b1: float,
        b2: float,
        eps: float,
        mu_dtype: Any,
        weight_decay: Any,
        decay_mask: DecayMask | None = None,
    ) -> optax.GradientTransformation:
        """The direction of every non-target parameter (and their weight decay, when the host
        puts it before the learning rate, on the parameters ``decay_mask`` marks, as
        :meth:`finish`'s): galore-torch's Adam by default."""
        return inner_adam(b1, b2, eps, mu_dtype=mu_dtype)

    def finish(
        self,
        learning_rate: optax.ScalarOrSchedule,
        weight_decay: Any,
        targets: Callable[[Any], Any],
        seed: int,
        decay_mask: DecayMask | None = None,
    ) -> list[optax.GradientTransformation]:
        """What follows the directions (``targets``: a tree -> booleans mask of the target
        matrices; ``decay_mask``: a tree -> booleans mask of the parameters weight decay applies
        to, ``None`` for all of them): by default the learning rate, then galore-torch's decoupled
        decay after the step, ``p <- (p + step)(1 - lr * wd)``."""
        decay = decay_after_step(learning_rate, weight_decay, decay_mask)
        return [optax.scale_by_learning_rate(learning_rate), decay]

    def with_learning_rate(self, learning_rate: optax.ScalarOrSchedule, update_proj_gap: int) -> Host:
        """The settings ``moara_adamw`` runs, given its learning rate (a host whose stages
        depend on it, as OSD's basis step does, fills that in here)."""
        return self

    @classmethod
    def trainer_defaults(cls, peak_lr: float) -> dict[str, Any]:
        """Settings the trainer fills in unless ``optimizer.host_options`` gives them."""
        return {}
