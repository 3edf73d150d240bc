"""Hugging Face model directories on disk: ``config.json`` and safetensors weights, written from
and read into Flax parameters without torch.

Weights go through the ``safetensors`` package's NumPy API (bf16 through ``ml_dtypes``), a file
of at most ``max_shard_bytes`` at a time (``model.safetensors``, or numbered files with a
``model.safetensors.index.json`` as ``transformers`` writes them). Reading is sharded: each
device's block of each parameter is read from the file as a slice, so the model is never whole
in host memory, nor on one device. ``config.json`` is written and read by ``transformers``'
config classes (no torch needed), so its keys are what the installed version expects.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import re
import stat
from typing import Any

import jax
import numpy as np

from models.configs import DTYPES, FAMILIES, ModelConfig, replace_config, rope_scaling_type
from models.hf import (
    check_shape,
    config_error_line,
    config_errors,
    config_from_hf,
    hf_entries,
    key_names,
    listed,
    stored_name,
    to_hf_config,
    unexpected_keys,
    unsupported_family,
)
from models.model import abstract_params

WEIGHTS = "model.safetensors"
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
INDEX = "model.safetensors.index.json"
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names of the weights' dtypes read
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
}
# ModelConfig fields that say how this project runs a model, not what the model is.
FRAMEWORK_FIELDS = (
    "param_dtype",
    "dtype",
    "scan_layers",
    "remat",
    "attention_impl",
    "loss_chunk",
    "name",
)


def architecture(cfg: ModelConfig) -> dict[str, Any]:
    """What makes two configs the same model (the fields that shape the parameters or the
    maths), with equivalent spellings made equal: the implied KV-head count and head size, no
    ``attention_bias`` for Qwen2 (whose q/k/v always have biases and o_proj never), and RoPE
    scaling by its ``rope_type`` (the older ``type`` key read as it; the default type as none)."""
    out = {
        f: getattr(cfg, f)
        for f in cfg.__dataclass_fields__
        if f not in FRAMEWORK_FIELDS + ("initializer_range", "num_key_value_heads", "head_dim")
    }
    out["num_key_value_heads"] = cfg.kv_heads
    if cfg.model_type != "deepseek_v2":
        out["head_dim"] = cfg.head_size
    if cfg.model_type == "qwen2":
        out.pop("attention_bias")
    kind = rope_scaling_type(cfg.rope_scaling)
    out["rope_scaling"] = (
        None
        if kind == "default"
        else {**{k: v for k, v in cfg.rope_scaling.items() if k != "type"}, "rope_type": kind}
    )
    return out


def _dtype_name(dtype: Any) -> str | None:
    """NumPy's name of ``dtype`` (``None`` for what is no dtype, as ``'bf16'``)."""
    try:
        return str(jax.numpy.dtype(dtype))
    except TypeError:
        return None


def _safetensors():
    try:
        import safetensors  # noqa: F401
        import safetensors.numpy
    except ImportError:
        raise ImportError(
            "reading or writing safetensors needs the safetensors package: pip install 'moara-jax[hf]'"
        ) from None
    return safetensors


def _tensor_plan(cfg: ModelConfig, params) -> list[tuple[str, Any, int | None, bool]]:
    """``(hf_name, leaf, layer, transpose)`` for every tensor of the HF checkpoint, grouped by
    layer (embeddings, layer 0, layer 1, ..., final norm, LM head); a tied LM head is left out,
    as ``save_pretrained`` leaves it out."""
    first, layers, last = [], {}, []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        for name, layer, transpose in hf_entries(cfg, path):
            if name.startswith("model.layers."):
                layers.setdefault(int(name.split(".")[2]), []).append((name, leaf, layer, transpose))
            else:
                (first if "embed_tokens" in name else last).append((name, leaf, layer, transpose))
    return first + [e for i in sorted(layers) for e in layers[i]] + last


