"""``train_and_evaluate``: build data, model, optimizer and mesh, then run the jitted step with
logging, evaluation, checkpoints (SIGTERM-safe), resume, profiling and a summary."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import signal
import socket
import time

import jax
import jax.numpy as jnp
import numpy as np
import yaml

import moara_jax as mj
import models
from train import profile as profiling
from train.checkpoint import Checkpointer, abstract_with_shardings
from train.config import RunConfig, to_dict
from train.data import build_data
from train.data import describe as describe_data
from train.errors import UserError
from train.metrics import DivergenceGuard, MetricsWriter, make_sinks
from train.metrics import perplexity as ppl
from train.model import DEFAULT_MODEL, MODEL_FILE, init_from_params, model_config
from train.rundir import RunLock, banner, plot_curves, write_summary
from train.sharding import batch_sharding, make_mesh, param_shardings, state_shardings
from train.step import TrainState, make_eval_step, make_optimizer, make_train_step, schedule


class _Stop:
    """SIGTERM/SIGINT set a flag; the loop saves a checkpoint and exits cleanly."""

    def __init__(self):
        self.requested = False
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.requested = True

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def train_and_evaluate(
    cfg: RunConfig, run_dir: pathlib.Path, resume: bool = False, quiet: bool = False
) -> dict:
    """Runs (or resumes) one training or profiling run in ``run_dir`` and returns its summary;
    the run dir is locked against a second writer for the whole run."""
    main = _is_main_process()
    lock = RunLock(run_dir).acquire() if main else None
    try:
        return _run(cfg, run_dir, resume, quiet, main)
    finally:
        if lock is not None:
            lock.release()


def _run(cfg: RunConfig, run_dir: pathlib.Path, resume: bool, quiet: bool, main: bool) -> dict:
    started_at = time.time()
    entered = time.perf_counter()
    say = (lambda *a: None) if quiet or not main else print
    ckpt_dir = run_dir / "checkpoints"
    has_checkpoints = ckpt_dir.is_dir() and any(p.name.isdigit() for p in ckpt_dir.iterdir())
    if has_checkpoints and not resume:
        raise UserError(
            f"{run_dir} already holds checkpoints of a run; pass --resume to continue it, or "
            "choose another run dir"
        )
    if has_checkpoints and (run_dir / "config.yaml").is_file():
        _check_resumable(yaml.safe_load((run_dir / "config.yaml").read_text()), to_dict(cfg))
    t = cfg.train
    profiling_mode = cfg.mode == "profile"
    total_steps = min(t.steps, cfg.profile.steps) if profiling_mode else t.steps

    if cfg.model.init_from is not None:
        model_config(cfg, 0)  # a bad directory or a mismatch is reported before any data work
    data = build_data(cfg.data, t.seq_len, quiet=quiet)
    startup = {"data_s": time.perf_counter() - entered}
    model_cfg = model_config(cfg, data.vocab_size)
    mesh = make_mesh(cfg.mesh)
    b_sharding = batch_sharding(mesh, t.batch_size)
    micro = t.batch_size // (t.micro_batch_size or t.batch_size)
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if (t.batch_size // micro) % shards:
        raise UserError(
            f"train.micro_batch_size ({t.batch_size // micro}) must be divisible by the mesh's "
            f"data x fsdp = {mesh.shape['data']} x {mesh.shape['fsdp']} = {shards}"
        )
    lr = schedule(cfg)
    if profiling_mode and cfg.optimizer.name == "adamw":
        raise UserError("mode profile needs optimizer.name galore or moara (it profiles projections)")
    abstract_params = models.abstract_params(model_cfg)
    try:
        tx = make_optimizer(cfg.optimizer, lr, t.grad_clip, force_uniform_galore=profiling_mode, peak_lr=t.lr)
        # Shape checks that need the model (e.g. Q-GaLore's group sizes) run at init.
        abstract_opt = jax.eval_shape(tx.init, abstract_params)
    except ValueError as e:
        raise UserError(f"optimizer: {e}") from None
    p_shard = param_shardings(models.logical_axes(model_cfg), abstract_params, mesh)
    o_shard = state_shardings(abstract_opt, mesh, abstract_params, p_shard)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    s_shard = TrainState(replicated, p_shard, o_shard)

    def init(rng):
        params = models.init_params(model_cfg, rng)
        return TrainState(jnp.zeros([], jnp.int32), params, tx.init(params))

    ckpt = Checkpointer(ckpt_dir, cfg.checkpoint.keep, cfg.checkpoint.every, enabled=main)
    local_rows = process_rows(b_sharding, (t.batch_size, data.window))
    data_iter = data.train_iterator(t.batch_size, t.seed, local_rows)
    start, resumed_from = 0, None
    data_state: dict = {}
    restored = None
    if resume and ckpt.steps():
        abstract = abstract_with_shardings(jax.eval_shape(init, jax.random.PRNGKey(0)), s_shard)

        def usable(state) -> str | None:
            return None if bool(all_finite(state.params)) else "non-finite parameters"

        restored = ckpt.restore_latest(abstract, usable, say=print if main else (lambda *a: None))
    if restored is not None:
        resumed_from, state, data_state = restored
        data_iter.set_state(data_state["iterator"])
        start = int(state.step)
        if main:
            print(f"resuming from step {start} ({ckpt_dir / str(resumed_from)})")
    else:
        if resume:
            say(f"no checkpoint in {ckpt_dir}; starting from scratch")
        if cfg.model.init_from is not None:

            def start_from(params):
                return TrainState(jnp.zeros([], jnp.int32), params, tx.init(params))

            params = init_from_params(cfg, model_cfg, p_shard)
            state = jax.jit(start_from, out_shardings=s_shard, donate_argnums=0)(params)
        else:
            state = jax.jit(init, out_shardings=s_shard)(jax.random.PRNGKey(t.seed))
    summary_path = run_dir / "summary.json"
    if start >= total_steps and summary_path.is_file():
        ckpt.close()
        if main:
            print(f"{run_dir} is already complete at step {start}; nothing to do")
        return json.loads(summary_path.read_text())
    if main:
        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        # The model as built (for train.export and train.evaluate; with init_from, the config
        # came from a directory that may not stay where it is).
        (run_dir / MODEL_FILE).write_text(json.dumps(dataclasses.asdict(model_cfg), indent=1) + "\n")
    ranks = _rank_summary(cfg, abstract_params, profiling_mode)
    for line in banner(
        model=model_cfg.name,
        params=models.param_count(model_cfg),
        embedding_params=_embedding_params(abstract_params),
        optimizer=_describe_optimizer(cfg),
        ranks=ranks["per_module"] if ranks else None,
        data=describe_data(data),
        tokens_per_step=t.batch_size * t.seq_len,
        run_dir=run_dir,
    ):
        say(line)

    step_fn = jax.jit(
        make_train_step(
            model_cfg, tx, micro, alignment_block=cfg.optimizer.block_size, with_alignment=profiling_mode
        ),
        in_shardings=(s_shard, b_sharding),
        out_shardings=(s_shard, None),
        donate_argnums=(0,),
    )
    eval_fn = jax.jit(make_eval_step(model_cfg), in_shardings=(p_shard, b_sharding))
    val_batches = [
        global_batch(b, b_sharding, None, b.shape) for b in data.val_batches(t.batch_size, t.eval_batches)
    ]

    def evaluate(params) -> float:
        return float(np.mean([float(eval_fn(params, b)) for b in val_batches]))

    sinks = make_sinks(cfg.metrics.writers, run_dir, to_dict(cfg), cfg.metrics.wandb_project) if main else []
    writer = MetricsWriter(run_dir, total_steps, resumed_from, quiet, enabled=main, sinks=sinks)
    recorder = profiling.AlignmentRecorder(cfg.profile.ema) if profiling_mode else None
    if recorder is not None and "recorder" in data_state:
        recorder.load(data_state["recorder"])
    guard = DivergenceGuard(t.divergence_factor, t.zero_grad_steps)
    guard.load(data_state.get("guard", {}))
    tokens_per_step = t.batch_size * t.seq_len
    shape = (t.batch_size, data.window)

    # The state of the data iterator *before* the batch drawn ahead: what a checkpoint of the
    # steps done so far must hold, so that a resume draws that batch again.
    iter_state = data_iter.get_state()

    def next_batch() -> jax.Array:
        nonlocal iter_state
        iter_state = data_iter.get_state()
        return global_batch(next(data_iter), b_sharding, local_rows, shape)

    cpu = jax.local_devices(backend="cpu")[0]

    def host_lr(count: int) -> float:
        """The schedule's value, computed on the host's CPU: on an accelerator it would queue
        behind the step just dispatched and make the host wait for it."""
        with jax.default_device(cpu):
            return float(lr(count))

    last_eval = None
    status, stop_reason = "completed", None
    step = start
    # When the metrics of the last step read became available (the first step's time counts from
    # its dispatch, so it includes the compilation).
    last_done = None

    def read_metrics_of(done_step: int, metrics) -> tuple[str, str, int] | None:
        """Reads one step's metrics (waiting for that step only), checks them, logs them."""
        nonlocal last_done
        loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
        now = time.perf_counter()
        dt = now - last_done
        last_done = now
        step_lr = host_lr(done_step - 1)
        verdict = guard.check(done_step, loss, grad_norm, step_lr)
        if verdict is not None:
            return verdict
        if recorder is not None and done_step % cfg.profile.every == 0:
            recorder.record(done_step, metrics["alignment"], abstract_params)
            writer.scalars(done_step, {f"alignment/S_{k}": v[-1] for k, v in recorder.values.items()})
        if done_step % t.log_every == 0 or done_step == total_steps:
            row = {"step": done_step, "loss": loss, "lr": step_lr, "grad_norm": grad_norm}
            row |= {"tokens_per_s": tokens_per_step / dt, "step_time_s": dt, "wall_s": writer.wall()}
            writer.write(row)
            writer.progress(done_step, loss, tokens_per_step / dt, dt)
        return None

    # The host never waits for the step it just dispatched: it prepares the next batch, then reads
    # the previous step's metrics (that step is done, or nearly, as the device runs in order), so
    # the device always has the next step queued. Steps that evaluate, checkpoint or stop read
    # their own metrics at once.
    pending = None  # (step, metrics) not read yet
    batch = next_batch() if step < total_steps else None
    last_done = time.perf_counter()
    with _Stop() as stop:
        while step < total_steps:
            if "first_step_s" not in startup:
                # Everything before the first step but its compilation (which the call does).
                startup["first_step_s"] = time.perf_counter() - entered
            state, metrics = step_fn(state, batch)
            step += 1
            batch = next_batch() if step < total_steps else None
            if pending is not None:
                stop_reason = read_metrics_of(*pending)
                pending = None
            evaluating = step % t.eval_every == 0 or step == total_steps
            saving = ckpt.should_save(step) or step == total_steps or stop.requested
            if stop_reason is None and (evaluating or saving):
                stop_reason = read_metrics_of(step, metrics)
            elif stop_reason is None:
                pending = (step, metrics)
            if stop_reason is not None:
                break
            if evaluating:
                last_eval = evaluate(state.params)
                writer.write(
                    {
                        "step": step,
                        "eval_loss": last_eval,
                        "eval_ppl": ppl(last_eval),
                        "wall_s": writer.wall(),
                    }
                )
                writer.note(f"step {step}: eval loss {last_eval:.4f}, ppl {ppl(last_eval):.2f}")
            if saving and guard.suspicious:
                writer.note(f"step {step}: no checkpoint while the gradient norm is exactly 0")
            elif saving:
                if not bool(all_finite(state.params)):
                    stop_reason = ("nan", f"non-finite parameters after step {step}", step + 1)
                    break
                extra = {"iterator": iter_state if batch is not None else data_iter.get_state()}
                extra["guard"] = guard.state()
                if recorder is not None:
                    extra["recorder"] = recorder.state()
                ckpt.save(step, state, extra, force=True)
            if stop.requested:
                status = "interrupted"
                break
        if pending is not None and stop_reason is None:
            stop_reason = read_metrics_of(*pending)
    writer.end_progress()
    writer.close()
    if stop_reason is not None:
        status, reason, first_bad = stop_reason
        step = first_bad - 1  # the steps whose results passed the checks
        if status == "diverged":
            # Checkpoints saved from the step before the first bad one on hold diverging weights.
            ckpt.reject_from(first_bad - 1)
        kept = ckpt.steps()
        where = (
            f"the last checkpoint before it, step {kept[-1]}, is kept in {ckpt_dir}"
            if kept
            else "no checkpoint was saved before it"
        )
        print(f"error: {reason}; stopping ({status}); {where}")
    ckpt.close()

    summary = {
        "status": status,
        "stop_reason": stop_reason[1] if stop_reason else None,
        "first_bad_step": stop_reason[2] if stop_reason else None,
        "mode": cfg.mode,
        "steps": step,
        "model": model_cfg.name,
        "optimizer": cfg.optimizer.name,
        "host": None if cfg.optimizer.name == "adamw" else cfg.optimizer.host,
        "wall_s": writer.wall(),
        "final_eval_loss": last_eval,
        "final_eval_ppl": ppl(last_eval) if last_eval is not None else None,
        "tokens_per_s": _mean_tokens_per_s(run_dir),
        "peak_device_memory_bytes": _peak_memory(),
        "param_count": models.param_count(model_cfg),
        "optimizer_state_bytes": mj.state_bytes(abstract_opt),
        "ranks": ranks,
        "data": data.summary(),
        "startup": startup,
        "devices": len(mesh.devices.flat),
        "device_kind": jax.devices()[0].device_kind,
        "mesh": dict(mesh.shape),
        "sessions": _sessions(summary_path, resumed_from) + [[started_at, time.time(), socket.gethostname()]],
    }
    if recorder is not None and status == "completed" and main:
        summary["profile"] = profiling.write_outputs(recorder, run_dir, cfg)
    elif recorder is not None:  # a partial profile gives no allocation; --resume finishes it
        summary["profile"] = None
    if main:  # one writer per run dir in a multi-host run
        written = write_summary(run_dir, summary)
        if written.name != "summary.json":
            print(f"{run_dir} holds a completed run; this attempt's summary is {written.name}")
        plot_curves(run_dir)
    return summary


