"""``train_and_evaluate``: one training (or profiling) run, in five phases.

1. ``make_setup``: data, model config, mesh, shardings, optimizer and the abstract state (``Setup``);
2. ``restore_or_init``: the newest usable checkpoint, or a new state (``Start``);
3. ``open_run_dir``: the run dir's ``config.yaml`` and ``model.json`` (a completed run resumed to
   go on keeps its summary aside first), and the start-up banner;
4. ``StepLoop.run``: the jitted steps with the batch drawn ahead, each step's metrics read one
   step late, evaluation, checkpoints (SIGTERM-safe) and the divergence guard;
5. ``finish``: what a stop leaves behind, ``summary.json`` and the plots.

Phases 1 to 3 are ``train.setup``'s; this module runs them and holds 4 and 5.
"""

from __future__ import annotations

import dataclasses
import socket
import time
from dataclasses import dataclass

import jax
import numpy as np

import moara_jax as mj
import models
from train import profile as profiling
from train.checkpoint import Checkpointer
from train.config import MOVABLE_ON_RESUME, OPERATIONAL, Change, RunConfig, to_dict, under
from train.distributed import StopSignals, any_process, differs_from_first, errors_shared, first_error
from train.errors import IOFault, UserError, io_operation
from train.metrics import DivergenceGuard, MetricsWriter, Stop, make_sinks
from train.metrics import perplexity as ppl
from train.rundir import RunDir, RunLock, plot_curves
from train.setup import (
    Clock,
    Setup,
    Start,
    banner_lines,
    make_setup,
    open_run_dir,
    preset_note,
    rank_summary,
    restore_or_init,
    resumed_model,
    silent,
)
from train.sharding import ACTIVATION_RULES, global_batch, on_mesh, process_rows
from train.sources import tokenizer_path
from train.step import TrainState, all_finite, make_eval_step, make_train_step, mean_nll


def train_and_evaluate(cfg: RunConfig, run_dir, resume: bool = False, quiet: bool = False) -> dict:
    """Runs (or resumes) one training or profiling run in ``run_dir`` and returns its summary;
    the run dir is locked (by process 0) against a second writer for the whole run, and a run
    dir in use ends every process of a multi-process run with process 0's line."""
    main = _is_main_process()
    lock = RunLock(run_dir)
    try:
        with errors_shared():  # before any process reads the run dir
            if main:
                lock.acquire()
        return _run(cfg, RunDir(run_dir), resume, quiet, main)
    finally:
        lock.release()


def _run(cfg: RunConfig, run: RunDir, resume: bool, quiet: bool, main: bool) -> dict:
    clock = Clock()
    say = print if main and not quiet else silent
    changes = _check_run_dir(run, cfg, resume, main)
    built = resumed_model(run, cfg, resume)
    with errors_shared():  # e.g. one process's data file missing
        setup = make_setup(cfg, quiet, clock, built)
    with errors_shared():  # (a collective: after the block above, which every process passed)
        if differs_from_first(setup.data.identity()):
            raise UserError(
                f"the token store {setup.data.store.directory} holds other tokens than process 0's "
                "(built from other inputs?): give every process the same data, e.g. a data.store "
                "on shared storage"
            )
    ckpt = Checkpointer(run, cfg.checkpoint.keep, cfg.checkpoint.every, enabled=main)
    start = restore_or_init(setup, ckpt, resume, say=print if main else silent)
    # Kept in summary.json (changed_on_resume): the changes its results depend on, not where its
    # files are, how it is split or what it records (OPERATIONAL).
    kept = [str(c) for c in changes if not under(c.key, OPERATIONAL + MOVABLE_ON_RESUME)]
    if kept and start.resumed_from is not None:
        start = dataclasses.replace(start, changed=tuple(kept))
    if start.step == setup.total_steps and run.status() == "completed":
        ckpt.close()
        if main:
            print(f"{run} is already complete at step {start.step}; nothing to do")
        return run.summary()
    note = preset_note(run, cfg, setup, built) if start.resumed_from is not None else None
    if main and note:
        print(note)
    # Process 0's writes before the steps (the run files, metrics.jsonl rewritten on a resume,
    # the metric writers): a fault or refusal of one ends every process.
    with errors_shared():
        if main:
            open_run_dir(run, setup, start.step)
        loop = StepLoop(setup, run, ckpt, start, quiet=quiet, main=main, clock=clock)
    for line in banner_lines(setup, run):
        say(line)
    # SIGTERM/SIGINT stop the steps after a checkpoint; once the steps are done they wait for
    # the wrap-up (the last save, the summary), so a run that finished its steps is recorded.
    with StopSignals() as signals:
        outcome = loop.run(start.state, start.step, signals)
        return finish(loop, run, start, outcome, main)


