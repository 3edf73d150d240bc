"""A run directory: its layout (the one place that names its files), its readers, one writer at a
time (a lock), the summary (a completed run resumed to go on keeps its completed record), the
training-curve plot and the start-up banner.

Layout of ``RUN_DIR`` (``python -m train --run-dir RUN_DIR``)::

    config.yaml            the run's config, as validated
    model.json             the models.ModelConfig the run built
    metrics.jsonl          one object per logged step and per evaluation
    summary.json           written when the run ends, and when a completed run is resumed to go on
    summary.completed-N.json   the record of the completed run of N steps that a resume went on from
    checkpoints.completed-N/   its last checkpoint (hard links), out of orbax's rotation
    config.completed-N.yaml    its config
    curves.png             training loss and eval ppl against step
    checkpoints/STEP/      orbax checkpoints
    checksums/STEP.json    sha256 of every file of a finished checkpoint
    rejected_checkpoints/  checkpoints that failed verification or held diverging weights
    alignment.json, allocation.json, alignment.png    a profiling run's outputs
    tensorboard/, wandb/   metric writers' files
    eval/                  python -m train.evaluate's default output
    .lock                  held by the process that writes the run dir
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import shutil
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

import yaml

from train.errors import IOFault, UserError, io_operation, yaml_problem
from train.plots import figure

if TYPE_CHECKING:  # (train.config imports JAX, which reading a run dir does not need)
    from train.config import Change

CONFIG = "config.yaml"
MODEL = "model.json"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
CURVES = "curves.png"
CHECKPOINTS = "checkpoints"
CHECKSUMS = "checksums"
REJECTED = "rejected_checkpoints"
ALIGNMENT = "alignment.json"
ALLOCATION = "allocation.json"
ALIGNMENT_PLOT = "alignment.png"
TENSORBOARD = "tensorboard"
EVAL = "eval"
LOCK = ".lock"

# The files that say what a run did (no checkpoints): what a results archive keeps.
RECORD_FILES = (CONFIG, MODEL, METRICS, SUMMARY, CURVES, ALIGNMENT, ALLOCATION, ALIGNMENT_PLOT)


def read_metrics(path: pathlib.Path) -> list[dict]:
    """The rows of a ``metrics.jsonl``; a damaged line (cut short by a process killed while
    writing it, bytes that are not UTF-8, JSON that is not a row of a step) is left out."""
    rows = []
    for line in pathlib.Path(path).read_bytes().splitlines():
        try:
            row = json.loads(line) if line.strip() else None
        except ValueError:  # (UnicodeDecodeError among them)
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def dedupe_by_step(rows: list[dict], key: str) -> list[dict]:
    """Rows holding ``key``, one per step (the last written wins: a resumed run rewrites the
    steps after its checkpoint)."""
    by_step = {}
    for r in rows:
        if key in r:
            by_step[r["step"]] = r
    return [by_step[s] for s in sorted(by_step)]


def config_text(config: dict) -> str:
    """A run's resolved config as its ``config.yaml`` holds it (and ``--print-config`` prints it)."""
    return yaml.safe_dump(config, sort_keys=False)