def _sessions(summary_path: pathlib.Path, resumed_from: int | None) -> list:
    """The (start, end, host) of the earlier sessions of a resumed run, for overlap checks."""
    if resumed_from is None or not summary_path.is_file():
        return []
    try:
        return list(json.loads(summary_path.read_text()).get("sessions", []))
    except ValueError:
        return []


def _embedding_params(abstract_params) -> int:
    leaves = jax.tree_util.tree_leaves_with_path(abstract_params)
    return sum(
        x.size
        for path, x in leaves
        if any(k in jax.tree_util.keystr(path) for k in ("embed_tokens", "lm_head"))
    )


def _describe_optimizer(cfg: RunConfig) -> str:
    o = cfg.optimizer
    if o.name == "adamw":
        return "adamw"
    parts = [f"{o.name} on {o.host}", f"r_base {o.r_base}", f"T {o.update_proj_gap}", f"svd {o.svd}"]
    if o.name == "moara" and o.decompose:
        parts.append(f"block {o.block_size}")
    return ", ".join(parts)


def _is_main_process() -> bool:
    """The process that writes the run dir's files (checkpoints are orbax's own business)."""
    return jax.process_index() == 0


# Settings a resumed run must share with the run it continues (they shape the state or the data
# order); everything else (steps, learning rate, logging, mesh, ...) may change.
_FIXED_ON_RESUME = ("mode", "model", "data", "optimizer", "train.batch_size", "train.seq_len", "train.seed")
_FREE_ON_RESUME = ("optimizer.svd", "data.workers", "data.cache_dir")


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        out.update(_flatten(v, key + ".") if isinstance(v, dict) else {key: v})
    return out


