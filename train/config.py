"""Typed, validated run configs loaded from YAML with dotted ``--set`` overrides.

A YAML file may name ``base: other.yaml`` (relative to itself); its keys are merged over the base.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib.util
import math
import pathlib
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import yaml

import models
from moara_jax import MODULE_TYPES
from moara_jax.hosts import host_class
from train.errors import UserError, yaml_problem
from train.rundir import CONFIG
from train.xla_flags import configured_flags


@dataclass(frozen=True)
class ModelSection:
    name: str | None = None  # a models preset (default: tiny, or the init_from directory's model)
    overrides: dict = field(default_factory=dict)  # any models.ModelConfig field
    # A Hugging Face model directory (config.json + safetensors) to start from: its config is the
    # model (model.name/overrides, when given, must agree), its weights the initial parameters.
    init_from: str | None = None


@dataclass(frozen=True)
class OptimizerSection:
    name: str = "moara"  # adamw | galore | moara
    r_base: int = 256
    block_size: int = 32
    rank_allocation: str = "default"  # uniform | default | PATH to allocation.json
    decompose: bool = True
    update_proj_gap: int = 200
    scale: float = 0.25
    svd: str = "exact"  # exact | eigh | randomized
    # The low-rank method the target modules run (galore | fira | q_galore | osd | ldadam |
    # subtrack_pp, or package.module:Class of a moara_jax.Host) and its settings (the fields of
    # moara_jax.Fira, QGaLore, OSD, LDAdam, SubTrackPP or that class).
    host: str = "galore"
    host_options: dict = field(default_factory=dict)
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-6
    weight_decay: float = 0.0
    weight_decay_mask: str = "all"  # all | matrices (2+ dimensions per layer: no norms or biases)
    # Adam's moments (plain and projected; MoARa's magnitude moments are float32 always): null
    # follows the parameters' dtype (bfloat16 under train.param_dtype bfloat16, as galore-torch's
    # moments follow a bf16 model's), or float32 | bfloat16.
    mu_dtype: str | None = None


@dataclass(frozen=True)
class TrainSection:
    steps: int = 1000
    batch_size: int = 512
    micro_batch_size: int | None = None
    seq_len: int = 256
    lr: float = 0.01
    warmup_ratio: float = 0.1
    min_lr_ratio: float = 0.1
    grad_clip: float = 0.0
    eval_every: int = 100
    eval_batches: int = 4  # validation batches per evaluation, at most: each window is read once
    log_every: int = 1
    seed: int = 0
    # The divergence guard: stop when the loss exceeds this factor x its running minimum, or the
    # gradient norm is exactly 0 this many steps in a row while the learning rate is not (0: off).
    divergence_factor: float = 3.0
    zero_grad_steps: int = 20
    param_dtype: str = "bfloat16"
    dtype: str = "bfloat16"


@dataclass(frozen=True)
class DataSection:
    source: str = "builtin"  # builtin | files | tfds | store (data.store as it is, no inputs)
    paths: list = field(default_factory=list)
    validation_paths: list = field(default_factory=list)
    tfds_name: str = "c4/en"
    tokenizer: str = "bytes"  # bytes | PATH to a sentencepiece model | a tokenizer.json (or its directory)
    validation_fraction: float = 0.02
    max_documents: int | None = None
    # The token store: built here when missing (default: a cache entry keyed by the inputs and
    # the tokenizer, under cache_dir or ~/.cache/moara-jax), reused by every later run.
    store: str | None = None
    cache_dir: str | None = None
    workers: int | None = None  # tokenizing processes (default: all cores)
    # The train windows' order (default: train.seed). One data.seed over several train.seed values
    # varies only the initialization, as GaLore's runs do (their data order is fixed).
    seed: int | None = None


@dataclass(frozen=True)
class CheckpointSection:
    every: int = 0  # 0: only at the end and on SIGTERM
    keep: int = 2


@dataclass(frozen=True)
class MeshSection:
    data: int = -1  # -1: all devices not used by fsdp/tensor
    fsdp: int = 1
    tensor: int = 1


@dataclass(frozen=True)
class MetricsSection:
    # metrics.jsonl is always written; tensorboard (pip install 'moara-jax[tensorboard]') writes
    # event files to RUN_DIR/tensorboard; wandb (pip install 'moara-jax[wandb]') logs to Weights &
    # Biases, offline unless WANDB_MODE says otherwise.
    writers: list = field(default_factory=lambda: ["jsonl"])
    wandb_project: str = "moara-jax"


WRITERS = ("jsonl", "tensorboard", "wandb")
# The package a metric writer needs, and the extra of moara-jax that installs it.
WRITER_PACKAGES = {"tensorboard": ("tensorboardX", "tensorboard"), "wandb": ("wandb", "wandb")}


def writer_not_installed(writer: str) -> str:
    """The line that says ``writer``'s package is missing and how to install it."""
    package, extra = WRITER_PACKAGES[writer]
    return f"metrics.writers names {writer} but {package} is not installed: pip install 'moara-jax[{extra}]'"