def _check_run_dir(run: RunDir, cfg: RunConfig, resume: bool, main: bool) -> list[Change]:
    """Refuses a run dir this run cannot start or go on in (checkpoints without ``--resume``, a
    finished or failed run with nothing to continue from, a resume's changes it may not make);
    returns the changes a resume makes (said by process 0)."""
    changes: list[Change] = []
    if run.has_checkpoints():
        if not resume:
            raise UserError(
                f"{run} already holds checkpoints of a run; pass --resume to continue it, or "
                "choose another run dir"
            )
        changes = run.check_resumable(to_dict(cfg))  # those a resume may make
        if changes and main:
            listed = ", ".join(map(str, changes))
            print(f"--resume: settings changed since the run's {run.config_file.name}: {listed}")
    elif run.status() == "completed":  # its checkpoints removed, e.g. a run kept as a result
        raise UserError(
            f"{run} holds a completed run ({run.summary_file.name}) and no checkpoint to continue "
            "it from; choose another run dir"
        )
    elif run.state() == "failed":  # every checkpoint set aside: a new run would replace its record
        raise UserError(
            f"{run} holds a run that stopped with status {run.status()} ({run.summary_file.name}) and "
            "no checkpoint to continue it from; choose another run dir"
        )
    elif resume and run.rejected.is_dir() and any(run.rejected.iterdir()):  # by an earlier --resume
        raise UserError(
            f"--resume: {run} holds no checkpoint to continue from: the run's were set aside as not "
            f"usable ({run.rejected}); run without --resume to start it over (its metrics and "
            f"summary are replaced), or move a checkpoint back into {run.checkpoints}"
        )
    return changes


def _is_main_process() -> bool:
    """Whether this process writes the run dir's files (the first of a multi-process run)."""
    return jax.process_index() == 0


# ------------------------------------------------------------------------------- 4. the step loop