def _check_resumable(saved: dict, new: dict) -> None:
    """Refuses a resume whose config changes what the checkpoint or the data order depend on."""
    old_flat, new_flat = _flatten(saved or {}), _flatten(new)
    for flat in (old_flat, new_flat):  # an unnamed model is the default one
        if flat.get("model.name") is None and flat.get("model.init_from") is None:
            flat["model.name"] = DEFAULT_MODEL
    changed = sorted(
        k
        for k in set(old_flat) | set(new_flat)
        if any(k == f or k.startswith(f + ".") for f in _FIXED_ON_RESUME)
        and k not in _FREE_ON_RESUME
        and old_flat.get(k) != new_flat.get(k)
    )
    if changed:
        details = ", ".join(f"{k}: {old_flat.get(k)!r} -> {new_flat.get(k)!r}" for k in changed)
        raise UserError(
            f"--resume: the run's config.yaml differs in settings a resume cannot change ({details})"
        )


@jax.jit
def all_finite(tree) -> jax.Array:
    """Whether every entry of every array in ``tree`` is finite."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def process_rows(sharding, shape: tuple[int, int]) -> np.ndarray | None:
    """The rows of a global batch that this process's devices hold (None: all of them)."""
    rows = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        rows.update(range(*index[0].indices(shape[0])))
    return None if len(rows) == shape[0] else np.asarray(sorted(rows))