def check_writers(writers: list[str]) -> None:
    """Refuses a metric writer whose package is not installed, in one line: what a run (and each
    run of a sweep) checks before it builds the data or writes its run dir. Not part of
    ``validate``: commands that write no metrics read such configs too."""
    for writer in writers:
        if writer in WRITER_PACKAGES and not _installed(WRITER_PACKAGES[writer][0]):
            raise UserError(writer_not_installed(writer))


def _installed(package: str) -> bool:
    """Whether ``package`` can be imported (imported already, or found), without importing it."""
    if package in sys.modules:  # None there: its import is blocked
        return sys.modules[package] is not None
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


@dataclass(frozen=True)
class ProfileSection:
    steps: int = 1000  # N_p
    every: int = 50  # x
    ema: float = 0.9
    donors: list = field(default_factory=lambda: ["q", "k"])
    num_receivers: int = 1
    # S_tau averages the recordings after this step (0: all of them, the paper's S_p); those up
    # to it are kept and plotted. update_proj_gap leaves out the first basis's (train.profile).
    from_step: int = 0


@dataclass(frozen=True)
class XlaSection:
    # XLA compiler flags python -m train adds to XLA_FLAGS before JAX starts (train/xla_flags.py);
    # a flag the user's XLA_FLAGS already sets keeps the user's value. gpu_flag_sets: names of
    # train.xla_flags.GPU_FLAG_SETS, added on a CUDA GPU (null: DEFAULT_GPU_FLAG_SETS, the sets a
    # GPU measurement showed to help); flags: raw --xla_NAME=VALUE flags, added on every backend.
    gpu_flag_sets: list | None = None
    flags: list = field(default_factory=list)