def eval_batches(data, t) -> list[tuple[np.ndarray, np.ndarray]]:
    """What an evaluation reads (``Data.val_batches``): the windows of ``t.eval_batches`` global
    batches, in batches of a micro-batch's rows (a run whose step fits memory only in micro-batches
    evaluates in them too)."""
    rows = t.micro_batch_size or t.batch_size
    return data.val_batches(rows, t.eval_batches * (t.batch_size // rows))


class Batches:
    """Train batches as global arrays of this process's rows, drawn one ahead of the step that
    uses them; remembers the iterator's state before the batch drawn ahead, which is what a
    checkpoint of the steps done so far must hold (a resume draws that batch again)."""

    def __init__(self, setup: Setup, iterator_state: dict | None):
        t = setup.cfg.train
        self.sharding = setup.batch_sharding
        self.shape = (t.batch_size, setup.data.window)
        self.rows = process_rows(self.sharding, self.shape)
        seed = t.seed if setup.cfg.data.seed is None else setup.cfg.data.seed
        self.iterator = setup.data.train_iterator(t.batch_size, seed, self.rows)
        if iterator_state is not None:
            self.iterator.set_state(iterator_state)
        self.before = self.iterator.get_state()

    def next(self) -> jax.Array:
        self.before = self.iterator.get_state()
        return global_batch(next(self.iterator), self.sharding, self.rows, self.shape)

    def state(self, drawn_ahead: bool) -> dict:
        return self.before if drawn_ahead else self.iterator.get_state()


@dataclass(frozen=True)
class Outcome:
    status: str  # completed | interrupted | io_error | the stop's (nan, diverged)
    steps: int  # the steps whose results passed the checks
    stop: Stop | None
    fault: IOFault | None = None  # the failed write of an io_error


def jit_train_step(setup: Setup, rules=ACTIVATION_RULES):
    """The run's train step, jitted with the state's and the batch's shardings (the state
    donated) and traced under the run's mesh and the activation ``rules`` (``on_mesh``)."""
    step = make_train_step(
        setup.model_cfg,
        setup.tx,
        setup.micro_batches,
        alignment_block=setup.cfg.optimizer.block_size,
        with_alignment=setup.profiling,
        alignment_every=setup.cfg.profile.every,
    )
    return jax.jit(
        on_mesh(step, setup.mesh, rules),
        in_shardings=(setup.shardings, setup.batch_sharding),
        out_shardings=(setup.shardings, None),
        donate_argnums=(0,),
    )


class _Unsaved(Exception):
    """A save refused, or a stop asked, where a process holds a fault: the steps end there with
    the status ``io_error``, nothing saved after the fault."""


class StepLoop:
    """The jitted steps and what happens between them.

    The host never waits for the step it just dispatched: it draws the next batch, then reads the
    previous step's metrics (that step is done, or nearly, as the device runs in order), so the
    device always has the next step queued. Steps that evaluate, checkpoint or stop read their
    own metrics at once."""

    def __init__(
        self,
        setup: Setup,
        run: RunDir,
        ckpt: Checkpointer,
        start: Start,
        *,
        quiet: bool,
        main: bool,
        clock: Clock,
    ):
        cfg, t = setup.cfg, setup.cfg.train
        self.setup, self.ckpt, self.clock = setup, ckpt, clock
        self.step_fn = jit_train_step(setup)
        rows = setup.batch_sharding
        row_weights = jax.sharding.NamedSharding(rows.mesh, jax.sharding.PartitionSpec(rows.spec[0]))
        self.eval_fn = jax.jit(
            on_mesh(make_eval_step(setup.model_cfg), setup.mesh),
            in_shardings=(setup.shardings.params, rows, row_weights),
        )
        self.val_batches = [
            (global_batch(b, rows, None, b.shape), global_batch(w, row_weights, None, w.shape))
            for b, w in eval_batches(setup.data, t)
        ]
        sinks = (
            make_sinks(cfg.metrics.writers, run, to_dict(cfg), cfg.metrics.wandb_project, start.resumed_from)
            if main
            else []
        )
        self.writer = MetricsWriter(
            run, setup.total_steps, start.resumed_from, quiet, enabled=main, sinks=sinks
        )
        self.recorder = profiling.AlignmentRecorder(cfg.profile.ema) if setup.profiling else None
        resumed = start.resumed_from is not None  # its extra holds RESUME_ITEMS (restore_or_init)
        if self.recorder is not None and resumed:
            self.recorder.load(start.extra["recorder"])
        self.guard = DivergenceGuard(t.divergence_factor, t.zero_grad_steps)
        if resumed:
            self.guard.load(start.extra["guard"])
        self.batches = Batches(setup, start.extra["iterator"] if resumed else None)
        # A resumed run's last evaluation so far (the writer has dropped the rows after its
        # checkpoint): the final one when no step is left to run.
        evals = run.evals() if resumed else []
        self.last_eval: float | None = evals[-1]["eval_loss"] if evals else None
        self.last_eval_step: int | None = evals[-1]["step"] if evals else None
        self.last_done = 0.0  # when the metrics of the last step read became available
        # The steps read since the last logged row, and their time (evaluations and saves left
        # out): a row's step time is their mean (see read_metrics).
        self.window_steps, self.window_s = 0, 0.0
        self.pending: tuple | None = None  # (step, metrics) of a step dispatched, not read yet
        self._cpu = jax.local_devices(backend="cpu")[0]
        # The schedule as one jitted program: ten times faster a call than its operations
        # dispatched one by one (measured on tiny.yaml's, 2026-11).
        self._lr = jax.jit(setup.lr)

    def run(self, state: TrainState, step: int, signals: StopSignals) -> Outcome:
        """Steps from ``step`` to the last, or to the step after which ``signals`` asks to stop;
        a fault of the machine (a write that fails) ends them with the status ``io_error``."""
        self.step, self.checked, self.first_step = step, step, step
        self.writer.faults.active = self.ckpt.faults.active = jax.process_count() > 1
        try:
            outcome = self._steps(state, signals)
        except IOFault as e:
            # A fault not held (maybe in this process alone): this process ends, the others lose a peer.
            outcome = Outcome("io_error", self.checked, None, e)
        finally:
            self.writer.faults.active = self.ckpt.faults.active = False
            self.writer.end_progress()
        closing = None
        try:
            self.writer.close()  # sinks flush their files (process 0's)
        except IOFault as e:
            closing = e
        if outcome.fault is not None:
            return outcome
        # A fault process 0 held, or its sinks' that could not close, ends every process with its
        # line (every process is here: the steps ended at the same step in each).
        fault = first_error(self._held() or closing)
        return Outcome("io_error", outcome.steps, None, fault) if fault else outcome

    def _steps(self, state: TrainState, signals: StopSignals) -> Outcome:
        try:
            return self._step_until_stopped(state, signals)
        except _Unsaved:  # nothing is saved after a fault a process holds
            return Outcome("io_error", self.checked, None)

    def _step_until_stopped(self, state: TrainState, signals: StopSignals) -> Outcome:
        total, t = self.setup.total_steps, self.setup.cfg.train
        stop = None
        batch = self.batches.next() if self.step < total else None
        # Resumed at the last step: its evaluation, unless the record has it (every process
        # evaluates where any finds it missing: a collective).
        if self.step == total and any_process(self.last_eval_step != total):
            self.evaluate(total, state.params)
        self.last_done = time.perf_counter()  # the first step's time includes its compilation
        while self.step < total:
            self.clock.mark("first_step_s")  # everything before it but its compilation
            state, metrics = self.step_fn(state, batch)
            self.step = step = self.step + 1
            batch = self.batches.next() if step < total else None
            evaluating = step % t.eval_every == 0 or step == total
            saving = self.ckpt.should_save(step) or step == total
            # Steps that evaluate or save read their own metrics at once (they may not go on).
            if (stop := self._read(step, metrics, now=evaluating or saving)) is not None:
                break
            if evaluating:
                self.evaluate(step, state.params)
            if saving:
                stop = self._checked_save(step, state, drawn_ahead=batch is not None)
                if stop is not None:
                    break
            if evaluating or saving:  # the next step's time starts here, not before them
                self.last_done = time.perf_counter()
            self.ckpt.record_if_finished()
            why = signals.at_step(self._held() is not None)  # the same step in every process
            if why == signals.FAULT:  # held by a process: nothing saved after it
                raise _Unsaved
            if why and step < total:  # after the last step it waits for the wrap-up (finish)
                stop = self._read_pending()
                if stop is None and not saving:  # the steps done so far are saved, then it stops
                    stop = self._checked_save(step, state, drawn_ahead=batch is not None)
                if stop is None:
                    return Outcome("interrupted", step, None)
                break
        if stop is None:
            stop = self._read_pending()
        if stop is not None:
            return Outcome(stop.status, stop.first_bad_step - 1, stop)
        return Outcome("completed", self.step, None)

    def _read(self, step: int, metrics, now: bool) -> Stop | None:
        """Reads the metrics of the step before (``pending``), then ``step``'s: ``now``, or kept
        pending until the next step is dispatched."""
        stop = self._read_pending()
        if stop is None and now:
            return self.read_metrics(step, metrics)
        if stop is None:
            self.pending = (step, metrics)
        return stop

    def _read_pending(self) -> Stop | None:
        pending, self.pending = self.pending, None
        return None if pending is None else self.read_metrics(*pending)

    def _checked_save(self, step: int, state: TrainState, drawn_ahead: bool) -> Stop | None:
        """``save``, once ``_may_save`` lets it (else ``_Unsaved``)."""
        if not self._may_save():
            raise _Unsaved
        return self.save(step, state, drawn_ahead=drawn_ahead)

    def _held(self) -> IOFault | None:
        """The fault of the machine this process holds (``HeldFaults``: several processes)."""
        return self.writer.faults.fault or self.ckpt.faults.fault

    def _may_save(self) -> bool:
        """Before a save (every process at the same step): the metric sinks hold every step up to
        it on the disk and the previous save's checksums are written, and a save goes ahead
        unless a process holds a fault (or this one raised it): a checkpoint saved after one
        would leave the steps before it without their metrics (or checksums) for good."""
        self.writer.flush()
        self.ckpt.record_finished()
        return not any_process(self._held() is not None)

    def host_lr(self, count: int) -> float:
        """The schedule's value, computed on the host's CPU: on an accelerator it would queue
        behind the step just dispatched and make the host wait for it."""
        with jax.default_device(self._cpu):
            return float(jax.device_get(self._lr(count)))

    def fetch(self, step: int, metrics) -> dict:
        """One explicit transfer of what a step's reading needs (a profile's alignments only at the
        steps it records): the host waits for this step once, not once per value."""
        recording = self.recorder is not None and step % self.setup.cfg.profile.every == 0
        wanted = ("loss", "grad_norm", "alignment") if recording else ("loss", "grad_norm")
        return jax.device_get({k: metrics[k] for k in wanted})

    def read_metrics(self, step: int, metrics) -> Stop | None:
        """Reads one step's metrics (waiting for that step only), checks them, logs them."""
        t, total = self.setup.cfg.train, self.setup.total_steps
        host = self.fetch(step, metrics)
        recording = "alignment" in host
        loss, grad_norm = float(host["loss"]), float(host["grad_norm"])
        now = time.perf_counter()
        dt, self.last_done = now - self.last_done, now
        step_lr = self.host_lr(step - 1)
        stop = self.guard.check(step, loss, grad_norm, step_lr)
        if stop is not None:
            return stop
        self.checked = step
        if recording:
            self.recorder.record(step, host["alignment"])
            self.writer.scalars(step, {f"alignment/S_{k}": v[-1] for k, v in self.recorder.values.items()})
        # A read's wait is not its step's time: the read of step k - 1 may return only when step
        # k is nearly done (seen on an H100: 0.6-5.5 ms "steps" of 50 at every step that reads its
        # own metrics at once), so a row's step time is the mean over the steps since the last row,
        # which their reads' waits add up to. This session's first step, which holds the
        # compilation, is left out of the mean (and logged alone where it is a logging step).
        first = step == self.first_step + 1
        if not first:
            self.window_steps, self.window_s = self.window_steps + 1, self.window_s + dt
        if step % t.log_every == 0 or step == total:
            step_time = dt if first else self.window_s / self.window_steps
            self.window_steps, self.window_s = 0, 0.0
            tokens_per_s = self.setup.tokens_per_step / step_time
            row = {"step": step, "loss": loss, "lr": step_lr, "grad_norm": grad_norm}
            row |= {"tokens_per_s": tokens_per_s, "step_time_s": step_time, "wall_s": self.writer.wall()}
            if first:  # this session's first: its time includes the compilation
                row["includes_compile"] = True
            self.writer.write(row)
            self.writer.progress(step, loss, tokens_per_s, step_time)
        return None

    def evaluate(self, step: int, params) -> None:
        loss = mean_nll(self.eval_fn, params, self.val_batches)
        self.last_eval, self.last_eval_step = loss, step
        self.writer.write(
            {"step": step, "eval_loss": loss, "eval_ppl": ppl(loss), "wall_s": self.writer.wall()}
        )
        self.writer.note(f"step {step}: eval loss {loss:.4f}, ppl {ppl(loss):.2f}")

    def save(self, step: int, state: TrainState, drawn_ahead: bool) -> Stop | None:
        """A checkpoint of the steps done (none while the gradient norm is exactly 0: it could
        replace the last good one); a stop when the parameters are not finite."""
        if self.guard.suspicious:
            self.writer.note(f"step {step}: no checkpoint while the gradient norm is exactly 0")
            return None
        if not bool(jax.device_get(all_finite(state.params))):
            return Stop("nan", f"non-finite parameters after step {step}", step + 1)
        extra = {
            "iterator": self.batches.state(drawn_ahead),
            "guard": self.guard.state(),
            "data_sha256": self.setup.data_sha256,
        }
        if self.recorder is not None:
            extra["recorder"] = self.recorder.state()
        self.ckpt.save(step, state, extra, force=True)
        return None


# ------------------------------------------------------------------------------------ 5. finish


def finish(loop: StepLoop, run: RunDir, start: Start, outcome: Outcome, main: bool) -> dict:
    """What a stop leaves (diverged checkpoints rejected, one error line), then the summary,
    the profile's outputs (a completed profile) and the plots. After a fault of the machine
    the partial checkpoint is removed, the summary written if it can be, and the fault raised
    with what was kept: in a multi-process run, process 0's fault after the steps (the last
    save's checksums, the summary, the profile's outputs, the plot) in every process."""
    setup, ckpt = loop.setup, loop.ckpt
    # No fault yet: every process is here with this outcome (a fault one held was shared by all;
    # one that ended this process alone was not, and the others are not here).
    together = outcome.fault is None
    if together:
        try:
            # A process's failed last save (process 0's checksums) is every process's, before the
            # summary says how the run ended.
            with errors_shared():
                if outcome.stop is not None:  # (a stop comes with no fault)
                    _report_stop(outcome, ckpt)  # its faults are every process's (reject_from)
                ckpt.close()  # waits for the last save
        except IOFault as e:
            outcome = Outcome("io_error", outcome.steps, None, e)
    if outcome.fault is not None:
        ckpt.abandon()
    kept = ckpt.complete_steps()  # after the last save, or after abandon removed a partial one
    summary = make_summary(loop, run, start, outcome)
    summary["last_checkpoint"] = kept[-1] if kept else None
    unwritten, summary_written = None, False
    if loop.recorder is not None:  # a partial profile gives no allocation; --resume finishes it
        done = outcome.status == "completed" and main
        try:
            summary["profile"] = profiling.write_outputs(loop.recorder, run.path, setup.cfg) if done else None
        except IOFault as e:
            unwritten, summary["profile"] = e, None
    if main:  # one writer per run dir in a multi-host run
        try:
            with io_operation("writing the summary to", run.summary_file):
                run.write_summary(summary)
            summary_written = True
            plot_curves(run)
        except IOFault as e:
            unwritten = unwritten or e
    error = None
    if outcome.fault is not None or unwritten is not None:
        lost = main and not summary_written and outcome.fault
        notes = [
            f"the last complete checkpoint, step {kept[-1]}, is in {ckpt.directory}"
            if kept
            else "no checkpoint was saved",
            f"{run.summary_file.name} was not written" if lost else "",
        ]
        error = (outcome.fault or unwritten).with_note("; ".join(filter(None, notes)))
    if together:
        error = first_error(error)
    if error is not None:
        raise error
    return summary


def _report_stop(outcome: Outcome, ckpt: Checkpointer) -> None:
    if outcome.status == "diverged":
        # Checkpoints saved from the step before the first bad one on hold diverging weights.
        ckpt.reject_from(outcome.stop.first_bad_step - 1)
    kept = ckpt.steps()
    where = (
        f"the last checkpoint before it, step {kept[-1]}, is kept in {ckpt.directory}"
        if kept
        else "no checkpoint was saved before it"
    )
    print(f"error: {outcome.stop.reason}; stopping ({outcome.status}); {where}")


def make_summary(loop: StepLoop, run: RunDir, start: Start, outcome: Outcome) -> dict:
    setup, clock, stop = loop.setup, loop.clock, outcome.stop
    cfg = setup.cfg
    earlier = run.sessions() if start.resumed_from is not None else []
    changed = (run.summary() or {}).get("changed_on_resume", []) if start.resumed_from is not None else []
    if start.changed:
        changed = [*changed, {"step": start.resumed_from, "changes": list(start.changed)}]
    return {
        "status": outcome.status,
        "stop_reason": stop.reason if stop else (str(outcome.fault) if outcome.fault else None),
        "first_bad_step": stop.first_bad_step if stop else None,
        "mode": cfg.mode,
        "steps": outcome.steps,
        "model": setup.model_cfg.name,
        # what ran: a profile runs its host with uniform ranks and no decomposition (GaLore's way)
        "optimizer": "galore" if setup.profiling else cfg.optimizer.name,
        "host": None if cfg.optimizer.name == "adamw" else cfg.optimizer.host,
        "wall_s": loop.writer.wall(),
        "final_eval_loss": loop.last_eval,
        "final_eval_ppl": ppl(loop.last_eval) if loop.last_eval is not None else None,
        "final_eval_step": loop.last_eval_step,
        "tokens_per_s": _median_tokens_per_s(run),
        "peak_device_memory_bytes": _peak_memory(),
        "param_count": models.param_count(setup.model_cfg),
        "optimizer_state_bytes": mj.state_bytes(setup.abstract_opt),
        "ranks": rank_summary(setup),
        "data": {**setup.data.summary(), "tokenizer_path": tokenizer_path(cfg.data.tokenizer)},
        "startup": clock.startup,
        "devices": len(setup.mesh.devices.flat),
        "device_kind": jax.devices()[0].device_kind,
        "mesh": dict(setup.mesh.shape),
        "sessions": earlier + [[clock.started_at, time.time(), socket.gethostname()]],
        "changed_on_resume": changed,  # each resume that changed settings: its step and changes
    }


def _median_tokens_per_s(run: RunDir) -> float | None:
    """The median over the logged steps but each session's first (its time includes the
    compilation: ``includes_compile``), of all sessions; None in a process that writes no
    metrics (multi-host, not the first)."""
    rows = run.rows("tokens_per_s")
    rates = [r["tokens_per_s"] for r in rows if not r.get("includes_compile")]
    rates = rates or [r["tokens_per_s"] for r in rows]
    return float(np.median(rates)) if rates else None


def _peak_memory() -> int | None:
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - not every backend reports
        return None
    return None if not stats else stats.get("peak_bytes_in_use")
