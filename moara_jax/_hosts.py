"""The low-rank methods MoARa runs on ("hosts", the paper's cross-method study).

A host decides how a target matrix's (or block direction's) low-rank update is made: the
projection stage and the Adam stage of the chain. ``moara_adamw(host=...)`` takes a name or one
of these frozen settings objects; decomposition and rank allocation combine with each the same
way (decomposition first, each module type's rank for its projection).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from moara_jax._decomposition import _is_int


def _real(value) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclasses.dataclass(frozen=True)
class GaLore:
    """GaLore (Zhao et al., https://arxiv.org/abs/2403.03507): SVD basis every ``T`` steps, Adam
    in the subspace (galore-torch's ``GaLoreAdamW``). The default host."""


@dataclasses.dataclass(frozen=True)
class Fira:
    """Fira (Chen et al., https://arxiv.org/abs/2410.01623): GaLore plus the dropped part of the
    gradient, scaled per row by Adam's norm ratio, its norm growth limited to ``growth_limit``
    per step (``fira.FiraAdamW``; :func:`moara_jax.fira_adam`)."""

    growth_limit: float = 1.01

    def __post_init__(self):
        if not (_real(self.growth_limit) and self.growth_limit > 0):
            raise ValueError(f"growth_limit must be positive, got {self.growth_limit!r}")


@dataclasses.dataclass(frozen=True)
class QGaLore:
    """Q-GaLore (Zhang et al., https://arxiv.org/abs/2407.08296), q-galore-torch's defaults.

    Attributes:
      basis_bits, basis_group_size: the projection basis stored in ``basis_bits``-bit groups
        (``None``: float).
      cos_threshold, gamma, queue_size: layer-adaptive refresh: a matrix whose last
        ``queue_size`` first-vector cosines average at least ``cos_threshold`` multiplies its
        refresh interval by ``gamma``.
      min_8bit_size: Adam moments of units with at least this many entries are 8-bit blockwise
        (bitsandbytes' ``AdamW8bit``), smaller ones float32.
      mag_bits: 8 or 32: the block magnitudes' moments under decomposition (the paper's
        precision ablation uses 32).
      weight_bits, weight_group_size, stochastic_round: target weights kept on a
        ``weight_bits``-bit group grid after every step (``None``: off), with stochastic rounding.
    """

    basis_bits: int | None = 4
    basis_group_size: int = 256
    cos_threshold: float = 0.4
    gamma: float = 2.0
    queue_size: int = 5
    min_8bit_size: int = 4096
    mag_bits: int = 8
    weight_bits: int | None = 8
    weight_group_size: int = 256
    stochastic_round: bool = True

    def __post_init__(self):
        for field in ("basis_bits", "weight_bits"):
            value = getattr(self, field)
            if value is not None and not (_is_int(value) and value <= 8):
                raise ValueError(f"{field} must be an integer in [1, 8] or None, got {value!r}")
        for field in ("basis_group_size", "weight_group_size", "queue_size"):
            if not _is_int(getattr(self, field)):
                raise ValueError(f"{field} must be a positive integer, got {getattr(self, field)!r}")
        if not _is_int(self.min_8bit_size, minimum=0):
            raise ValueError(f"min_8bit_size must be a non-negative integer, got {self.min_8bit_size!r}")
        if self.mag_bits not in (8, 32):
            raise ValueError(f"mag_bits must be 8 or 32, got {self.mag_bits!r}")
        if not (_real(self.gamma) and 1 <= self.gamma < 2**20):
            raise ValueError(f"gamma must be a number in [1, 2^20), got {self.gamma!r}")
        if not _real(self.cos_threshold):
            raise ValueError(f"cos_threshold must be a finite number, got {self.cos_threshold!r}")
        if not isinstance(self.stochastic_round, bool):
            raise ValueError(f"stochastic_round must be True or False, got {self.stochastic_round!r}")


@dataclasses.dataclass(frozen=True)
class OSD:
    """Online Subspace Descent (Liang et al., https://arxiv.org/abs/2408.12857), its official
    implementation's default (``continuous``): an SVD basis at step 0, then one AdamW step a
    step on the online-PCA loss of the normalised gradient (:func:`moara_jax.osd_project`).

    Attributes:
      basis_lr: the basis's step size, a number or a schedule; ``None`` (the reference's):
        ``lr_t / (peak_lr * update_proj_gap)``, the model's learning rate ``lr_t``.
      peak_lr: the learning rate that schedule is divided by; with a constant learning rate
        ``None`` takes it, with a schedule it must be given (the trainer passes ``train.lr``).
      b1, b2, eps, weight_decay: the basis's AdamW (PyTorch's defaults).
    """

    basis_lr: Any = None
    peak_lr: float | None = None
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01

    def __post_init__(self):
        if self.peak_lr is not None and not (_real(self.peak_lr) and self.peak_lr > 0):
            raise ValueError(f"peak_lr must be a positive number, got {self.peak_lr!r}")
        if self.basis_lr is not None and not (
            callable(self.basis_lr) or (_real(self.basis_lr) and self.basis_lr >= 0)
        ):
            raise ValueError(f"basis_lr must be a non-negative number or a schedule, got {self.basis_lr!r}")
        for field in ("b1", "b2"):
            if not (_real(getattr(self, field)) and 0 <= getattr(self, field) < 1):
                raise ValueError(f"{field} must be in [0, 1), got {getattr(self, field)!r}")
        for field in ("eps", "weight_decay"):
            if not (_real(getattr(self, field)) and getattr(self, field) >= 0):
                raise ValueError(f"{field} must be a non-negative number, got {getattr(self, field)!r}")


@dataclasses.dataclass(frozen=True)
class LDAdam:
    """LDAdam (Robert et al., https://arxiv.org/abs/2410.16103), its official ``LDAdamW``: the
    basis moves every step (one warm-started power-iteration step on the gradient mixed with
    the back-projected first moment), the moments move with it, and what projection and
    transport drop is fed back into the next step (:func:`moara_jax.ldadam`). Its Adam, for
    the target matrices and every other parameter, is PyTorch ``AdamW``'s (``eps`` added to the
    bias-corrected root, weight decay before the step); the reference applies no ``scale``
    (``scale=1``) and defaults to ``b1, b2, eps = 0.908, 0.99, 1e-8``. Gradient clipping (the
    trainer's ``train.grad_clip``) clips the fresh gradient; the reference, whose error lives in
    the gradient buffer, would clip gradient plus error.

    Attributes:
      rho: weight of the back-projected first moment in the matrix the basis follows.
      error_feedback: carry the dropped part of each step into the next.
    """

    rho: float = 0.908
    error_feedback: bool = True

    def __post_init__(self):
        if not (_real(self.rho) and 0 <= self.rho < 1):
            raise ValueError(f"rho must be a number in [0, 1), got {self.rho!r}")
        if not isinstance(self.error_feedback, bool):
            raise ValueError(f"error_feedback must be True or False, got {self.error_feedback!r}")


@dataclasses.dataclass(frozen=True)
class SubTrackPP:
    """SubTrack++ (Rajabi et al., https://arxiv.org/abs/2502.01586), as its official code runs
    it: an SVD basis at step 0, then every ``T`` steps one Grassmann geodesic step toward the
    gradient's subspace, Adam moments moved into the current basis (from the initial one) every
    ``T`` steps, and Fira's recovery scaling of the dropped gradient
    (:func:`moara_jax.subtrack_project`, :func:`moara_jax.transport_moments`, :func:`moara_jax.fira_adam`).

    Attributes:
      step_size: the geodesic's ``eta`` (the reference's Llama scripts: 10).
      growth_limit: the recovery term's norm-growth limit per step (Fira's ``gamma``).
      track_all: also move the bases of the fan_in side; the reference code leaves them at the
        step-0 SVD (its tangent there is zero up to rounding), which ``False`` reproduces.
    """

    step_size: float = 10.0
    growth_limit: float = 1.01
    track_all: bool = False

    def __post_init__(self):
        if not (_real(self.step_size) and self.step_size >= 0):
            raise ValueError(f"step_size must be a non-negative number, got {self.step_size!r}")
        if not (_real(self.growth_limit) and self.growth_limit > 0):
            raise ValueError(f"growth_limit must be positive, got {self.growth_limit!r}")
        if not isinstance(self.track_all, bool):
            raise ValueError(f"track_all must be True or False, got {self.track_all!r}")


Host = GaLore | Fira | QGaLore | OSD | LDAdam | SubTrackPP
HOSTS = {
    "galore": GaLore,
    "fira": Fira,
    "q_galore": QGaLore,
    "osd": OSD,
    "ldadam": LDAdam,
    "subtrack_pp": SubTrackPP,
}


def resolve_host(host: str | Host) -> Host:
    """A host's settings from its name (with defaults) or as given; ``ValueError`` otherwise."""
    if isinstance(host, tuple(HOSTS.values())):
        return host
    if isinstance(host, str) and host in HOSTS:
        return HOSTS[host]()
    raise ValueError(f"host must be one of {tuple(HOSTS)} or a host settings object, got {host!r}")
