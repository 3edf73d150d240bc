"""The host protocol: what a low-rank method ("host", the paper's cross-method study) tells the
core, so that ``moara_adamw``, ``state_bytes``, the alignment diagnostic and the trainer ask the
host instead of testing its type.

A host is a frozen dataclass of its settings that subclasses :class:`Host` and overrides
:meth:`Host.stages`; every other method has GaLore's behaviour as its default.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import optax

from moara_jax._adam import decay_after_step, inner_adam
from moara_jax._validate import real  # noqa: F401 - the hosts' settings checks


def is_zero(weight_decay) -> bool:
    """A Python-number weight decay of 0 (an injected array may change: never zero)."""
    return isinstance(weight_decay, (int, float)) and weight_decay == 0


class StageOptions(NamedTuple):
    """What ``moara_adamw`` / ``scale_by_moara`` give a host's :meth:`Host.stages`."""

    rank: int | Callable[[Any], int]  # or a function of the parameter's path
    update_proj_gap: int
    scale: float
    b1: float
    b2: float
    eps: float
    mu_dtype: Any
    mag_dtype: Any
    proj_type: str
    svd: str
    seed: int
    canonical_signs: bool
    name: str | Callable[[Any], str] | None

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
        self, b1: float, b2: float, eps: float, mu_dtype: Any, weight_decay: Any
    ) -> optax.GradientTransformation:
        """The direction of every non-target parameter (and their weight decay, when the host
        puts it before the learning rate): galore-torch's Adam by default."""
        return inner_adam(b1, b2, eps, mu_dtype=mu_dtype)

    def finish(
        self,
        learning_rate: optax.ScalarOrSchedule,
        weight_decay: Any,
        targets: Callable[[Any], Any],
        seed: int,
    ) -> list[optax.GradientTransformation]:
        """What follows the directions (``targets``: a tree -> booleans mask of the target
        matrices): by default the learning rate, then galore-torch's decoupled decay after the
        step, ``p <- (p + step)(1 - lr * wd)``."""
        return [optax.scale_by_learning_rate(learning_rate), decay_after_step(learning_rate, weight_decay)]

    def with_learning_rate(self, learning_rate: optax.ScalarOrSchedule, update_proj_gap: int) -> Host:
        """The settings ``moara_adamw`` runs, given its learning rate (a host whose stages
        depend on it, as OSD's basis step does, fills that in here)."""
        return self

    @classmethod
    def trainer_defaults(cls, peak_lr: float) -> dict[str, Any]:
        """Settings the trainer fills in unless ``optimizer.host_options`` gives them."""
        return {}
