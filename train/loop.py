"""``train_and_evaluate``: build data, model, optimizer and mesh, then run the jitted step with
logging, evaluation, checkpoints (SIGTERM-safe), resume, profiling and a summary."""

from __future__ import annotations

import json
import math
import pathlib
import signal
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
from train.errors import UserError
from train.metrics import MetricsWriter
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


def model_config(cfg: RunConfig, vocab_size: int) -> models.ModelConfig:
    try:
        return models.get_config(
            cfg.model.name,
            vocab_size=vocab_size,
            param_dtype=cfg.train.param_dtype,
            dtype=cfg.train.dtype,
            **cfg.model.overrides,
        )
    except (ValueError, TypeError) as e:
        raise UserError(f"model: {e}") from None


def train_and_evaluate(
    cfg: RunConfig, run_dir: pathlib.Path, resume: bool = False, quiet: bool = False
) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_dir = run_dir / "checkpoints"
    has_checkpoints = ckpt_dir.is_dir() and any(ckpt_dir.iterdir())
    if has_checkpoints and not resume:
        raise UserError(
            f"{run_dir} already holds checkpoints of a run; pass --resume to continue it, or "
            "choose another run dir"
        )
    if has_checkpoints and (run_dir / "config.yaml").is_file():
        _check_resumable(yaml.safe_load((run_dir / "config.yaml").read_text()), to_dict(cfg))
    entered = time.perf_counter()
    t = cfg.train
    profiling_mode = cfg.mode == "profile"
    total_steps = min(t.steps, cfg.profile.steps) if profiling_mode else t.steps

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
    o_shard = state_shardings(abstract_opt, mesh)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    s_shard = TrainState(replicated, p_shard, o_shard)

    def init(rng):
        params = models.init_params(model_cfg, rng)
        return TrainState(jnp.zeros([], jnp.int32), params, tx.init(params))

    ckpt = Checkpointer(ckpt_dir, cfg.checkpoint.keep, cfg.checkpoint.every)
    local_rows = process_rows(b_sharding, (t.batch_size, data.window))
    data_iter = data.train_iterator(t.batch_size, t.seed, local_rows)
    start = 0
    data_state: dict = {}
    if resume and ckpt.latest_step() is not None:
        abstract = abstract_with_shardings(jax.eval_shape(init, jax.random.PRNGKey(0)), s_shard)
        state, data_state = ckpt.restore(ckpt.latest_step(), abstract)
        data_iter.set_state(data_state["iterator"])
        start = int(state.step)
    else:
        if resume:
            print(f"no checkpoint in {run_dir / 'checkpoints'}; starting from scratch")
        state = jax.jit(init, out_shardings=s_shard)(jax.random.PRNGKey(t.seed))
    summary_path = run_dir / "summary.json"
    if start >= total_steps and summary_path.is_file():
        ckpt.close()
        print(f"{run_dir} is already complete at step {start}; nothing to do")
        return json.loads(summary_path.read_text())
    main = _is_main_process()
    if main:
        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))

    step_fn = jax.jit(
        make_train_step(
            model_cfg, tx, micro, alignment_block=cfg.optimizer.block_size, with_alignment=profiling_mode
        ),
        in_shardings=(s_shard, b_sharding),
        out_shardings=(s_shard, None),
        donate_argnums=(0,),
    )
    eval_fn = jax.jit(make_eval_step(model_cfg), in_shardings=(p_shard, b_sharding))
    val_batches = [_sharded_rows(b, b_sharding) for b in data.val_batches(t.batch_size, t.eval_batches)]

    def evaluate(params) -> float:
        return float(np.mean([float(eval_fn(params, b)) for b in val_batches]))

    writer = MetricsWriter(run_dir, total_steps, resume and start > 0, quiet, enabled=main)
    recorder = profiling.AlignmentRecorder(cfg.profile.ema) if profiling_mode else None
    if recorder is not None and "recorder" in data_state:
        recorder.load(data_state["recorder"])
    tokens_per_step = t.batch_size * t.seq_len
    last_eval = None
    status = "completed"
    step = start
    with _Stop() as stop:
        while step < total_steps:
            batch = global_batch(next(data_iter), b_sharding, local_rows, (t.batch_size, data.window))
            t0 = time.perf_counter()
            if "first_step_s" not in startup:
                # Everything before the first step but its compilation (which the call does).
                startup["first_step_s"] = time.perf_counter() - entered
            new_state, metrics = step_fn(state, batch)
            loss = float(metrics["loss"])
            dt = time.perf_counter() - t0
            if not math.isfinite(loss):
                status = "nan"
                writer.end_progress()
                print(
                    f"error: loss is {loss} at step {step + 1}; stopping. The last good "
                    f"checkpoint is kept in {run_dir / 'checkpoints'}"
                )
                break
            state, step = new_state, step + 1
            if recorder is not None and step % cfg.profile.every == 0:
                recorder.record(step, metrics["alignment"], abstract_params)
            if step % t.log_every == 0 or step == total_steps:
                writer.write(
                    {
                        "step": step,
                        "loss": loss,
                        "lr": float(lr(step - 1)),
                        "grad_norm": float(metrics["grad_norm"]),
                        "tokens_per_s": tokens_per_step / dt,
                        "step_time_s": dt,
                        "wall_s": writer.wall(),
                    }
                )
                writer.progress(step, loss, tokens_per_step / dt, dt)
            if step % t.eval_every == 0 or step == total_steps:
                last_eval = evaluate(state.params)
                writer.write(
                    {
                        "step": step,
                        "eval_loss": last_eval,
                        "eval_ppl": math.exp(min(last_eval, 50.0)),
                        "wall_s": writer.wall(),
                    }
                )
            if ckpt.should_save(step) or step == total_steps or stop.requested:
                if not bool(all_finite(state.params)):
                    status = "nan"
                    writer.end_progress()
                    print(
                        f"error: non-finite parameters after step {step}; stopping without "
                        f"saving them. The last good checkpoint is kept in {ckpt_dir}"
                    )
                    break
                extra = {"iterator": data_iter.get_state()}
                if recorder is not None:
                    extra["recorder"] = recorder.state()
                ckpt.save(step, state, extra, force=True)
            if stop.requested:
                status = "interrupted"
                break
    writer.end_progress()
    ckpt.close()

    summary = {
        "status": status,
        "mode": cfg.mode,
        "steps": step,
        "model": model_cfg.name,
        "optimizer": cfg.optimizer.name,
        "host": None if cfg.optimizer.name == "adamw" else cfg.optimizer.host,
        "wall_s": writer.wall(),
        "final_eval_loss": last_eval,
        "final_eval_ppl": math.exp(min(last_eval, 50.0)) if last_eval is not None else None,
        "tokens_per_s": _mean_tokens_per_s(run_dir),
        "peak_device_memory_bytes": _peak_memory(),
        "param_count": models.param_count(model_cfg),
        "optimizer_state_bytes": mj.state_bytes(abstract_opt),
        "ranks": _rank_summary(cfg, abstract_params, profiling_mode),
        "data": data.summary(),
        "startup": startup,
        "devices": len(mesh.devices.flat),
        "mesh": dict(mesh.shape),
    }
    if recorder is not None and status == "completed" and main:
        summary["profile"] = profiling.write_outputs(recorder, run_dir, cfg)
    elif recorder is not None:  # a partial profile gives no allocation; --resume finishes it
        summary["profile"] = None
    if main:  # one writer per run dir in a multi-host run
        summary_path.write_text(json.dumps(summary, indent=2, default=str))
    return summary


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


def _sharded_rows(rows: np.ndarray, sharding) -> jax.Array:
    """A batch already in host memory (the fixed validation batches) as a sharded array."""
    return jax.make_array_from_callback(rows.shape, sharding, lambda idx: rows[idx])


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
