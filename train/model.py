"""The run's model: a named preset with overrides, or the model of a Hugging Face directory
(``model.init_from``: its config, checked against ``model.*``, and its weights, read sharded)."""

from __future__ import annotations

import dataclasses
import pathlib
import warnings

import models
from models.hf_files import FRAMEWORK_FIELDS, architecture, weight_files
from train.config import DEFAULT_MODEL, Change, RunConfig, yaml_float
from train.errors import UserError
from train.sources import make_tokenizer


def model_config(
    cfg: RunConfig, vocab_size: int, built: models.ModelConfig | None = None
) -> models.ModelConfig:
    """The ``models.ModelConfig`` of a run whose tokenizer has ``vocab_size`` ids. ``built``: the
    model a resumed run built (its ``model.json``), which the resume goes on with: in place of
    ``model.init_from``'s directory (the checkpoint holds the weights; the directory need not
    stay), or of the preset as this version defines it (``preset_changes``), taking from the
    config only how it computes (``COMPUTE_FIELDS``)."""
    if cfg.model.init_from is not None:
        return _init_from_config(cfg, vocab_size, built)
    now = _preset_config(cfg, vocab_size)
    return now if built is None else built.replace(**{f: getattr(now, f) for f in COMPUTE_FIELDS})


# The fields of a resumed run's model taken from its config (a resume may change how the model
# computes, and train's dtypes set two); the others are the model.json's.
COMPUTE_FIELDS = ("param_dtype", "dtype", "remat", "attention_impl", "loss_chunk")


def preset_changes(built: models.ModelConfig, now: models.ModelConfig) -> list[Change]:
    """What the model a run's config makes now (``now``) has other than the one the run built
    (``built``, its ``model.json``): a preset this version defines otherwise. The fields that
    make the model (``models.architecture``) and its initialization; not how it computes."""
    old = architecture(built) | {"initializer_range": built.initializer_range}
    new = architecture(now) | {"initializer_range": now.initializer_range}
    keys = sorted(old.keys() | new.keys())
    return [Change(f"model.{k}", old.get(k), new.get(k)) for k in keys if old.get(k) != new.get(k)]


def _preset_config(cfg: RunConfig, vocab_size: int) -> models.ModelConfig:
    m, t = cfg.model, cfg.train
    overrides = {"vocab_size": vocab_size} | _numbers(m.overrides)
    wanted = overrides["vocab_size"]
    if isinstance(wanted, bool) or not isinstance(wanted, int) or wanted < vocab_size:
        raise UserError(
            f"model.overrides.vocab_size must be an integer >= the tokenizer's {vocab_size} ids "
            f"(a larger vocabulary pads the embedding), got {wanted!r}"
        )
    try:
        preset = m.name or DEFAULT_MODEL
        return models.get_config(preset, param_dtype=t.param_dtype, dtype=t.dtype, **overrides)
    except (ValueError, TypeError) as e:
        raise UserError(f"model: {e}") from None


_FLOAT_FIELDS = {f.name for f in dataclasses.fields(models.ModelConfig) if f.type in (float, "float")}


def _numbers(overrides: dict) -> dict:
    """The overrides with a float field's number written as a string read as the number, as the
    typed config sections read it (``yaml_float``)."""
    return {k: yaml_float(v) if k in _FLOAT_FIELDS else v for k, v in overrides.items()}


def _init_from_config(
    cfg: RunConfig, vocab_size: int, built: models.ModelConfig | None = None
) -> models.ModelConfig:
    m, t = cfg.model, cfg.train
    directory = pathlib.Path(m.init_from).expanduser()
    if built is not None:  # a resume: the model the run built from the directory; how it
        # computes as the directory's would be (the framework fields' defaults), then as now set
        defaults = {
            f.name: f.default
            for f in dataclasses.fields(built)
            if f.name in FRAMEWORK_FIELDS and f.name != "name"
        }
        found, default_name = built.replace(**defaults), built.name
    else:
        if not directory.is_dir():
            raise UserError(f"model.init_from: {directory} is not a directory")
        try:
            found = models.read_hf_config(directory)
        except (ImportError, ValueError) as e:
            raise UserError(f"model.init_from: {e}") from None
        default_name = directory.name
    overrides = _numbers(m.overrides)
    framework = {k: v for k, v in overrides.items() if k in FRAMEWORK_FIELDS}
    name = framework.pop("name", default_name)
    stated = {k: v for k, v in overrides.items() if k not in FRAMEWORK_FIELDS}
    try:
        if m.name is not None:  # the preset's architecture, but the vocabulary (the tokenizer's)
            preset = models.get_config(m.name)
            named = {f: getattr(preset, f) for f in architecture(preset) if f != "vocab_size"}
            named["num_key_value_heads"], named["head_dim"] = preset.num_key_value_heads, preset.head_dim
            stated = {**named, **stated}
        wanted = found.replace(**stated)
        result = found.replace(param_dtype=t.param_dtype, dtype=t.dtype, name=name, **framework)
    except (ValueError, TypeError) as e:
        raise UserError(f"model: {e}") from None
    have, want = architecture(found), architecture(wanted)
    differ = [k for k in have if have[k] != want.get(k)]
    if differ:
        details = ", ".join(f"{k} {want.get(k)!r} in the config, {have[k]!r} in {directory}" for k in differ)
        raise UserError(
            f"model.init_from: the model in {directory} is not the one model.name/model.overrides "
            f"describe ({details}); drop those keys or make them agree"
        )
    if vocab_size > found.vocab_size:
        raise UserError(
            f"model.init_from: the tokenizer has {vocab_size} ids but the model in {directory} has a "
            f"vocabulary of {found.vocab_size}"
        )
    return result


# The files of a Hugging Face directory that make its tokenizer (a sentencepiece model or a
# tokenizers' file): a model that has one was trained on its ids.
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def check_init_from(cfg: RunConfig, built: models.ModelConfig | None = None) -> None:
    """What ``model.init_from`` makes wrong, said before any data work (a corpus may take hours to
    tokenize): a directory that is no such model or not the one ``model.*`` describes, a tokenizer
    with more ids than its vocabulary, a weight file missing (not for a resume, whose weights are
    in its checkpoint: ``built``). A run on the byte tokenizer from a model that has its own is
    warned of: byte ids mean nothing to it."""
    directory = pathlib.Path(cfg.model.init_from).expanduser()
    own = [name for name in HF_TOKENIZER_FILES if (directory / name).is_file()] if built is None else []
    if cfg.data.tokenizer == "bytes" and own:  # (before a refusal of the byte ids' number)
        warnings.warn(
            f"model.init_from {directory} has its own tokenizer ({own[0]}), but data.tokenizer is bytes: "
            f"the run trains it on byte ids, which mean nothing to it; set data.tokenizer={directory}"
            + ("" if own[0] == "tokenizer.json" else f"/{own[0]}"),
            stacklevel=2,
        )
    vocab = make_tokenizer(cfg.data.tokenizer).vocab_size if cfg.data.source != "store" else 0
    model_config(cfg, vocab, built)
    if built is None:
        try:
            weight_files(directory)
        except ValueError as e:
            raise UserError(f"model.init_from: {e}") from None


def init_from_params(cfg: RunConfig, model_cfg: models.ModelConfig, shardings):
    """The weights of ``model.init_from`` as ``model_cfg``'s parameters, each device reading its
    own block of the files."""
    try:
        return models.load_hf_params(pathlib.Path(cfg.model.init_from).expanduser(), model_cfg, shardings)
    except (ImportError, ValueError) as e:
        raise UserError(f"model.init_from: {e}") from None
