"""A run before its steps: phases 1 to 3 of ``train.loop.train_and_evaluate``.

1. ``make_setup``: data, model config, mesh, shardings, optimizer and the abstract state (``Setup``);
2. ``restore_or_init``: the newest usable checkpoint, or a new state (``Start``);
3. ``open_run_dir``: the run dir's ``config.yaml`` and ``model.json`` (a completed run resumed to
   go on keeps its summary aside first), and the start-up banner (``banner_lines``).
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax

import moara_jax as mj
import models
from train import profile as profiling
from train import store as token_store
from train.checkpoint import Checkpointer, abstract_with_shardings
from train.config import RunConfig, to_dict
from train.data import Data, build_data
from train.data import describe as describe_data
from train.errors import UserError, io_operation
from train.model import check_init_from, init_from_params, model_config, preset_changes
from train.rundir import RunDir, banner
from train.sharding import (
    batch_sharding,
    make_mesh,
    param_shardings,
    split_heads,
    state_shardings,
    straddling_blocks,
    whole_dims,
)
from train.sources import make_tokenizer
from train.step import Allocation, TrainState, all_finite, make_optimizer, module_types, schedule


def silent(*args) -> None:
    """A ``print`` that says nothing (a process that does not speak, a quiet run)."""


class Clock:
    """The run's start (wall clock) and its start-up timings (``summary.json``'s ``startup``)."""

    def __init__(self):
        self.started_at = time.time()
        self.entered = time.perf_counter()
        self.startup: dict[str, float] = {}

    def mark(self, what: str) -> None:
        """Seconds from entering the run to now, as ``startup[what]`` (the first mark only)."""
        self.startup.setdefault(what, time.perf_counter() - self.entered)


# -------------------------------------------------------------------------------------- 1. setup


@dataclass(frozen=True)
class Setup:
    """What a run is made of, before any state exists."""

    cfg: RunConfig
    data: Data
    model_cfg: models.ModelConfig
    mesh: jax.sharding.Mesh
    batch_sharding: jax.sharding.NamedSharding
    shardings: TrainState  # of the train state
    tx: optax.GradientTransformation
    allocation: Allocation  # optimizer.rank_allocation as read for this model, once
    lr: optax.Schedule
    abstract_params: Any
    abstract_opt: Any
    micro_batches: int
    total_steps: int

    @property
    def profiling(self) -> bool:
        return self.cfg.mode == "profile"

    @functools.cached_property
    def data_sha256(self) -> str:
        """The token store's content hash, saved with each checkpoint (a resume checks it)."""
        return self.data.identity()

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.train.batch_size * self.cfg.train.seq_len

    def init(self, rng) -> TrainState:
        """A new train state (for ``jax.eval_shape``; ``restore_or_init`` makes one in two programs)."""
        return self.start_from(models.init_params(self.model_cfg, rng))

    def param_init(self):
        """The seeded parameters' init, jitted into their shardings: a program of the model alone,
        the same for every optimizer, so that runs of one model under other optimizers find it in
        the compilation cache (its random draws are most of a new state's compile time)."""
        init = functools.partial(models.init_params, self.model_cfg)
        return jax.jit(init, out_shardings=self.shardings.params)

    def start_from(self, params) -> TrainState:
        return TrainState(jnp.zeros([], jnp.int32), params, self.tx.init(params))


def resumed_model(run: RunDir, cfg: RunConfig, resume: bool) -> models.ModelConfig | None:
    """The model a resumed run built (its ``model.json``), else None (a new run; a preset's run
    from a version before model.json, which goes on with the preset as it is now). A resume goes
    on with it: the directory a ``model.init_from`` run was initialised from may have moved or
    gone since, and a preset may be defined otherwise now (``train.model.preset_changes``)."""
    if not (resume and run.has_checkpoints()):
        return None
    if run.model_file.is_file():
        return run.model_config()
    if cfg.model.init_from is None:
        return None
    had = run.setting("model", "init_from")  # a run dir of a version before model.json
    if had != cfg.model.init_from:
        raise UserError(
            f"--resume: {run} holds no {run.model_file.name} to take the model from; give "
            f"model.init_from as the run had it ({had})"
        )
    return None  # the directory is the model