def write_hf_dir(
    directory,
    cfg: ModelConfig,
    params,
    *,
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 10**9,
    token_ids: dict[str, int | None] | None = None,
) -> dict:
    """Writes ``params`` of ``cfg`` as a Hugging Face model directory: ``config.json``,
    ``generation_config.json`` and the weights (HF names and layouts, in ``dtype`` or each
    parameter's own dtype). ``token_ids``: ``bos_token_id``, ``eos_token_id``, ``pad_token_id``
    for both configs (those not given are written as none: the model has no such token). The
    weights of an earlier save in ``directory`` are removed, as ``save_pretrained`` does.
    Returns ``{"files": [...], "tensors": n, "bytes": n}``.

    Needs ``safetensors`` and ``transformers`` (not torch)."""
    import transformers

    if dtype is not None and _dtype_name(dtype) not in DTYPES:  # before anything is written
        raise ValueError(f"write_hf_dir: dtype must be one of {DTYPES} (or None), got {dtype!r}")
    st = _safetensors()
    hf_config = to_hf_config(cfg)  # before anything is written: transformers may refuse it
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = None if dtype is None else jax.numpy.dtype(dtype)
    plan = _tensor_plan(cfg, params)

    def nbytes(entry) -> int:
        name, leaf, layer, _ = entry
        shape = leaf.shape[1:] if layer is not None else leaf.shape
        return int(np.prod(shape)) * (target or leaf.dtype).itemsize

    shards: list[list] = [[]]
    size = 0
    for entry in plan:
        if shards[-1] and size + nbytes(entry) > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes(entry)
    names = (
        [WEIGHTS]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    # The weights of an earlier save there go, as save_pretrained removes them: beside the new
    # ones, a model.safetensors or an index would be read instead by one reader or another.
    for stale in _weight_files_written(directory):
        if stale.name not in names:
            stale.unlink()
    weight_map = {}
    for file_name, entries in zip(names, shards, strict=True):
        tensors = {}
        for name, leaf, layer, transpose in entries:  # one shard on the host at a time
            x = np.asarray(leaf[layer] if layer is not None else leaf)
            x = x.T if transpose else x
            tensors[name] = np.ascontiguousarray(x if target is None else x.astype(target))
            weight_map[name] = file_name
        st.numpy.save_file(tensors, str(directory / file_name), metadata={"format": "pt"})
    total = sum(nbytes(e) for e in plan)
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")

    hf_config.architectures = [ARCHITECTURES[cfg.model_type]]
    stored = str(target or jax.numpy.dtype(cfg.param_dtype))
    for attr in ("dtype", "torch_dtype"):  # transformers >= 5 writes dtype, 4.x torch_dtype
        if attr in hf_config.to_dict():
            setattr(hf_config, attr, stored)
            break
    # None: the model has no such token (not the family's default); ids not given are None too.
    ids = {key: None for key in TOKEN_ID_KEYS} | dict(token_ids or {})
    for key, value in ids.items():
        setattr(hf_config, key, value)
    hf_config.save_pretrained(str(directory))
    _add_legacy_keys(directory / "config.json", cfg, stored)
    transformers.GenerationConfig(**ids).save_pretrained(str(directory))
    # safetensors writes its files 0600 (made as temporary files): the weights take the mode the
    # umask gave config.json, so whoever may read the config may read the model.
    mode = stat.S_IMODE((directory / "config.json").stat().st_mode)
    for name in names:
        (directory / name).chmod(mode)
    files = names + ([INDEX] if len(names) > 1 else []) + ["config.json", "generation_config.json"]
    return {"files": files, "tensors": len(plan), "bytes": total}


def _weight_files_written(directory: pathlib.Path) -> list[pathlib.Path]:
    """The safetensors weights of a model there as ``write_hf_dir`` and ``save_pretrained`` name
    them: ``model.safetensors``, numbered shards and their index."""
    return sorted(
        p
        for p in directory.iterdir()
        if p.name in (WEIGHTS, INDEX) or re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", p.name)
    )


def _add_legacy_keys(path: pathlib.Path, cfg: ModelConfig, stored: str) -> None:
    """transformers 5 writes RoPE as ``rope_parameters`` and the dtype as ``dtype``; transformers
    4.x, and the tools pinned to it (vLLM releases among them), read the top-level ``rope_theta``,
    ``rope_scaling`` and ``torch_dtype``, and without them load the model with RoPE base 10000 and
    no scaling, silently. Both spellings are written (transformers 5 reads ``rope_parameters``)."""
    config = json.loads(path.read_text())
    config.setdefault("rope_theta", cfg.rope_theta)
    config.setdefault("rope_scaling", dict(cfg.rope_scaling) if cfg.rope_scaling else None)
    config.setdefault("torch_dtype", stored)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def read_hf_config(directory, **overrides) -> ModelConfig:
    """The :class:`ModelConfig` of a Hugging Face model directory (its ``config.json``).

    Raises:
      ValueError: no ``config.json``, or a model this project does not implement.
    """
    import transformers

    directory = pathlib.Path(directory)
    if directory.name == "config.json" and directory.is_file():
        raise ValueError(f"{directory}: pass the model's directory, not its config.json")
    if not directory.is_dir():
        raise ValueError(
            f"{directory} is not a directory: pass a local Hugging Face model directory (a Hub "
            "model is downloaded first, e.g. `hf download ORG/NAME --local-dir DIR`)"
        )
    if not (directory / "config.json").is_file():
        raise ValueError(f"{directory} holds no config.json (not a Hugging Face model directory)")
    try:  # a family this library has not, said before transformers' advice to upgrade it
        kind = json.loads((directory / "config.json").read_text()).get("model_type")
    except (ValueError, AttributeError, OSError):
        kind = None  # (transformers says what is wrong with the file)
    if isinstance(kind, str) and kind not in FAMILIES:
        raise ValueError(f"{directory}/config.json: {unsupported_family(kind)}")
    try:
        hf_config = transformers.AutoConfig.from_pretrained(str(directory))
    except (KeyError, OSError) as e:
        raise ValueError(f"{directory}/config.json: {str(e).splitlines()[0]}") from None
    except config_errors() as e:
        raise ValueError(f"{directory}/config.json: {config_error_line(e)}") from None
    try:
        cfg = config_from_hf(hf_config, name=directory.name)
    except ValueError as e:
        raise ValueError(f"{directory}/config.json: {e}") from None
    return replace_config(cfg, **overrides)


def weight_files(directory) -> dict[str, pathlib.Path]:
    """Tensor name -> the safetensors file of a Hugging Face model directory that holds it.

    Raises:
      ValueError: no safetensors weights in ``directory``.
    """
    directory = pathlib.Path(directory)
    # transformers' order: a model.safetensors beside an index is the one it reads.
    if (directory / WEIGHTS).is_file():
        try:
            with _safetensors().safe_open(str(directory / WEIGHTS), framework="numpy") as f:
                found = {name: directory / WEIGHTS for name in f.keys()}
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error type
            raise ValueError(f"{directory / WEIGHTS} cannot be read: {e}") from None
    elif (directory / INDEX).is_file():
        try:
            weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{directory / INDEX} is not a safetensors index (no weight_map)") from None
        found = {name: directory / file for name, file in weight_map.items()}
    else:
        other = sorted(p.name for p in directory.glob("*.bin")) + sorted(
            p.name for p in directory.glob("*.pt")
        )
        hint = (
            f" (it has {', '.join(other[:3])}: load it with transformers and save_pretrained it again, "
            "which writes safetensors)"
            if other
            else ""
        )
        raise ValueError(f"{directory} holds no {WEIGHTS} or {INDEX}{hint}")
    missing = sorted({str(p.name) for p in found.values() if not p.is_file()})
    if missing:
        raise ValueError(f"{directory}: weight file(s) missing: {', '.join(missing)}")
    return found


def load_hf_params(directory, cfg: ModelConfig, shardings=None) -> dict[str, Any]:
    """Flax parameters of ``cfg`` from the safetensors weights of a Hugging Face model directory,
    placed with ``shardings`` (a tree of shardings like the parameters; default: the first
    device). Each device's block is read as a slice of the file and converted to
    ``cfg.param_dtype``.

    Raises:
      ValueError: naming a missing or unexpected tensor, or a shape that does not fit ``cfg``.
    """
    directory = pathlib.Path(directory)
    files = weight_files(directory)
    shapes = abstract_params(cfg)
    if shardings is None:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: one, shapes)
    st = _safetensors()
    used: set[str] = set()
    with contextlib.ExitStack() as stack:
        opened, held = {}, {}
        for f in sorted(set(files.values())):
            try:
                opened[f] = stack.enter_context(st.safe_open(str(f), framework="numpy"))
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error type
                raise ValueError(f"{f} cannot be read: {e}") from None
            held[f] = set(opened[f].keys())

        def tensor(name: str):
            key = stored_name(name, files)
            if key is None:
                raise ValueError(f"{directory}: missing tensor {name!r} for a {cfg.model_type} model")
            name = key
            used.add(name)
            if name not in held[files[name]]:
                raise ValueError(
                    f"{directory / INDEX} puts {name!r} in {files[name].name}, which does not hold it"
                )
            return opened[files[name]].get_slice(name)

        def load(path, spec, sharding):
            entries = hf_entries(cfg, path)
            scanned = key_names(path)[0] == "layers"
            slices = [tensor(name) for name, _, _ in entries]
            transpose = entries[0][2]
            want = spec.shape[1:] if scanned else spec.shape
            for (name, _, _), s in zip(entries, slices, strict=True):
                if s.get_dtype() not in FLOAT_DTYPES:  # numpy cannot read float8, say
                    raise ValueError(
                        f"{directory}: tensor {name!r} is {s.get_dtype()}; the weights must be "
                        f"one of {', '.join(FLOAT_DTYPES)}"
                    )
                check_shape(f"{directory}: tensor {name!r}", tuple(s.get_shape()), want, transpose)

            def block(index):
                def read(s, idx):
                    x = s[tuple(idx[::-1])] if transpose else s[tuple(idx)]
                    return np.asarray(x.T if transpose else x)

                if scanned:
                    layers = range(*index[0].indices(spec.shape[0]))
                    x = np.stack([read(slices[i], index[1:]) for i in layers])
                else:
                    x = read(slices[0], index)
                return x.astype(spec.dtype)

            return jax.make_array_from_callback(spec.shape, sharding, block)

        params = jax.tree_util.tree_map_with_path(load, shapes, shardings)
        if cfg.tie_word_embeddings and "lm_head.weight" in files:
            head = tensor("lm_head.weight")[:]
            if not np.array_equal(head, tensor("model.embed_tokens.weight")[:]):  # either spelling
                raise ValueError(
                    f"{directory}: the config ties the embeddings, but lm_head.weight differs from "
                    "model.embed_tokens.weight"
                )
    extra = unexpected_keys(cfg, files, used)
    if extra:
        raise ValueError(f"{directory}: unexpected tensors for a {cfg.model_type} model: {listed(extra)}")
    return params
