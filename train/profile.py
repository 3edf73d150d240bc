"""Profiling (Algorithm 1, Phases 1-3): the configured host (the paper's: GaLore) with uniform ranks
and no decomposition records ``S(W, t)`` every ``x`` steps;
``S_tau`` per module type (mean over matrices, layers and profiling steps, plus an EMA-smoothed
trajectory) gives the receivers (lowest ``S_tau``) of the allocation file a training run reads."""

from __future__ import annotations

import json
import pathlib
from collections import defaultdict

import numpy as np

import moara_jax as mj
from train.config import RunConfig
from train.errors import io_operation
from train.plots import figure
from train.rundir import ALIGNMENT, ALIGNMENT_PLOT, ALLOCATION
from train.step import donor_delta, on_model, paper_order


class AlignmentRecorder:
    def __init__(self, ema: float):
        self.ema = ema
        self.steps: list[int] = []
        self.values: dict[str, list[float]] = defaultdict(list)
        self.smoothed: dict[str, list[float]] = defaultdict(list)

    def record(self, step: int, per_matrix: dict) -> None:
        by_module: dict[str, list[float]] = defaultdict(list)
        for path, s in per_matrix.items():
            label = mj.module_label(path)
            if label != "other":
                by_module[label].extend(np.ravel(np.asarray(s, np.float64)).tolist())
        self.steps.append(step)
        for label, vals in by_module.items():
            v = float(np.mean(vals))
            self.values[label].append(v)
            prev = self.smoothed[label][-1] if self.smoothed[label] else v
            self.smoothed[label].append(self.ema * prev + (1 - self.ema) * v)

    def state(self) -> dict:
        """The recordings so far (JSON), saved with each checkpoint so a resumed profile goes on."""
        return {"steps": self.steps, "values": dict(self.values), "smoothed": dict(self.smoothed)}

    def load(self, state: dict) -> None:
        self.steps = [int(s) for s in state["steps"]]
        self.values = defaultdict(list, {k: list(v) for k, v in state["values"].items()})
        self.smoothed = defaultdict(list, {k: list(v) for k, v in state["smoothed"].items()})

    def s_tau(self) -> dict[str, float]:
        """Each module type's mean alignment over the recorded steps, in the paper's order."""
        return {k: float(np.mean(self.values[k])) for k in paper_order(self.values)}


def choose_allocation(s_tau: dict[str, float], cfg: RunConfig) -> dict:
    """Receivers: the ``num_receivers`` lowest-``S_tau`` types that are not donors (a tie goes to
    the type first in the paper's order). Donors the model lacks are taken by their structural
    counterparts (``profile.donors`` q and k are MLA's q_b and kv_b), else refused."""
    types = paper_order(s_tau)
    donors = on_model("profile.donors", list(cfg.profile.donors), types)
    candidates = sorted((t for t in types if t not in donors), key=lambda t: s_tau[t])
    if cfg.profile.num_receivers > len(candidates):
        raise ValueError(
            f"profile.num_receivers ({cfg.profile.num_receivers}) is more than the {len(candidates)} "
            f"module types that are not donors ({donors})"
        )
    receivers = candidates[: cfg.profile.num_receivers]
    r_base = cfg.optimizer.r_base
    delta = donor_delta(r_base, len(donors), len(receivers))
    ranks = mj.allocate_ranks(r_base, types, donors, receivers, delta)
    return {
        "r_base": r_base,
        "delta": delta,
        "donors": donors,
        "receivers": receivers,
        "ranks": ranks,
        "s_tau": {t: s_tau[t] for t in types},
    }


def write_outputs(rec: AlignmentRecorder, run_dir: pathlib.Path, cfg: RunConfig) -> dict:
    s_tau = rec.s_tau()
    if not s_tau:
        raise RuntimeError("profiling recorded no alignment (profile.every > steps?)")
    alignment = {
        "steps": rec.steps,
        "s_tau": s_tau,
        "trajectories": {k: rec.values[k] for k in s_tau},
        "ema": {k: rec.smoothed[k] for k in s_tau},
        "ema_decay": rec.ema,
        "block_size": cfg.optimizer.block_size,
        "r_base": cfg.optimizer.r_base,
    }
    allocation = choose_allocation(s_tau, cfg)
    with io_operation("writing the profile's outputs to", run_dir):
        (run_dir / ALIGNMENT).write_text(json.dumps(alignment, indent=2))
        (run_dir / ALLOCATION).write_text(json.dumps(allocation, indent=2))
        _plot(rec, run_dir / ALIGNMENT_PLOT)
    order = sorted(s_tau, key=s_tau.get)
    print("S_tau (lowest first): " + ", ".join(f"{k} {s_tau[k]:.4f}" for k in order))
    print(f"allocation -> {run_dir / ALLOCATION}: {allocation['ranks']}")
    return {"s_tau": s_tau, "allocation": allocation}


def _plot(rec: AlignmentRecorder, path: pathlib.Path) -> None:
    fig = figure(ALIGNMENT_PLOT, figsize=(7, 4))
    if fig is None:
        return
    ax = fig.subplots()
    for label in paper_order(rec.values):
        ax.plot(rec.steps, rec.smoothed[label], label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("S (EMA)")
    ax.set_title("cos(G, G_recon) per module type")
    ax.legend()
    fig.savefig(path, dpi=120)