def preset_note(run: RunDir, cfg: RunConfig, setup: Setup, built: models.ModelConfig | None) -> str | None:
    """What a resumed preset run (``built``: its ``model.json``) says when this version defines its
    preset otherwise: the fields that differ, and that it goes on with its own model."""
    if built is None or cfg.model.init_from is not None:
        return None
    changes = preset_changes(built, model_config(cfg, setup.data.vocab_size))
    if not changes:
        return None
    return (
        f"note: the preset {built.name} is defined otherwise now ({', '.join(map(str, changes))}); "
        f"the run goes on with the model it began with ({run.model_file})"
    )


def check_model(cfg: RunConfig, built: models.ModelConfig | None = None) -> None:
    """What the model section makes wrong, said before any data work (a store may take hours to
    build): ``model.init_from``'s directory (``check_init_from``; ``built``: a resume's model,
    ``resumed_model``), a bad override, or fewer positions than ``train.seq_len``."""
    if cfg.model.init_from is not None:
        check_init_from(cfg, built)
    _check_positions(cfg.train.seq_len, _model_before_data(cfg, built))


def check_inputs(cfg: RunConfig, built: models.ModelConfig | None = None) -> None:
    """What a run's start-up would refuse, found without building anything: the model
    (``check_model``) and the data's inputs (the tokenizer; the files, or the TFDS dataset, as
    the token store's plan finds them; a ``source: store``'s store). ``train.sweep`` checks the
    runs of a grid it would start so before it starts one."""
    check_model(cfg, built)
    if cfg.data.source == "store":
        make_tokenizer(cfg.data.tokenizer)
        token_store.read_manifest(pathlib.Path(cfg.data.store).expanduser())
    else:
        token_store.plan(cfg.data)


def _model_before_data(cfg: RunConfig, built: models.ModelConfig | None = None) -> models.ModelConfig:
    """The run's model with a placeholder vocabulary (the tokenizer's is known once the data is
    opened; ``model.overrides.vocab_size`` is checked against it then)."""
    overrides = {k: v for k, v in cfg.model.overrides.items() if k != "vocab_size"}
    model = dataclasses.replace(cfg.model, overrides=overrides)
    return model_config(dataclasses.replace(cfg, model=model), 1, built)


def _check_positions(seq_len: int, model_cfg: models.ModelConfig) -> None:
    if seq_len > model_cfg.max_position_embeddings:
        raise UserError(
            f"train.seq_len ({seq_len}) exceeds the model's max_position_embeddings "
            f"({model_cfg.max_position_embeddings}): shorten it, or set "
            "model.overrides.max_position_embeddings"
        )