def global_batch(local: np.ndarray, sharding, rows: np.ndarray | None, shape: tuple[int, int]) -> jax.Array:
    """The global batch as a sharded array, from this process's ``rows`` of it (``local``: those
    rows in order; all rows when ``rows`` is None). Every process draws the same seeded index
    stream, so the processes' rows fit together into one global batch."""
    if rows is None:
        return jax.make_array_from_callback(shape, sharding, lambda idx: local[idx])
    position = {int(r): i for i, r in enumerate(rows)}

    def shard(idx):
        wanted = [position[r] for r in range(*idx[0].indices(shape[0]))]
        return local[wanted][:, idx[1]]

    return jax.make_array_from_callback(shape, sharding, shard)


def _rank_summary(cfg: RunConfig, abstract_params, profiling_mode: bool) -> dict | None:
    opt = cfg.optimizer
    if opt.name == "adamw":
        return None
    ranks = None
    if not profiling_mode and opt.rank_allocation not in ("uniform", "default"):
        from train.step import read_allocation

        ranks = read_allocation(opt.rank_allocation)
    rows = mj.rank_table(
        abstract_params,
        r_base=opt.r_base,
        rank_allocation=opt.rank_allocation == "default" and not profiling_mode,
        ranks=ranks,
    )
    per_module = {r["module"]: r["requested"] for r in rows}
    clipped = [r for r in rows if r["used"] < r["requested"]]
    return {"per_module": per_module, "clipped": clipped}


def _mean_tokens_per_s(run_dir: pathlib.Path) -> float | None:
    from train.metrics import dedupe_by_step, read_metrics

    path = run_dir / "metrics.jsonl"
    if not path.exists():  # a process that writes no metrics (multi-host, not the first)
        return None
    rows = dedupe_by_step(read_metrics(path), "tokens_per_s")
    rates = [r["tokens_per_s"] for r in rows[1:]] or [r["tokens_per_s"] for r in rows]
    return float(np.median(rates)) if rates else None


def _peak_memory() -> int | None:
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - not every backend reports
        return None
    return None if not stats else stats.get("peak_bytes_in_use")
