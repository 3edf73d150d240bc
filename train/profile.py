"""Profiling (Algorithm 1, Phases 1-3): the configured host (the paper's: GaLore) with uniform ranks
and no decomposition records ``S(W, t)`` every ``x`` steps;
``S_tau`` per module type (mean over matrices, layers and the profiling steps after
``profile.from_step``, plus an EMA-smoothed trajectory) gives the receivers (lowest ``S_tau``) of
the allocation file a training run reads.

Each basis ages until the next refresh, and the alignment falls with it; the first basis comes
from the first step's gradient, at the initial weights. Its recordings can order the module types
otherwise than every later basis's (Llama 2 60M: ``mlp.down`` best aligned under it, lowest
under the next), so the outputs give ``S_tau`` per basis too, and a note where leaving the
first basis out would choose other receivers. ``python -m train.profile RUN_DIR --from-step N``
reads a finished profile's recordings again with another ``from_step``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from collections import defaultdict

import numpy as np

import moara_jax as mj
from train.config import RunConfig, load_config
from train.errors import UserError, cli, io_operation
from train.plots import figure
from train.rundir import ALIGNMENT, ALIGNMENT_PLOT, ALLOCATION, RunDir, make_directory
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

    def s_tau(self, from_step: int = 0) -> dict[str, float]:
        """Each module type's mean alignment over the steps recorded after ``from_step``, in the
        paper's order ({} when none is)."""
        return self._mean([i for i, step in enumerate(self.steps) if step > from_step])

    def by_basis(self, gap: int) -> dict[int, dict]:
        """The recordings grouped by the basis they were made under (a refresh every ``gap``
        steps, the first at step 1): ``{basis step: {"recordings": n, "s_tau": {...}}}``."""
        made_by = [basis_step(s, gap) for s in self.steps]
        out = {}
        for start in sorted(set(made_by)):
            kept = [i for i, b in enumerate(made_by) if b == start]
            out[start] = {"recordings": len(kept), "s_tau": self._mean(kept)}
        return out

    def _mean(self, kept: list[int]) -> dict[str, float]:
        if not kept:
            return {}
        return {k: float(np.mean([self.values[k][i] for i in kept])) for k in paper_order(self.values)}


# The hosts whose bases change every optimizer.update_proj_gap steps, the first made at step 1
# (SubTrack++ moves its bases by a geodesic step there): Q-GaLore lengthens a matrix's interval as
# its bases settle, and OSD and LDAdam move their bases at every step, so their recordings do not
# fall into windows of one basis.
PERIODIC_HOSTS = ("galore", "fira", "subtrack_pp")


def refresh_gap(cfg: RunConfig) -> int | None:
    """Steps between the profile's basis refreshes, where its host refreshes on a fixed period."""
    return cfg.optimizer.update_proj_gap if cfg.optimizer.host in PERIODIC_HOSTS else None