def make_setup(cfg: RunConfig, quiet: bool, clock: Clock, built: models.ModelConfig | None = None) -> Setup:
    """The run's parts; ``built``: the model a resumed run from ``model.init_from`` built (its
    ``model.json``), taken in place of the directory's."""
    t = cfg.train
    check_model(cfg, built)
    data = build_data(cfg.data, t.seq_len, quiet=quiet)
    clock.mark("data_s")
    model_cfg = model_config(cfg, data.vocab_size, built)  # (its positions checked by check_model)
    mesh = make_mesh(cfg.mesh)
    micro = t.batch_size // (t.micro_batch_size or t.batch_size)
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if (t.batch_size // micro) % shards:
        what = "train.micro_batch_size" if t.micro_batch_size else "train.batch_size"
        raise UserError(
            f"{what} ({t.batch_size // micro}) must be divisible by the mesh's "
            f"data x fsdp = {mesh.shape['data']} x {mesh.shape['fsdp']} = {shards}"
        )
    lr = schedule(cfg)
    profiling_mode = cfg.mode == "profile"
    abstract_params = models.abstract_params(model_cfg)
    allocation = Allocation.of(cfg.optimizer, abstract_params, profiling=profiling_mode)
    try:
        tx = make_optimizer(
            cfg.optimizer, lr, t.grad_clip, profiling=profiling_mode, peak_lr=t.lr, allocation=allocation
        )
        # Shape checks that need the model (e.g. Q-GaLore's group sizes) run at init.
        abstract_opt = jax.eval_shape(tx.init, abstract_params)
    except ValueError as e:
        raise UserError(f"optimizer: {e}") from None
    if profiling_mode:  # the allocation the profile will write, tried now on the model's module types
        if not mj.projection_bases(abstract_opt):  # (a host that declares no basis_states)
            raise UserError(
                f"mode profile: the state of host {cfg.optimizer.host} holds no projection basis the "
                "profile can read (a host names its state types with bases in Host.basis_states)"
            )
        types = module_types(abstract_params)
        try:
            profiling.choose_allocation(dict.fromkeys(types, 0.0), cfg)
        except ValueError as e:
            said = str(e) if str(e).startswith("profile.") else f"profile: {e}"
            raise UserError(f"{said} (module types of this model: {list(types)})") from None
    p_shard = param_shardings(models.logical_axes(model_cfg), abstract_params, mesh)
    o_shard = state_shardings(abstract_opt, mesh, abstract_params, p_shard)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return Setup(
        cfg=cfg,
        data=data,
        model_cfg=model_cfg,
        mesh=mesh,
        batch_sharding=batch_sharding(mesh, t.batch_size),
        shardings=TrainState(replicated, p_shard, o_shard),
        tx=tx,
        allocation=allocation,
        lr=lr,
        abstract_params=abstract_params,
        abstract_opt=abstract_opt,
        micro_batches=micro,
        total_steps=min(t.steps, cfg.profile.steps) if profiling_mode else t.steps,
    )


# ----------------------------------------------------------------------------- 2. restore or init


# What a checkpoint saves beside the state (``StepLoop.save``) for the run to go on exactly: the
# data order, the divergence guard's history and the data's hash (a profiling run: its recorder).
RESUME_ITEMS = ("iterator", "guard", "data_sha256")


@dataclass(frozen=True)
class Start:
    state: TrainState
    step: int
    resumed_from: int | None  # the checkpoint's step
    extra: dict  # what the checkpoint saved beside the state: iterator, guard, recorder
    changed: tuple[str, ...] = ()  # the settings a resume changed (``key: old -> new``)


def restore_or_init(setup: Setup, ckpt: Checkpointer, resume: bool, say=print) -> Start:
    """The newest usable checkpoint (``--resume``), else a new state: from ``model.init_from``'s
    weights or a seeded init, made directly in its shardings. What it starts from (and the
    checkpoints it passed over) goes to ``say``: process 0's ``print``, ``--quiet`` or not."""
    if resume and ckpt.steps():
        abstract = abstract_with_shardings(jax.eval_shape(setup.init, jax.random.PRNGKey(0)), setup.shardings)

        def usable(state) -> str | None:
            return None if bool(all_finite(state.params)) else "non-finite parameters"

        restored = ckpt.restore_latest(abstract, usable, say=say)
        if restored is not None:
            step, state, extra = restored
            wanted = RESUME_ITEMS + (("recorder",) if setup.profiling else ())
            missing = [k for k in wanted if k not in extra]
            if missing:
                raise UserError(
                    f"checkpoint {ckpt.directory / str(step)} lacks {', '.join(missing)} in its data "
                    "item (made by another version of moara-jax, or damaged): the run cannot go on "
                    "exactly from it; move it out of checkpoints/ to resume from the one before, "
                    "or start a new run dir; it is kept"
                )
            if int(state.step) > setup.total_steps:
                steps = "train.steps and profile.steps" if setup.profiling else "train.steps"
                raise UserError(
                    f"checkpoint {ckpt.directory / str(step)}, the newest usable, is past this "
                    f"run's last step ({setup.total_steps}): resume with {steps} of at least "
                    f"{int(state.step)}, or choose another run dir"
                )
            if extra["data_sha256"] not in setup.data.identities():
                raise UserError(
                    f"the token store {setup.data.store.directory} holds other data than the one "
                    f"checkpoint {step} trained on (data files added, removed or changed since): "
                    "resuming would draw other batches; restore those files, or start a new run dir"
                )
            say(f"resuming from step {int(state.step)} ({ckpt.directory / str(step)})")
            return Start(state, int(state.step), step, extra)
    if resume:
        say(f"no checkpoint in {ckpt.directory}; starting from scratch")
    if setup.cfg.model.init_from is not None:
        params = init_from_params(setup.cfg, setup.model_cfg, setup.shardings.params)
    else:
        params = setup.param_init()(jax.random.PRNGKey(setup.cfg.train.seed))
    state = jax.jit(setup.start_from, out_shardings=setup.shardings, donate_argnums=0)(params)
    return Start(state, 0, None, {})


# ---------------------------------------------------------------------- 3. run-dir files, banner


def open_run_dir(run: RunDir, setup: Setup, step: int) -> None:
    """The run dir for a session that runs steps from ``step``: a completed run resumed short of
    its end (to more steps) first keeps its summary, config and last checkpoint
    (``RunDir.reopen``); then ``config.yaml`` and ``model.json``, the model as built (for
    ``train.export`` and ``train.evaluate``; with ``init_from``, its directory may not stay where
    it is)."""
    if run.status() == "completed":
        done = run.summary()["steps"]
        with io_operation("keeping the completed run's record in", run.path):
            kept = run.reopen(step)
        _, config, checkpoint = run.completed_record(done)
        said = [f"its summary is {kept.name}"]
        said += [f"its config {config.name}"] if config.is_file() else []
        said += [f"its last checkpoint {checkpoint.name}/"] if checkpoint.is_dir() else []
        if setup.total_steps != done:
            said.append(f"the learning-rate schedule now runs to step {setup.total_steps}, not {done}")
        print(f"{run} held a completed run: going on from step {step}; " + ", ".join(said))
    with io_operation("writing the run's config to", run.path):
        run.write_config(to_dict(setup.cfg))
        run.write_model(dataclasses.asdict(setup.model_cfg))


def banner_lines(setup: Setup, run: RunDir) -> list[str]:
    ranks, opt = rank_summary(setup), setup.cfg.optimizer
    return banner(
        model=setup.model_cfg.name,
        params=models.param_count(setup.model_cfg),
        embedding_params=_embedding_params(setup.abstract_params),
        optimizer=describe_optimizer(setup.cfg),
        ranks=ranks["per_module"] if ranks else None,
        data=describe_data(setup.data),
        tokens_per_step=setup.tokens_per_step,
        run_dir=run,
        mesh=describe_mesh(setup.mesh),
        whole=whole_dims(models.logical_axes(setup.model_cfg), setup.abstract_params, setup.mesh),
        split_heads=split_heads(setup.model_cfg, setup.mesh),
        straddle=straddling_blocks(setup.shardings.params, setup.abstract_params, opt.block_size)
        if opt.name == "moara" and opt.decompose and not setup.profiling
        else None,
    )


def describe_mesh(mesh) -> str:
    """The mesh as made (``mesh.data: -1`` takes the devices fsdp x tensor leave)."""
    sizes = " x ".join(f"{name} {size}" for name, size in mesh.shape.items())
    first = mesh.devices.flat[0]
    kind = f" ({first.device_kind})" if first.device_kind.lower() != first.platform.lower() else ""
    return f"mesh: {sizes} over {mesh.devices.size} {first.platform} device(s){kind}"


def rank_summary(setup: Setup) -> dict | None:
    """The rank each module type asks for, and the matrices whose rank is clipped."""
    opt = setup.cfg.optimizer
    if opt.name == "adamw":
        return None
    rows = setup.allocation.table(opt, setup.abstract_params)
    return {
        "per_module": {r["module"]: r["requested"] for r in rows},
        "clipped": [r for r in rows if r["used"] < r["requested"]],
    }


def _embedding_params(abstract_params) -> int:
    leaves = jax.tree_util.tree_leaves_with_path(abstract_params)
    return sum(
        x.size
        for path, x in leaves
        if any(k in jax.tree_util.keystr(path) for k in ("embed_tokens", "lm_head"))
    )


def describe_optimizer(cfg: RunConfig) -> str:
    o = cfg.optimizer
    decay = [f"weight decay {o.weight_decay:g} on {o.weight_decay_mask}"] if o.weight_decay else []
    if o.name == "adamw":
        return ", ".join(["adamw", *decay])
    if cfg.mode == "profile":  # the host with uniform ranks and no decomposition (train.profile)
        parts = [f"{o.host} profiling (uniform ranks, no decomposition)", f"r_base {o.r_base}"]
        return ", ".join([*parts, f"T {o.update_proj_gap}", f"svd {o.svd}", *decay])
    parts = [f"{o.name} on {o.host}", f"r_base {o.r_base}", f"T {o.update_proj_gap}", f"svd {o.svd}"]
    if o.name == "moara" and o.decompose:
        parts.append(f"block {o.block_size}")
    return ", ".join([*parts, *decay])