@dataclass(frozen=True)
class RunConfig:
    mode: str = "train"  # train | profile
    model: ModelSection = field(default_factory=ModelSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    train: TrainSection = field(default_factory=TrainSection)
    data: DataSection = field(default_factory=DataSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    mesh: MeshSection = field(default_factory=MeshSection)
    profile: ProfileSection = field(default_factory=ProfileSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    xla: XlaSection = field(default_factory=XlaSection)


def yaml_float(value: Any) -> Any:
    """``value``, or the float a string spells: YAML 1.1 (PyYAML) reads ``1e-5`` as a string."""
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return float(value)
    return value


def _check_type(where: str, value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        hint = next(h for h in options if h is not type(None))
        origin = typing.get_origin(hint)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    expected = origin or hint
    if expected is float:
        value = yaml_float(value)
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        raise UserError(
            f"config key {where}: expected {getattr(expected, '__name__', expected)}, "
            f"got {type(value).__name__} {value!r}"
        )
    return value


def _build(cls, data: Any, prefix: str):
    if not isinstance(data, dict):
        raise UserError(f"config key {prefix.rstrip('.') or '<root>'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        near = difflib.get_close_matches(str(unknown[0]), sorted(names), n=1)
        hint = f"did you mean {prefix}{near[0]}? " if near else ""
        raise UserError(f"unknown config key {prefix}{unknown[0]} ({hint}valid: {sorted(names)})")
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _check_type(f"{prefix}{name}", value, hint)
    return cls(**kwargs)


def _merge(base: dict, over: dict) -> dict:
    """``over`` (a later config file) on ``base``, section by section and key by key. A model
    field in ``model.overrides`` is one key: a later file's ``overrides`` change or add fields and
    keep the others (as ``--set model.overrides.FIELD=`` does), a field's own value (a
    ``rope_scaling`` mapping) is replaced whole."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = {**out[k], **v} if k == "overrides" else _merge(out[k], v)
        else:
            out[k] = v
    return out


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader, refusing a key a mapping holds twice: the plain loader keeps the last
    one, so a second ``train:`` section would replace the first whole, without a word."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if not isinstance(key, typing.Hashable):
                    continue  # (refused by the loader itself)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"key {key!r} repeated (lines {seen[key] + 1} and {key_node.start_mark.line + 1}): "
                        "the second would replace the first",
                        key_node.start_mark,
                    )
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _yaml(text: str):
    """``text`` as YAML (safe), a key repeated in a mapping refused (``_UniqueKeys``)."""
    return yaml.load(text, Loader=_UniqueKeys)  # noqa: S506 - a SafeLoader


def _read_yaml(path: pathlib.Path, seen: tuple = ()) -> dict:
    """A config file's mapping over its ``base`` (``seen``: the files whose bases led here)."""
    of = f" (the base of {seen[-1]})" if seen else ""
    if path.is_dir():
        raise UserError(f"config file {path}{of} is a directory")
    if not path.is_file():
        raise UserError(f"config file not found: {path}{of}")
    if path.resolve() in seen:
        raise UserError(f"config base cycle through {path}")
    try:
        data = _yaml(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as e:
        raise UserError(f"config file {path} is not UTF-8 text (byte {e.start})") from None
    except yaml.YAMLError as e:
        raise UserError(f"config file {path} is not valid YAML{yaml_problem(e)}") from None
    if not isinstance(data, dict):
        raise UserError(f"config file {path} must hold a mapping")
    # A section left empty (``optimizer:`` with its keys commented out) changes nothing.
    sections = {k for k, t in typing.get_type_hints(RunConfig).items() if dataclasses.is_dataclass(t)}
    data = {k: v for k, v in data.items() if not (v is None and k in sections)}
    base = data.pop("base", None)
    if base is not None and not isinstance(base, str):
        raise UserError(f"config file {path}: base must be a file name, got {base!r}")
    if base:
        data = _merge(_read_yaml(path.parent / base, seen + (path.resolve(),)), data)
    return data


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=value`` with the value parsed as YAML."""
    if "=" not in text:
        raise UserError(f"--set expects key=value, got {text!r}")
    key, raw = text.split("=", 1)
    try:
        value = _yaml(raw) if raw else ""
    except yaml.YAMLError as e:
        why = str(e).splitlines()[0] if isinstance(e, yaml.constructor.ConstructorError) else ""
        raise UserError(
            f"--set {key}: value {raw!r} is not valid YAML" + (f" ({why})" if why else "")
        ) from None
    return key.strip().split("."), value


def load_config(path, overrides: list[str] = ()) -> RunConfig:
    """Reads YAML file(s) (a list is merged in order, later files winning), applies ``--set``
    overrides and validates."""
    paths = [path] if isinstance(path, (str, pathlib.Path)) else list(path or [])
    data: dict = {}
    for p in paths:
        data = _merge(data, _read_yaml(pathlib.Path(p)))
    for text in overrides:
        keys, value = parse_override(text)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise UserError(f"--set {'.'.join(keys)}: {k} is not a section")
        node[keys[-1]] = value
    cfg = _build(RunConfig, data, "")
    validate(cfg)
    return cfg


def validate(cfg: RunConfig) -> None:
    """Range and choice checks that types alone do not express (every refusal that needs only
    the config), section by section; a ``UserError`` naming the first key that fails."""
    _need(cfg.mode in ("train", "profile"), f"mode must be train or profile, got {cfg.mode!r}")
    for key in ("param_dtype", "dtype"):
        _need(
            key not in cfg.model.overrides,
            f"model.overrides.{key}: the run's dtypes are train.param_dtype and train.dtype; set train.{key}",
        )
    _validate_train(cfg.train)  # (first: the optimizer's host may take train.lr)
    _validate_optimizer(cfg.optimizer, cfg.train.lr)
    _validate_mesh(cfg.mesh)
    _validate_data(cfg.data)
    _need(
        cfg.checkpoint.keep >= 1 and cfg.checkpoint.every >= 0,
        "checkpoint.keep must be >= 1 and checkpoint.every >= 0",
    )
    configured_flags(cfg.xla.gpu_flag_sets, cfg.xla.flags, gpu=True)  # names and forms only
    unknown_writers = [w for w in cfg.metrics.writers if w not in WRITERS]
    _need(not unknown_writers, f"metrics.writers: unknown {unknown_writers} (known: {', '.join(WRITERS)})")
    _validate_profile(cfg)


def _validate_mesh(m: MeshSection) -> None:
    """The config's own checks; the device count is the machine's (``make_mesh``)."""
    _need(min(m.fsdp, m.tensor) >= 1, f"mesh.fsdp and mesh.tensor must be >= 1, got {m.fsdp} and {m.tensor}")
    _need(
        m.data == -1 or m.data >= 1,
        f"mesh.data must be -1 (the devices fsdp x tensor leave) or >= 1, got {m.data}",
    )


def _validate_profile(cfg: RunConfig) -> None:
    """``profile``'s settings; those of a profiling run (``mode: profile``) against its steps."""
    p = cfg.profile
    _need(p.every >= 1 and p.steps >= 1, "profile.steps and profile.every must be >= 1")
    if cfg.mode != "profile":
        return
    _need(
        cfg.optimizer.name != "adamw",
        "mode profile needs optimizer.name galore or moara (it profiles projections)",
    )
    profiled = min(cfg.train.steps, p.steps)
    _need(p.every <= profiled, f"profile.every ({p.every}) must be <= the profiled steps ({profiled})")
    _need(p.num_receivers >= 1, f"profile.num_receivers must be >= 1, got {p.num_receivers}")
    _need(0 <= p.ema < 1, f"profile.ema must be in [0, 1), got {p.ema}")
    last = profiled - profiled % p.every  # the last recording
    _need(
        0 <= p.from_step < last,
        f"profile.from_step must be in [0, {last}) (the profile's last recording is at step "
        f"{last}), got {p.from_step}",
    )
    unknown = [x for x in p.donors if x not in MODULE_TYPES]
    _need(bool(p.donors) and not unknown, f"profile.donors must be module types {list(MODULE_TYPES)}")
    _need(len(set(p.donors)) == len(p.donors), f"profile.donors: repeated module types in {p.donors}")


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise UserError(message)


def _validate_optimizer(o: OptimizerSection, peak_lr: float) -> None:
    finite = math.isfinite
    _need(
        o.name in ("adamw", "galore", "moara"),
        f"optimizer.name must be adamw, galore or moara, got {o.name!r}",
    )
    _need(o.r_base >= 1, f"optimizer.r_base must be >= 1, got {o.r_base}")
    _need(o.block_size >= 1, f"optimizer.block_size must be >= 1, got {o.block_size}")
    _need(o.update_proj_gap >= 1, f"optimizer.update_proj_gap must be >= 1, got {o.update_proj_gap}")
    _need(
        o.svd in ("exact", "eigh", "randomized"),
        f"optimizer.svd must be exact, eigh or randomized, got {o.svd!r}",
    )
    if o.rank_allocation not in ("uniform", "default"):
        _need(
            pathlib.Path(o.rank_allocation).is_file(),
            f"optimizer.rank_allocation: {o.rank_allocation!r} is neither uniform, default nor an "
            "allocation file (a profile run's allocation.json)",
        )
    _need(0 <= o.b1 < 1 and 0 <= o.b2 < 1, f"optimizer.b1 and b2 must be in [0, 1), got {o.b1}, {o.b2}")
    _need(finite(o.eps) and o.eps >= 0, f"optimizer.eps must be >= 0, got {o.eps}")
    _need(finite(o.scale) and o.scale > 0, f"optimizer.scale must be > 0, got {o.scale}")
    _need(
        finite(o.weight_decay) and o.weight_decay >= 0,
        f"optimizer.weight_decay must be >= 0, got {o.weight_decay}",
    )
    _need(
        o.weight_decay_mask in ("all", "matrices"),
        f"optimizer.weight_decay_mask must be all or matrices, got {o.weight_decay_mask!r}",
    )
    _need(
        o.mu_dtype in (None, "float32", "bfloat16"),
        f"optimizer.mu_dtype must be null (the parameters' dtype), float32 or bfloat16, got {o.mu_dtype!r}",
    )
    _need(
        o.mu_dtype is None or o.host != "q_galore" or o.name == "adamw",
        f"optimizer.mu_dtype {o.mu_dtype} with host q_galore: its moments are 8-bit or float32 "
        "(host_options min_8bit_size, mag_bits); leave mu_dtype null",
    )
    try:
        host_class(o.host)
    except ValueError as e:
        raise UserError(f"optimizer.host: {e}") from None
    host_settings(o, peak_lr)  # (with what the trainer fills in: trainer_defaults)
    _need(
        o.host == "galore" or o.name != "adamw",
        f"optimizer.host {o.host} needs optimizer.name galore or moara (adamw projects nothing)",
    )


def _validate_train(t: TrainSection) -> None:
    finite = math.isfinite
    _need(t.steps >= 1, f"train.steps must be >= 1, got {t.steps}")
    _need(t.batch_size >= 1, f"train.batch_size must be >= 1, got {t.batch_size}")
    _need(
        t.micro_batch_size is None or t.micro_batch_size >= 1,
        f"train.micro_batch_size must be >= 1 (or null), got {t.micro_batch_size}",
    )
    mb = t.micro_batch_size or t.batch_size
    _need(
        t.batch_size % mb == 0,
        f"train.batch_size ({t.batch_size}) must be a multiple of train.micro_batch_size ({mb})",
    )
    _need(t.seq_len >= 2, f"train.seq_len must be >= 2, got {t.seq_len}")
    _need(t.lr > 0, f"train.lr must be > 0, got {t.lr}")
    _need(finite(t.lr), f"train.lr must be finite, got {t.lr}")
    _need(0 <= t.warmup_ratio < 1, f"train.warmup_ratio must be in [0, 1), got {t.warmup_ratio}")
    _need(0 <= t.min_lr_ratio <= 1, f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}")
    _need(t.eval_every >= 1 and t.log_every >= 1, "train.eval_every and train.log_every must be >= 1")
    _need(
        t.param_dtype in ("float32", "bfloat16") and t.dtype in ("float32", "bfloat16"),
        "train.param_dtype and train.dtype must be float32 or bfloat16",
    )
    _need(
        finite(t.grad_clip) and t.grad_clip >= 0, f"train.grad_clip must be >= 0 (0: off), got {t.grad_clip}"
    )
    _need(t.eval_batches >= 1, f"train.eval_batches must be >= 1, got {t.eval_batches}")
    _need(
        t.divergence_factor == 0 or (finite(t.divergence_factor) and t.divergence_factor > 1),
        f"train.divergence_factor must be > 1 (or 0: off), got {t.divergence_factor}",
    )
    _need(t.zero_grad_steps >= 0, f"train.zero_grad_steps must be >= 0 (0: off), got {t.zero_grad_steps}")
    _need(0 <= t.seed < 2**32, f"train.seed must be in [0, 2**32), got {t.seed}")


def _validate_data(d: DataSection) -> None:
    _need(d.seed is None or 0 <= d.seed < 2**32, f"data.seed must be null or in [0, 2**32), got {d.seed}")
    _need(
        d.source in ("builtin", "files", "tfds", "store"),
        f"data.source must be builtin, files, tfds or store, got {d.source!r}",
    )
    _need(d.source != "files" or bool(d.paths), "data.source is files but data.paths is empty")
    for name in ("paths", "validation_paths"):  # a store's inputs may stay in a config it is built from
        _need(
            d.source not in ("builtin", "tfds") or not getattr(d, name),
            f"data.{name} is set but data.source is {d.source}, which reads no files "
            "(data.source=files trains on them)",
        )
    _need(d.source != "store" or bool(d.store), "data.source is store but data.store is not set")
    _need(d.workers is None or d.workers >= 1, f"data.workers must be >= 1 (or null), got {d.workers}")
    _need(0 < d.validation_fraction < 1, "data.validation_fraction must be in (0, 1)")
    _need(
        d.max_documents is None or d.max_documents >= 1,
        f"data.max_documents must be >= 1 (or null), got {d.max_documents}",
    )


def host_settings(o: OptimizerSection, peak_lr: float | None = None):
    """The host's settings object (``moara_jax.GaLore``, ``Fira``, ``QGaLore``, ``OSD``, ``LDAdam``,
    ``SubTrackPP`` or a registered one) from ``optimizer.host`` and ``optimizer.host_options``,
    over the host's ``trainer_defaults(peak_lr)`` (OSD's ``peak_lr``: the schedule's peak); a
    ``UserError`` naming an unknown or out-of-range option."""
    cls = host_class(o.host)
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(o.host_options) - set(known))
    if unknown:
        known_text = known or "none"
        raise UserError(
            f"optimizer.host_options: unknown option(s) {unknown} for host {o.host} (known: {known_text})"
        )
    options = _host_options(cls, o.host_options)
    if peak_lr is not None:
        options = {**cls.trainer_defaults(peak_lr), **options}
    required = [
        f.name
        for f in dataclasses.fields(cls)
        if f.init
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
        and f.name not in options
    ]
    if required:
        raise UserError(f"optimizer.host_options: host {o.host} needs {', '.join(required)} (no default)")
    try:
        return cls(**options)
    except (ValueError, TypeError) as e:  # (its own checks: __post_init__)
        raise UserError(f"optimizer.host_options: {e}") from None


def _host_options(cls, given: dict) -> dict:
    """``optimizer.host_options`` read as the host's field types say, as a section's keys are
    (``_check_type``: a YAML ``1e-8`` is a float, a string for a bool field is refused; of a
    union, the first member that takes the value). A field of a type YAML does not make (``Any``,
    ``Literal``, a tuple, an ``Enum``, a ``Path``, ...) gets the value as YAML gave it, a float a
    string spells read as the float: the host's ``__post_init__`` converts and checks it."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # (a host's annotations that do not resolve here: its own checks apply)
        hints = {}
    return {
        name: _host_option(f"optimizer.host_options.{name}", value, hints.get(name, Any))
        for name, value in given.items()
    }


# What YAML makes: a host option of one of these types is checked as a section's key is.
_YAML_TYPES = (bool, int, float, str, list, dict, type(None))


def _host_option(where: str, value: Any, hint: Any) -> Any:
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    members = typing.get_args(hint) if union else (hint,)
    if not all((typing.get_origin(m) or m) in _YAML_TYPES for m in members):
        return yaml_float(value)
    for member in members:
        with contextlib.suppress(UserError):
            return _check_type(where, value, member)
    names = " or ".join(getattr(typing.get_origin(m) or m, "__name__", str(m)) for m in members)
    raise UserError(f"config key {where}: expected {names}, got {type(value).__name__} {value!r}")


def to_dict(cfg: RunConfig) -> dict:
    return dataclasses.asdict(cfg)


DEFAULT_MODEL = "tiny"  # the model of a config that names none (and has no init_from)

# Settings a resumed run must share with the run it continues (they shape the state, its dtypes
# or the data order: a gradient clip adds a stage to the optimizer's state; the windows its
# evaluations read, so that its curve is one curve); everything else
# (steps, learning rate, logging, mesh, ...) may change.
_FIXED_ON_RESUME = (
    "mode",
    "model",
    "data",
    "optimizer",
    "train.batch_size",
    "train.seq_len",
    "train.seed",
    "train.eval_batches",  # what every evaluation of the run reads
    "train.grad_clip",
    "train.param_dtype",
)
# What a run's results do not depend on: how it is split over devices and micro-batches, and what
# it records and saves along the way. A sweep restarted with other values of these goes on, and a
# resume that changes them alone leaves no changed_on_resume record.
OPERATIONAL = ("mesh", "checkpoint", "metrics", "xla", "train.micro_batch_size", "train.log_every")
# A profiling run's records: how often and how smoothly it records (profile.steps may change, as
# train.steps may; the donors and receivers only read the records at the end).
_FIXED_ON_PROFILE_RESUME = ("profile.every", "profile.ema")
# Fields of a model preset the trainer sets itself (the tokenizer's vocabulary, train's dtypes).
_TRAINER_SET_MODEL_FIELDS = ("name", "vocab_size", "param_dtype", "dtype")
# How the model computes, not what it is: a resume may take less memory or another attention.
_FREE_ON_RESUME = (
    "optimizer.svd",
    "data.workers",
    "data.cache_dir",
    "model.overrides.remat",
    "model.overrides.attention_impl",
    "model.overrides.loss_chunk",
)
# Where the data, its tokenizer and the store are, and model.init_from's directory: a resume
# finds files moved since at their new paths (the hash of the store's content saved with the
# checkpoint refuses other tokens) and does not read init_from (the model is the run's
# model.json). Only a resume: the sweep's reuse of finished runs, which restores nothing, keeps
# comparing them.
MOVABLE_ON_RESUME = (
    "data.paths",
    "data.validation_paths",
    "data.tokenizer",
    "data.store",
    "model.init_from",
)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        out.update(_flatten(v, key + ".") if isinstance(v, dict) else {key: v})
    return out


def under(key: str, prefixes: tuple[str, ...]) -> bool:
    """Whether the dotted ``key`` is one of ``prefixes`` or lies under one (``train`` holds
    ``train.lr``)."""
    return any(key == p or key.startswith(p + ".") for p in prefixes)


class Change(NamedTuple):
    """A setting of a config that differs from a run's saved one; written ``key: old -> new``."""

    key: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.key}: {self.old!r} -> {self.new!r}"


def changed_settings(
    saved: dict, new: dict, among: tuple[str, ...] | None = None, ignoring: tuple[str, ...] = ()
) -> list[Change]:
    """A ``Change`` for each setting of ``new`` (a mapping) that differs from a run's
    ``saved`` config, among the keys under ``among`` (None: all) but those under ``ignoring``,
    leaving out how the model computes (``_FREE_ON_RESUME``)."""
    # A key the saved config lacks was added since, with a default that does what runs did before
    # (optimizer.weight_decay_mask: all): a run saved then resumes.
    old_flat, new_flat = _flatten(to_dict(RunConfig())) | _flatten(saved or {}), _flatten(new)
    stated = set(old_flat) | set(new_flat)
    for flat in (old_flat, new_flat):  # an unnamed model is the default one
        if flat.get("model.name") is None and flat.get("model.init_from") is None:
            flat["model.name"] = DEFAULT_MODEL
        _fill_defaults(flat)
    # Another host: its defaults are no change of the user's (the host itself is named).
    other_host = old_flat.get("optimizer.host") != new_flat.get("optimizer.host")
    changed = sorted(
        k
        for k in set(old_flat) | set(new_flat)
        if (among is None or under(k, among))
        and not under(k, ignoring)
        and k not in _FREE_ON_RESUME
        and _read(k, old_flat.get(k)) != _read(k, new_flat.get(k))
        and not (other_host and k.startswith("optimizer.host_options.") and k not in stated)
    )
    return [Change(k, old_flat.get(k), new_flat.get(k)) for k in changed]


def _read(key: str, value: Any) -> Any:
    """A setting's value as the run reads it: a host option or model override written as a
    string that spells a float is that float (``1e-8`` in YAML is the string; the run reads the
    number)."""
    return yaml_float(value) if under(key, ("optimizer.host_options", "model.overrides")) else value


def _fill_defaults(flat: dict) -> None:
    """Fills in a flattened config the defaults it leaves to its host (``host_options``) and to
    its model preset (``model.overrides``): an option stated at its default changes nothing."""
    try:
        host = host_class(flat.get("optimizer.host"))
    except ValueError:  # (refused by the config's own checks)
        host = None
    for f in dataclasses.fields(host) if host is not None else ():
        if f.default is not dataclasses.MISSING:
            flat.setdefault(f"optimizer.host_options.{f.name}", f.default)
    if flat.get("model.init_from") is None and flat.get("model.name") in models.list_configs():
        preset = models.get_config(flat["model.name"])
        for f in dataclasses.fields(preset):
            if f.name not in _TRAINER_SET_MODEL_FIELDS:
                flat.setdefault(f"model.overrides.{f.name}", getattr(preset, f.name))


def check_resumable(saved: dict, new: dict) -> list[Change]:
    """Refuses a resume whose config (``new``, a mapping) changes, against the run's ``saved``
    one, what the checkpoint or the data order depend on (a profiling run's: also how it
    records); returns the changes it may make (``changed_settings``)."""
    fixed = _FIXED_ON_RESUME + (_FIXED_ON_PROFILE_RESUME if new.get("mode") == "profile" else ())
    was, now = ((config.get("model") or {}).get("init_from") for config in (saved or {}, new))
    if (was is None) != (now is None):  # a run from a directory or a preset: not the same run
        raise UserError(
            f"--resume: the run's {CONFIG} differs in model.init_from ({was!r} -> {now!r}): keep it "
            "(its directory need not be there: a resume takes the model from the run's model.json)"
        )
    changed = changed_settings(saved, new, fixed, ignoring=MOVABLE_ON_RESUME)
    if changed:
        raise UserError(
            f"--resume: the run's {CONFIG} differs in settings a resume cannot change "
            f"({', '.join(map(str, changed))})"
        )
    return changed_settings(saved, new)