def basis_step(step: int, gap: int) -> int:
    """The step whose gradient made the basis that step ``step`` projects with (a refresh every
    ``gap`` steps, the first at step 1)."""
    return 1 + gap * ((step - 1) // gap)


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
    """``alignment.json``, ``allocation.json`` and ``alignment.png`` of a profile's recordings in
    ``run_dir``; prints ``S_tau``, the allocation and the first basis's note (:func:`first_basis_note`)."""
    from_step, gap = cfg.profile.from_step, refresh_gap(cfg)
    s_tau = rec.s_tau(from_step)
    if not s_tau:
        raise UserError(
            f"profile.from_step ({from_step}) leaves out every recording (the last at step "
            f"{rec.steps[-1] if rec.steps else None}): nothing to choose an allocation from"
        )
    allocation = choose_allocation(s_tau, cfg)
    note = first_basis_note(rec, cfg, allocation["receivers"])
    alignment = {
        "steps": rec.steps,
        "from_step": from_step,
        "s_tau": s_tau,
        "update_proj_gap": cfg.optimizer.update_proj_gap,
        # (None for a host whose bases do not refresh on a fixed period: PERIODIC_HOSTS)
        "s_tau_by_basis": {str(k): v for k, v in rec.by_basis(gap).items()} if gap else None,
        "trajectories": {k: rec.values[k] for k in s_tau},
        "ema": {k: rec.smoothed[k] for k in s_tau},
        "ema_decay": rec.ema,
        "block_size": cfg.optimizer.block_size,
        "r_base": cfg.optimizer.r_base,
        "note": note,
    }
    with io_operation("writing the profile's outputs to", run_dir):
        (run_dir / ALIGNMENT).write_text(json.dumps(alignment, indent=2))
        (run_dir / ALLOCATION).write_text(json.dumps(allocation, indent=2))
        _plot(rec, run_dir / ALIGNMENT_PLOT, from_step, gap)
    order = sorted(s_tau, key=s_tau.get)
    after = f" after step {from_step}" if from_step else ""
    print(f"S_tau{after} (lowest first): " + ", ".join(f"{k} {s_tau[k]:.4f}" for k in order))
    print(f"allocation -> {run_dir / ALLOCATION}: {allocation['ranks']}")
    if note:
        print(f"note: {note}")
    return {"s_tau": s_tau, "allocation": allocation}


def first_basis_note(rec: AlignmentRecorder, cfg: RunConfig, receivers: list[str]) -> str | None:
    """Where ``S_tau`` holds recordings made under the first basis (from the first step's
    gradient, at the initial weights) and the recordings under later bases alone would choose
    other receivers, a line saying so and how to leave them out; else None."""
    gap, from_step = refresh_gap(cfg), cfg.profile.from_step
    if gap is None:
        return None
    first = [s for s in rec.steps if from_step < s <= gap]
    later = rec.s_tau(max(from_step, gap))
    if not first or not later:
        return None
    other = choose_allocation(later, cfg)["receivers"]
    if other == receivers:
        return None
    kept = sum(s > from_step for s in rec.steps)
    order = sorted(later, key=later.get)
    return (
        f"{len(first)} of the {kept} recordings in S_tau were made under the first basis (step 1's "
        f"gradient, at the initial weights); without them (profile.from_step={gap}) the receivers "
        f"would be {other}, not {receivers}. S_tau after step {gap} (lowest first): "
        + ", ".join(f"{k} {later[k]:.4f}" for k in order)
    )


def _plot(rec: AlignmentRecorder, path: pathlib.Path, from_step: int, gap: int | None) -> None:
    """Each module type's recorded ``S`` (what ``S_tau`` averages), the refreshes of the basis as
    dotted lines and the steps ``from_step`` leaves out shaded."""
    fig = figure(ALIGNMENT_PLOT, figsize=(7, 4))
    if fig is None:
        return
    ax = fig.subplots()
    for label in paper_order(rec.values):
        ax.plot(rec.steps, rec.values[label], marker=".", label=label)
    for refresh in range(gap + 1, rec.steps[-1] + 1, gap) if gap else ():
        ax.axvline(refresh, color="0.6", linestyle=":", linewidth=1)
    if from_step:
        ax.axvspan(0, from_step, color="0.9", zorder=0)
    ax.set_xlabel("step (dotted: a new basis)" if gap else "step")
    ax.set_ylabel("S: cos(G, G_recon), mean over the matrices")
    left_out = f"; S_tau from the steps after {from_step}" if from_step else ""
    ax.set_title(f"alignment per module type{left_out}", fontsize=10)
    ax.legend()
    fig.savefig(path, dpi=120)


def recordings(run: RunDir) -> AlignmentRecorder:
    """A finished profile's recordings, from its ``alignment.json``."""
    path = run.path / ALIGNMENT
    if not path.is_file():
        raise UserError(f"{run.path} holds no {ALIGNMENT}: not a finished profiling run")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        rec = AlignmentRecorder(float(data["ema_decay"]))
        rec.load({"steps": data["steps"], "values": data["trajectories"], "smoothed": data["ema"]})
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path}: not a profile's alignment record ({e!r})") from None
    return rec


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train.profile",
        description="A finished profile's S_tau and allocation again, from its recordings after "
        "--from-step (the first basis, made from step 1's gradient at the initial weights, left out "
        "with --from-step update_proj_gap): alignment.json, allocation.json and alignment.png.",
    )
    parser.add_argument("run_dir", type=pathlib.Path, help="a completed profiling run's dir (mode: profile)")
    parser.add_argument(
        "--from-step", type=int, required=True, help="leave out the recordings up to this step"
    )
    parser.add_argument(
        "--out", type=pathlib.Path, default=None, help="where the files go (default: RUN_DIR/from-step-N)"
    )
    args = parser.parse_args(argv)

    def body() -> int:
        run = RunDir(args.run_dir)
        if not run.path.is_dir():
            raise UserError(f"run dir {run.path}: no such directory")
        rec = recordings(run)
        if not run.config_file.is_file():
            raise UserError(f"{run.path} holds no {run.config_file.name}")
        cfg = load_config(run.config_file, [f"profile.from_step={args.from_step}"])
        out = args.out if args.out is not None else run.path / f"from-step-{args.from_step}"
        make_directory(out, "--out", "making the directory of the profile's outputs")
        write_outputs(rec, out, cfg)
        return 0

    return cli(body)


if __name__ == "__main__":
    raise SystemExit(main())