@dataclass(frozen=True)
class RunDir:
    """A run directory's paths and readers (nothing is read until asked)."""

    path: pathlib.Path

    def __init__(self, path):
        object.__setattr__(self, "path", pathlib.Path(path))

    def __truediv__(self, name: str) -> pathlib.Path:
        return self.path / name

    def __str__(self) -> str:
        return str(self.path)

    def __fspath__(self) -> str:
        return str(self.path)

    @property
    def name(self) -> str:
        return self.path.name

    # ------------------------------------------------------------------------------- paths

    @property
    def config_file(self) -> pathlib.Path:
        return self.path / CONFIG

    @property
    def model_file(self) -> pathlib.Path:
        return self.path / MODEL

    @property
    def metrics_file(self) -> pathlib.Path:
        return self.path / METRICS

    @property
    def summary_file(self) -> pathlib.Path:
        return self.path / SUMMARY

    @property
    def checkpoints(self) -> pathlib.Path:
        return self.path / CHECKPOINTS

    @property
    def checksums(self) -> pathlib.Path:
        return self.path / CHECKSUMS

    @property
    def rejected(self) -> pathlib.Path:
        return self.path / REJECTED

    # ----------------------------------------------------------------------------- readers

    def has_checkpoints(self) -> bool:
        """Whether ``checkpoints/`` holds a checkpoint (a run to resume, not to start)."""
        d = self.checkpoints
        return d.is_dir() and any(p.name.isdigit() for p in d.iterdir())

    def config(self) -> dict:
        """The run's ``config.yaml`` as a mapping."""
        if not self.config_file.is_file():
            raise UserError(f"{self.path} holds no {CONFIG}: not a run dir of python -m train")
        try:
            config = yaml.safe_load(self.config_file.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as e:
            raise UserError(f"{self.config_file} is not UTF-8 text (byte {e.start})") from None
        except yaml.YAMLError as e:
            raise UserError(f"{self.config_file} is not valid YAML{yaml_problem(e)}") from None
        if not isinstance(config, dict):
            raise UserError(f"{self.config_file} is not a mapping of settings")
        return config

    def setting(self, section: str, key: str):
        """One setting of the run's ``config.yaml``."""
        return (self.config().get(section) or {}).get(key)

    def summary(self) -> dict | None:
        """``summary.json`` (None without one, or when it is not a JSON object)."""
        try:
            summary = json.loads(self.summary_file.read_text()) if self.summary_file.is_file() else None
        except ValueError:
            return None
        return summary if isinstance(summary, dict) else None

    def status(self) -> str | None:
        """The status its ``summary.json`` records (None without one)."""
        return (self.summary() or {}).get("status")

    def state(self) -> str:
        """``completed``, ``failed`` (stopped by the divergence guard: resumed from the checkpoint
        it kept, the same steps would diverge again), ``resumable`` (checkpoints of an unfinished
        run) or ``new`` (also a run a fault of the machine stopped before its first checkpoint:
        it is run again)."""
        status = self.status()
        if status == "completed":
            return "completed"
        if status in ("nan", "diverged"):
            return "failed"
        return "resumable" if self.has_checkpoints() else "new"

    def sessions(self) -> list:
        """The ``(start, end, host)`` of the run's earlier sessions, for overlap checks."""
        return list((self.summary() or {}).get("sessions", []))

    def recorded_data(self, key: str):
        """``key`` of the data section of the run's summary (None without one)."""
        return ((self.summary() or {}).get("data") or {}).get(key)

    def recorded_tokenizer(self) -> dict | None:
        """The tokenizer identity the run's summary records (None without one)."""
        return self.recorded_data("tokenizer")

    def rows(self, key: str | None) -> list[dict]:
        """The ``metrics.jsonl`` rows that hold ``key``, one per step (``None``: every row as
        written); none without the file."""
        if not self.metrics_file.is_file():
            return []
        rows = read_metrics(self.metrics_file)
        return rows if key is None else dedupe_by_step(rows, key)

    def evals(self) -> list[dict]:
        return self.rows("eval_ppl")

    def tokenizer(self, override: str | None = None):
        """The tokenizer the run trained with (``override``: another path to the same model file,
        e.g. when the run dir moved), checked against the one its summary records."""
        from train.sources import describe_tokenizer, make_tokenizer, tokenizer_option

        spec = override or self.setting("data", "tokenizer") or "bytes"
        if override:
            tok = tokenizer_option(spec)
        else:
            # A relative data.tokenizer is relative to where the run started: the path its summary
            # records (written as each session ends) where that is there.
            recorded_path = self.recorded_data("tokenizer_path")
            relative = spec != "bytes" and not pathlib.Path(spec).expanduser().is_absolute()
            if relative and recorded_path and pathlib.Path(recorded_path).exists():
                spec = recorded_path
            try:
                tok = make_tokenizer(spec)
            except UserError as e:
                if pathlib.Path(spec).expanduser().exists():  # there, but not a tokenizer
                    raise
                raise UserError(f"{e}; pass --tokenizer with the run's tokenizer") from None
        recorded = self.recorded_tokenizer()
        if recorded and {**recorded, "name": None} != {**tok.identity(), "name": None}:
            raise UserError(
                f"the tokenizer {spec} is {describe_tokenizer(tok.identity())}, but the run in "
                f"{self.path} trained with {describe_tokenizer(recorded)}; pass --tokenizer with that "
                "model file"
            )
        return tok

    def model_config(self):
        """The ``models.ModelConfig`` the run built: its ``model.json``, or for a run made before
        runs wrote one, rebuilt from its ``config.yaml`` and the tokenizer its summary records."""
        import models
        from train.config import load_config
        from train.model import model_config

        if not self.path.exists():
            raise UserError(f"run dir {self.path}: no such directory")
        if self.model_file.is_file():
            try:
                return models.ModelConfig(**json.loads(self.model_file.read_text()))
            except (TypeError, ValueError) as e:
                raise UserError(f"{self.model_file}: {e}") from None
        if not self.config_file.is_file():
            raise UserError(
                f"{self.path} holds neither {MODEL} nor {CONFIG}: not a run dir of python -m train"
            )
        cfg = load_config(self.config_file)
        recorded = self.recorded_tokenizer()
        if recorded is None:
            from train.sources import make_tokenizer

            recorded = {"vocab_size": make_tokenizer(cfg.data.tokenizer).vocab_size}
        return model_config(cfg, int(recorded["vocab_size"]))

    def check_resumable(self, config: dict) -> list[Change]:
        """Refuses a resume whose config changes what the checkpoint or the data order depend on
        (``config``: the new run's, as a mapping); returns the changes it may make."""
        from train.config import check_resumable

        if not self.config_file.is_file():  # written before the first step: removed since
            raise UserError(
                f"--resume: {self} holds checkpoints but no {CONFIG} to check this run's settings "
                "against (batch, seed, model and optimizer must be the checkpoints'); put it back, "
                "or choose another run dir"
            )
        return check_resumable(self.config(), config)

    # ----------------------------------------------------------------------------- writers

    def write_config(self, config: dict) -> None:
        write_atomically(self.config_file, config_text(config))

    def write_model(self, model_config: dict) -> None:
        write_atomically(self.model_file, json.dumps(model_config, indent=1) + "\n")

    def write_summary(self, summary: dict) -> None:
        write_atomically(self.summary_file, json.dumps(summary, indent=2, default=str))

    def completed_record(self, steps: int) -> tuple[pathlib.Path, pathlib.Path, pathlib.Path]:
        """Where ``reopen`` keeps the completed run of ``steps`` steps: its summary, its config and
        its last checkpoint."""
        return (
            self.path / f"summary.completed-{steps}.json",
            self.path / f"config.completed-{steps}.yaml",
            self.path / f"checkpoints.completed-{steps}",
        )

    def reopen(self, step: int) -> pathlib.Path:
        """A completed run resumed short of its end (to more steps, or from an earlier checkpoint):
        its summary is kept as ``summary.completed-N.json`` (N: the steps it completed), and
        ``summary.json`` records the run as interrupted at ``step`` until this attempt ends, so a
        kill on the way leaves a resumable run, not a completed one whose metrics go on past it.
        Its last checkpoint is kept as ``checkpoints.completed-N/``, hard links to its files (no
        copy; a copy where the filesystem has no links), which orbax's rotation (``checkpoint.keep``)
        does not reach: the completed run's weights stay; its config as ``config.completed-N.yaml``.
        Returns the kept record's path."""
        completed = self.summary()
        kept, kept_config, kept_checkpoint = self.completed_record(completed["steps"])
        last = self.checkpoints / str(completed["steps"])
        if last.is_dir() and not kept_checkpoint.exists():
            tmp = self.path / f".{kept_checkpoint.name}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(last, tmp, copy_function=_link_or_copy)
            os.replace(tmp, kept_checkpoint)
        if self.config_file.is_file():
            write_atomically(kept_config, self.config_file.read_text())
        write_atomically(kept, self.summary_file.read_text())
        interrupted = completed | {
            "status": "interrupted",
            "stop_reason": f"resumed from step {step} to go on from the completed run ({kept.name})",
            "first_bad_step": None,
            "steps": step,
            "last_checkpoint": step,
        }
        if step != completed["steps"]:  # from an earlier checkpoint: the end's results are not its
            interrupted |= {
                "final_eval_loss": None,
                "final_eval_ppl": None,
                "final_eval_step": None,
                "profile": None,
            }
        self.write_summary(interrupted)
        return kept


def _link_or_copy(src: str, dst: str) -> None:
    """A hard link of ``src`` at ``dst``, or a copy where the filesystem makes none."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def check_directory_path(path: pathlib.Path, flag: str) -> None:
    """Refuses ``path`` (given as ``flag``) as a directory to write into when it, or the nearest
    of its parents that exists, is no directory (a file, a dangling link): one line, before any
    work (mkdir would fail late)."""
    for where in [path, *path.parents]:
        if where.exists() or where.is_symlink():  # (a dangling link: mkdir would fail on it)
            if not where.is_dir():
                raise UserError(f"{flag} {path}: {where} is not a directory")
            return


def make_directory(path: pathlib.Path, flag: str, operation: str) -> None:
    """Creates ``path`` (given as ``flag``) and its parents: a machine fault is an ``IOFault``
    naming ``operation``; any other refusal (a place no directory can be made, e.g. under
    ``/proc``) one line naming ``flag``."""
    try:
        with io_operation(operation, path):
            path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot create it ({e.strerror or e})") from None


def write_atomically(path: pathlib.Path, text: str, if_changed: bool = True) -> None:
    """``path`` holds ``text``, or (a write cut short: a full disk, a kill) what it held before:
    never a torn file. Unchanged text is not written again (a resume on a full disk keeps going)
    unless ``if_changed`` is False: then the file is always a new one (a new inode)."""
    if if_changed and path.is_file() and path.read_bytes() == text.encode():
        return
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class RunLock:
    """An exclusive ``flock`` on ``RUN_DIR/.lock`` held for the run's life. The kernel releases
    it when the process ends, however it ends, so a lock left by a dead process never blocks;
    the file names the holder (pid, host) for the error a second process gets."""

    def __init__(self, run_dir):
        self.path = pathlib.Path(run_dir) / LOCK
        self.file = None

    def acquire(self) -> RunLock:
        run_dir = self.path.parent
        if (run_dir.exists() or run_dir.is_symlink()) and not run_dir.is_dir():  # a file, a dangling link
            what = "a link to nothing" if not run_dir.exists() else "a file"
            raise UserError(f"run dir {run_dir} is {what}, not a directory; choose another --run-dir")
        if run_dir.is_dir() and not self.path.exists():
            # Files of a run's names, but no run's (it makes the lock file first): the user's own,
            # e.g. the config the run was started from, which a run there would replace.
            theirs = [name for name in RECORD_FILES if (run_dir / name).exists()]
            if theirs and not any((run_dir / name).exists() for name in (MODEL, SUMMARY, CHECKPOINTS)):
                raise UserError(
                    f"run dir {run_dir} holds {', '.join(theirs)} but no run (no {LOCK}, {MODEL}, "
                    f"{SUMMARY} or {CHECKPOINTS}/): a run there would replace them; choose another "
                    "--run-dir"
                )
        operation = "opening the run dir's lock file in" if run_dir.is_dir() else "creating the run dir"
        try:
            with io_operation(operation, run_dir):
                run_dir.mkdir(parents=True, exist_ok=True)
                f = open(self.path, "a+")  # noqa: SIM115 - held open until release
        except OSError as e:  # not the machine's fault: a path that cannot be a directory
            raise UserError(f"cannot use {run_dir} as a run dir: {e.strerror or e}") from None
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise UserError(
                f"run dir {run_dir} is in use by {self.holder(run_dir)}; wait for it to end or "
                "choose another --run-dir"
            ) from None
        self.file = f  # held, then named: a fault writing the name releases it
        try:
            with io_operation("writing the run dir's lock file", self.path):
                f.seek(0)
                f.truncate()
                f.write(f"pid {os.getpid()} on host {socket.gethostname()}")
                f.flush()
        except IOFault:
            self.release()
            raise
        return self

    @staticmethod
    def held(run_dir) -> bool:
        """Whether a process holds the lock of ``run_dir`` now (a run in it is training)."""
        try:
            f = open(pathlib.Path(run_dir) / LOCK)  # noqa: SIM115 - closed below
        except OSError:  # no lock file: no run has held it
            return False
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:  # a filesystem without locks (ENOLCK): nothing known to hold it
            return False
        finally:
            f.close()  # (releases a lock taken here)
        return False

    @staticmethod
    def holder(run_dir) -> str:
        """Who holds the lock of ``run_dir``, as its holder wrote it (``pid N on host H``)."""
        try:
            return (pathlib.Path(run_dir) / LOCK).read_text().strip() or "another process"
        except OSError:
            return "another process"

    def release(self) -> None:
        if self.file is not None:
            # Closing the descriptor releases the flock. Closing flushes what a write left in the
            # buffer, which fails again on a full disk: the fault was said by the write.
            with contextlib.suppress(OSError):
                self.file.close()
            self.file = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def plot_curves(run: RunDir) -> pathlib.Path | None:
    """``curves.png``: training loss and eval ppl against step (when matplotlib is installed)."""
    fig = figure(CURVES, figsize=(11, 4))
    if fig is None:
        return None
    with io_operation("writing the plot", run / CURVES):
        return _plot_curves(fig, run)


def _plot_curves(fig, run: RunDir) -> pathlib.Path | None:
    train, evals = run.rows("loss"), run.evals()
    if not train:
        return None
    axes = fig.subplots(1, 2)
    axes[0].plot([r["step"] for r in train], [r["loss"] for r in train])
    axes[0].set_ylabel("training loss")
    if evals:
        axes[1].plot([r["step"] for r in evals], [r["eval_ppl"] for r in evals], marker="o")
        axes[1].set_yscale("log")
    axes[1].set_ylabel("eval ppl")
    for ax in axes:
        ax.set_xlabel("step")
    fig.suptitle(run.name)
    path = run / CURVES
    fig.savefig(path, dpi=100)
    return path


def banner(
    *,
    model: str,
    params: int,
    embedding_params: int,
    optimizer: str,
    ranks: dict | None,
    data: str,
    tokens_per_step: int,
    run_dir,
    mesh: str | None = None,
    whole: list[str] = (),
    split_heads: str | None = None,
    straddle: str | None = None,
) -> list[str]:
    """The lines printed when a run starts (a warning when the embedding and LM head hold most
    of the parameters: the step's cost is then mostly theirs, not the blocks'). ``mesh``: the
    mesh as made; ``whole``: parameter dimensions a mesh axis does not divide, left whole;
    ``split_heads``: what a tensor axis that splits attention heads does; ``straddle``: what
    magnitude blocks that span two devices do."""
    share = embedding_params / params
    lines = [
        f"model: {model}, {params:,} parameters ({share:.0%} in the embedding and LM head)",
        f"optimizer: {optimizer}" + (f", ranks {ranks}" if ranks else ""),
        data,
        f"tokens per step: {tokens_per_step:,}; run dir: {run_dir}",
    ]
    if mesh is not None:
        lines.insert(3, mesh)
    if whole:
        more = f" and {len(whole) - 2} more" if len(whole) > 2 else ""
        lines.append(
            f"warning: {len(whole)} parameter dimension(s) the mesh would shard stay whole on every "
            f"device, their mesh axis not dividing them: {'; '.join(whole[:2])}{more}"
        )
    lines += [f"warning: {said}" for said in (split_heads, straddle) if said]
    if share > 0.5:
        lines.append(
            f"warning: the embedding and LM head hold {share:.0%} of the parameters, so they dominate "
            "the step's time and memory (a small model with a large vocabulary); a smaller "
            "tokenizer or a larger model spends the compute on the blocks"
        )
    return lines
