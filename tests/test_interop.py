"""Hugging Face interop: model directories written for every family and loaded by
``transformers`` (torch CPU) with the same logits, a run exported through ``train.export`` with
its sentencepiece tokenizer, ``model.init_from`` starting a run from those weights, sharded
loading on an 8-device mesh, and ``train.evaluate`` against hand-computed and ``transformers``
scores."""

import dataclasses
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import lm_harness
import ml_dtypes
import numpy as np
import pytest
import yaml
from helpers import cpu_devices
from lm_harness import NAME, assert_same_scores, evaluate_scores, harness_cli_scores, harness_scores
from test_train import run_cli

import models
from models.hf_files import write_hf_dir
from train import evaluate as evaluation
from train import export as exporting
from train import sources
from train.errors import UserError
from train.rundir import read_metrics
from train.sources import SentencePieceTokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
spm = pytest.importorskip("sentencepiece")

ROOT = pathlib.Path(__file__).resolve().parents[1]
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
FAMILIES = ["llama2-tiny", "llama3.2-tiny", "qwen2.5-tiny", "qwen3-tiny", "deepseek-v2-tiny"]
RUN = [
    "train.steps=4",
    "train.eval_every=4",
    "train.batch_size=8",
    "train.seq_len=32",
    "train.eval_batches=1",
    "optimizer.update_proj_gap=5",
    "checkpoint.every=2",
    "checkpoint.keep=3",
]


def hf_logits(directory, tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), attn_implementation="eager")
    with torch.no_grad():
        return model.eval()(torch.from_numpy(np.asarray(tokens))).logits.float().numpy()


def close(got, want, tol=1e-4):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.linalg.norm(got - want) <= tol * np.linalg.norm(want), np.abs(got - want).max()


def random_params(cfg, seed=0):
    """Random weights with norms and biases off their initial values, so each one matters."""
    params = models.init_params(cfg, jax.random.PRNGKey(seed))
    rng = np.random.default_rng(seed)

    def perturb(path, x):
        name = jax.tree_util.keystr(path)
        if "bias" in name or "norm" in name:
            return x + jnp.asarray(0.1 * rng.standard_normal(x.shape), x.dtype)
        return x

    return jax.tree_util.tree_map_with_path(perturb, params)


@pytest.mark.parametrize(
    "name",  # the fast lane: Llama 2 and DeepSeek-V2 (MLA), the two code paths apart
    [
        pytest.param(n, marks=pytest.mark.slow) if n in ("llama3.2-tiny", "qwen2.5-tiny", "qwen3-tiny") else n
        for n in FAMILIES
    ],
)
def test_every_family_writes_a_directory_transformers_loads(name, tmp_path):
    scan = name != "llama2-tiny"  # stacked layers split into per-layer tensors, and not
    cfg = models.get_config(name, scan_layers=scan)
    params = random_params(cfg)
    # A small shard limit for the scanned ones: several files and an index, as HF writes them.
    written = write_hf_dir(tmp_path, cfg, params, max_shard_bytes=60_000 if scan else 10**9)
    assert (len([f for f in written["files"] if f.endswith(".safetensors")]) > 1) == scan
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 13))
    close(hf_logits(tmp_path, tokens), models.forward(cfg, params, jnp.asarray(tokens)))

    back_cfg = models.read_hf_config(tmp_path, scan_layers=scan)
    assert models.architecture(back_cfg) == models.architecture(cfg)
    back = models.load_hf_params(tmp_path, back_cfg)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_save_over_another_leaves_only_its_weights_and_both_readers_read_them(tmp_path):
    """Saves of other shardings into one directory, one after the other: each removes the
    earlier one's weights (as ``save_pretrained`` does), so this loader and transformers read the
    last. Beside a model.safetensors, an index is what transformers passes over: so does this
    loader. Token ids not given are written as none, in both configs. The weights' mode is the
    config's."""
    cfg = models.get_config("llama2-tiny")
    first, second, third = (random_params(cfg, seed) for seed in (0, 1, 2))
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 9))
    for params, shard in ((first, 60_000), (second, 10**9), (third, 60_000)):
        umask = os.umask(0o022)  # (whatever the machine's: the config readable by all)
        try:
            written = write_hf_dir(tmp_path, cfg, params, max_shard_bytes=shard)
        finally:
            os.umask(umask)
        weights = sorted(p.name for p in tmp_path.iterdir() if "safetensors" in p.name)
        assert weights == sorted(f for f in written["files"] if "safetensors" in f)
        # Every file readable as the config is (safetensors made the weights 0600).
        modes = {f: (tmp_path / f).stat().st_mode & 0o777 for f in written["files"]}
        assert set(modes.values()) == {modes["config.json"]} and modes["config.json"] & 0o044, modes
        loaded = models.load_hf_params(tmp_path, cfg)
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        close(hf_logits(tmp_path, tokens), models.forward(cfg, params, jnp.asarray(tokens)))
    # Weights of exactly max_shard_bytes fit in one file (every save's tensors take the same bytes).
    at_limit = write_hf_dir(tmp_path / "at_limit", cfg, first, max_shard_bytes=written["bytes"])
    assert [f for f in at_limit["files"] if "safetensors" in f] == ["model.safetensors"]
    shutil.copy(tmp_path / written["files"][0], tmp_path / "stray.safetensors")
    write_hf_dir(tmp_path / "one", cfg, second)
    shutil.copy(tmp_path / "one" / "model.safetensors", tmp_path / "model.safetensors")
    loaded = models.load_hf_params(tmp_path, cfg)  # the index's shards hold `third`
    np.testing.assert_array_equal(*(np.asarray(jax.tree.leaves(t)[0]) for t in (second, loaded)))
    assert (tmp_path / "stray.safetensors").is_file()  # a file of no save's naming is kept
    for name in ("config.json", "generation_config.json"):
        ids = json.loads((tmp_path / name).read_text())
        assert [ids.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")] == [None] * 3, ids


def test_bf16_export_stores_bf16_and_loads_as_bf16(tmp_path):
    cfg = models.get_config("qwen3-tiny")
    params = random_params(cfg)
    write_hf_dir(tmp_path, cfg, params, dtype="bfloat16")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert model.dtype == torch.bfloat16
    want = np.asarray(params["embed_tokens"]["embedding"].astype(jnp.bfloat16), np.float32)
    got = model.model.embed_tokens.weight.detach().float().numpy()
    np.testing.assert_array_equal(got, want)
    loaded = models.load_hf_params(tmp_path, cfg.replace(param_dtype="bfloat16"))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded), strict=True):
        assert b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.bfloat16)), np.asarray(b))
    # to_hf's bfloat16 arrays reach torch by their bits, as its docstring says.
    weight = models.to_hf(cfg.replace(param_dtype="bfloat16"), loaded)["model.embed_tokens.weight"]
    as_torch = torch.from_numpy(weight.view(np.uint16)).view(torch.bfloat16)
    assert torch.equal(as_torch, model.model.embed_tokens.weight.detach())
    # A dtype the models do not load (int8 weights, which load_hf_params then refused) is refused
    # before anything is written.
    for bad in ("int8", "bf16"):  # a dtype of no float weights, a name NumPy does not know
        with pytest.raises(ValueError, match=rf"write_hf_dir: dtype must be one of .*got '{bad}'"):
            write_hf_dir(tmp_path / bad, cfg, params, dtype=bad)
        assert not (tmp_path / bad).exists()


@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING], ids=["plain", "llama3"])
def test_config_json_carries_the_keys_transformers_4_reads(scaling, tmp_path):
    """transformers 4.x (and vLLM releases pinned to it) read RoPE from the top-level
    ``rope_theta``/``rope_scaling`` and the dtype from ``torch_dtype``; without them such a tool
    loads the model with RoPE base 10000 and no scaling. The export writes them beside
    transformers 5's ``rope_parameters``/``dtype``, and a config with only those keys reads back
    as the same model."""
    cfg = models.get_config("llama3.2-tiny", rope_scaling=scaling)
    write_hf_dir(tmp_path, cfg, models.init_params(cfg, jax.random.PRNGKey(0)), dtype="bfloat16")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["rope_theta"] == cfg.rope_theta == 500000.0
    assert config["rope_scaling"] == scaling
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    assert config["rope_parameters"] == {"rope_type": "default", **(scaling or {}), "rope_theta": 500000.0}
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "config.json").write_text(
        json.dumps({k: v for k, v in config.items() if k not in ("rope_parameters", "dtype")})
    )
    assert models.read_hf_config(legacy) == models.read_hf_config(tmp_path) == cfg


def test_equivalent_rope_scaling_spellings_are_one_architecture(tmp_path):
    """The older ``type`` key of a llama3 scaling comes back from an export with ``rope_type``,
    and a scaling of the default type is none: the same model, as ``architecture`` (what
    ``model.init_from`` compares a run's model with) says; another factor is another model."""
    legacy = {k if k != "rope_type" else "type": v for k, v in LLAMA3_SCALING.items()}
    cfg = models.get_config("llama3.2-tiny", rope_scaling=legacy)
    write_hf_dir(tmp_path, cfg, models.init_params(cfg, jax.random.PRNGKey(0)))
    back = models.read_hf_config(tmp_path)
    assert back.rope_scaling != cfg.rope_scaling  # spelled otherwise...
    assert models.architecture(back) == models.architecture(cfg)  # ...the same model
    plain = models.get_config("llama3.2-tiny")
    assert models.architecture(plain.replace(rope_scaling={"rope_type": "default"})) == models.architecture(
        plain
    )
    other = models.get_config("llama3.2-tiny", rope_scaling={**LLAMA3_SCALING, "factor": 4.0})
    assert models.architecture(other) != models.architecture(cfg)


def test_bad_directories_are_named(tmp_path):
    cfg = models.get_config("llama2-tiny")
    with pytest.raises(ValueError, match="holds no config.json"):
        models.read_hf_config(tmp_path)
    write_hf_dir(tmp_path, cfg, models.init_params(cfg, jax.random.PRNGKey(0)))
    with pytest.raises(ValueError, match="pass the model's directory, not its config.json"):
        models.read_hf_config(tmp_path / "config.json")
    with pytest.raises(ValueError, match=r"is not a directory: .*hf download ORG/NAME --local-dir DIR"):
        models.read_hf_config("meta-llama/Llama-3.2-1B")
    other = json.loads((tmp_path / "config.json").read_text()) | {"model_type": "gpt2"}
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps(other))
    with pytest.raises(
        ValueError, match=r"unsupported HF model_type 'gpt2' \(supported: llama, qwen2, qwen3, deepseek_v2\)"
    ):
        models.read_hf_config(gpt2)
    (gpt2 / "config.json").write_text(json.dumps(other | {"model_type": "no_such_family"}))
    with pytest.raises(ValueError) as refused:  # not transformers' paragraph on upgrading itself
        models.read_hf_config(gpt2)
    assert str(refused.value) == (
        f"{gpt2}/config.json: unsupported HF model_type 'no_such_family' (supported: llama, qwen2, qwen3, "
        "deepseek_v2)"
    )
    (gpt2 / "config.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="holds no model.safetensors"):
        models.load_hf_params(gpt2, cfg)
    (gpt2 / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"pytorch_model.bin: load it with transformers and save_pretrained"):
        models.load_hf_params(gpt2, cfg)
    with pytest.raises(ValueError, match="missing tensor 'model.layers.0.self_attn.[qkv]_proj.bias'"):
        models.load_hf_params(tmp_path, cfg.replace(attention_bias=True))
    with pytest.raises(ValueError, match="has shape"):
        models.load_hf_params(tmp_path, cfg.replace(intermediate_size=64))
    # A tied model whose file holds its own, different LM head.
    from safetensors.numpy import load_file, save_file

    tied_cfg = models.get_config("llama3.2-tiny")
    tied = tmp_path / "tied"
    write_hf_dir(tied, tied_cfg, models.init_params(tied_cfg, jax.random.PRNGKey(0)))
    tensors = load_file(str(tied / "model.safetensors"))
    models.load_hf_params(tied, tied_cfg)  # without lm_head.weight: fine
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1
    save_file(tensors, str(tied / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        models.load_hf_params(tied, tied_cfg)
    # A sharded directory with a truncated shard, and with an index that names the wrong shard.
    sharded = tmp_path / "sharded"
    write_hf_dir(sharded, cfg, models.init_params(cfg, jax.random.PRNGKey(0)), max_shard_bytes=60_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    wrong = tmp_path / "wrong"
    shutil.copytree(sharded, wrong)
    embed = "model.embed_tokens.weight"
    index["weight_map"][embed] = next(f for f in shards if f != index["weight_map"][embed])
    (wrong / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        ValueError, match=f"puts '{embed}' in {index['weight_map'][embed]}, which does not hold it"
    ):
        models.load_hf_params(wrong, cfg)
    with open(sharded / shards[1], "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match=f"{shards[1]} cannot be read: "):
        models.load_hf_params(sharded, cfg)


@pytest.mark.parametrize(
    "key, value, named",
    [
        ("tie_word_embeddings", "false", "tie_word_embeddings"),
        ("hidden_size", "64", "hidden_size"),
        ("num_attention_heads", 4.0, "num_attention_heads"),
        ("vocab_size", None, "vocab_size"),
        ("head_dim", 15, "head_dim"),
    ],
)
def test_a_config_json_transformers_refuses_is_one_line_naming_the_field(key, value, named, tmp_path):
    """transformers 5 checks a config's fields strictly, with errors that are not ValueErrors:
    each is one line here, as every other refusal of a directory is."""
    cfg = models.get_config("llama2-tiny")
    write_hf_dir(tmp_path, cfg, models.init_params(cfg, jax.random.PRNGKey(0)))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {key: value}))
    with pytest.raises(ValueError, match=f"^{re.escape(str(tmp_path))}/config.json: .*{named}") as e:
        models.read_hf_config(tmp_path)
    assert "\n" not in str(e.value)


def test_a_quantized_checkpoint_is_refused_by_its_config_and_its_tensors(tmp_path):
    """An FP8 release (as Qwen's ``*-FP8``): the config says so and is refused; a float8 tensor
    under a plain config is named, not a numpy AttributeError from inside safetensors."""
    from safetensors.numpy import load_file, save_file

    cfg = models.get_config("llama2-tiny")
    write_hf_dir(tmp_path, cfg, models.init_params(cfg, jax.random.PRNGKey(0)))
    plain = json.loads((tmp_path / "config.json").read_text())
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16]}
    (tmp_path / "config.json").write_text(json.dumps(plain | {"quantization_config": fp8}))
    with pytest.raises(ValueError, match=r"quantized checkpoints are not supported \(.*quant_method 'fp8'\)"):
        models.read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(plain))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].astype(ml_dtypes.float8_e4m3fn)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"tensor '{name}' is F8_E4M3; the weights must be one of F16, BF16"):
        models.load_hf_params(tmp_path, models.read_hf_config(tmp_path))


def test_a_model_transformers_would_refuse_writes_nothing(tmp_path):
    """The config is built before any weight is written: a refusal leaves no folder of weights
    without a config.json (a model made directly, past ``ModelConfig``'s checks)."""
    cfg = models.get_config("llama2-tiny")
    params = models.init_params(cfg, jax.random.PRNGKey(0))
    bad = dataclasses.replace(cfg)
    for field in ("num_attention_heads", "num_key_value_heads"):  # 64 is no multiple of 3
        object.__setattr__(bad, field, 3)
    with pytest.raises(ValueError, match=r"^transformers refuses the llama config: .*multiple of the number"):
        write_hf_dir(tmp_path / "out", bad, params)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------- a trained run, exported and back


def train_sentencepiece(
    prefix: pathlib.Path, model_type: str = "unigram", texts=None, vocab_size: int = 60, **settings
) -> pathlib.Path:
    """A sentencepiece model (pad 0, EOS 1, UNK 2, no BOS) trained on ``texts`` (default: a small
    corpus for 60 pieces), with sentencepiece's trainer ``settings``."""
    corpus = prefix.with_name("corpus.txt")
    texts = texts or [f"the quick brown fox {i} jumps over the lazy dog" for i in range(300)]
    corpus.write_text("\n".join(texts))
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(prefix),
        model_type=model_type,
        vocab_size=vocab_size,
        eos_id=1,
        pad_id=0,
        unk_id=2,
        bos_id=-1,
        minloglevel=2,
        **settings,
    )
    return prefix.with_suffix(".model")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 4-step run on a sentencepiece tokenizer trained here, checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("interop")
    train_sentencepiece(root / "sp")
    data = root / "d.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"the quick brown fox {i} is lazy"}) for i in range(200)))
    sets = [*RUN, "data.source=files", f"data.paths=['{data}']", f"data.tokenizer={root / 'sp.model'}"]
    run_cli(root / "run", *sets)
    return {"root": root, "dir": root / "run", "tokenizer": str(root / "sp.model"), "sets": sets}


@pytest.fixture(scope="module")
def exported(run):
    out = run["root"] / "hf"
    assert exporting.main(["--run-dir", str(run["dir"]), "--out", str(out)]) == 0
    return out


@pytest.mark.slow
def test_sentencepiece_run_trains(run):
    tok = SentencePieceTokenizer(run["tokenizer"])
    assert tok.vocab_size == 60 and tok.eos_id == 1
    assert tok.decode(tok.encode("the lazy dog")) == "the lazy dog"
    assert json.loads((run["dir"] / "summary.json").read_text())["steps"] == 4


@pytest.mark.slow
def test_export_of_a_run_loads_in_transformers_with_its_tokenizer(run, exported):
    from train.checkpoint import read_params
    from train.rundir import RunDir

    cfg = RunDir(run["dir"]).model_config()
    step, params = read_params(run["dir"])
    assert step == 4
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 11))
    close(hf_logits(exported, tokens), models.forward(cfg, params, jnp.asarray(tokens)))

    # The run's ids, no EOS appended (the store's EOS after a document is its packing, not the text's).
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(exported))
    ours = SentencePieceTokenizer(run["tokenizer"])
    for text in ["the quick brown fox 12 jumps", "lazy dog\nover  two lines\n\n", "  unseen é ﬁ 😀\t", ""]:
        assert hf_tok.encode(text) == hf_tok(text)["input_ids"] == ours.encode(text), text
    assert (hf_tok.eos_token_id, hf_tok.bos_token_id) == (1, None)
    # The model's own pad (id 0), the one its config.json names, not EOS in its place.
    assert hf_tok.pad_token_id == 0 == json.loads((exported / "config.json").read_text())["pad_token_id"]
    assert hf_tok.model_max_length == cfg.max_position_embeddings  # the model's limit, not seq_len
    generation = json.loads((exported / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 1 and generation["pad_token_id"] == 0
    provenance = json.loads((exported / "training_run.json").read_text())
    seq_len = yaml.safe_load((run["dir"] / "config.yaml").read_text())["train"]["seq_len"]
    assert provenance["step"] == 4 and provenance["seq_len"] == seq_len, provenance
    # A model card saying how to load both: the tokenizer from the directory itself.
    card = (exported / "README.md").read_text()
    assert "at step 4" in card and 'AutoTokenizer.from_pretrained("DIR")' in card, card


@pytest.mark.slow
def test_an_export_over_a_model_repository_keeps_its_readme(run, exported, tmp_path):
    """``--overwrite`` into a directory whose README.md is the user's (a model repository's card)
    keeps it; an earlier export's card is written anew."""
    out = tmp_path / "repo"
    out.mkdir()
    (out / "README.md").write_text("# my model\n\nmy own card\n")
    argv = ["--run-dir", str(run["dir"]), "--out", str(out), "--overwrite"]
    assert exporting.main(argv) == 0
    assert (out / "README.md").read_text() == "# my model\n\nmy own card\n"
    (out / "README.md").write_text((exported / "README.md").read_text().replace("at step 4", "at step 2"))
    assert exporting.main(argv) == 0
    assert (out / "README.md").read_text() == (exported / "README.md").read_text()


@pytest.mark.slow
def test_export_takes_an_older_step_and_refuses_bad_requests(run, exported, capsys):
    from train.checkpoint import read_params

    older = run["root"] / "hf2"
    assert exporting.main(["--run-dir", str(run["dir"]), "--step", "2", "--out", str(older)]) == 0
    _, params = read_params(run["dir"], 2)
    loaded = models.load_hf_params(older, models.read_hf_config(older))
    np.testing.assert_array_equal(np.asarray(loaded["norm"]["scale"]), np.asarray(params["norm"]["scale"]))
    # --overwrite of a sharded export by a one-file one leaves no stale index or shard behind
    shards = ["--run-dir", str(run["dir"]), "--out", str(older), "--overwrite"]
    assert exporting.main([*shards, "--max-shard-gb", "0.0001"]) == 0
    assert (older / "model.safetensors.index.json").is_file()
    (older / "added_tokens.json").write_text('{"<x>": 60}')  # an earlier export's tokenizer file
    assert exporting.main(shards) == 0
    assert sorted(p.name for p in older.glob("*.safetensors*")) == ["model.safetensors"]
    assert not (older / "added_tokens.json").exists() and (older / "tokenizer.json").is_file()
    # a run dir from before runs wrote model.json: the model is rebuilt from config.yaml
    import shutil

    from train.rundir import RunDir

    legacy = run["root"] / "legacy"
    shutil.copytree(run["dir"], legacy)
    (legacy / "model.json").unlink()
    assert RunDir(legacy).model_config() == RunDir(run["dir"]).model_config()
    capsys.readouterr()
    afile, dangling = run["root"] / "afile", run["root"] / "dangling"
    afile.write_text("")
    dangling.symlink_to(run["root"] / "nowhere")
    for argv, message in [
        (["--out", str(exported)], "exists and is not empty"),
        (["--out", str(run["root"] / "x"), "--step", "3"], "no checkpoint of step 3"),
        (["--out", str(run["root"] / "y"), "--tokenizer", "bytes"], "trained with sentencepiece sp.model"),
        (
            ["--out", str(run["root"] / "z"), "--max-shard-gb", "0"],
            "--max-shard-gb must be a positive number, got 0.0",
        ),
        (["--out", str(run["root"] / "z"), "--max-shard-gb", "inf"], "must be a positive number, got inf"),
        # a file where the directory would be, or above it: one line (it was a traceback)
        (["--out", str(afile), "--overwrite"], f"--out {afile}: {afile} is not a directory"),
        (["--out", str(afile / "x")], f"--out {afile / 'x'}: {afile} is not a directory"),
        (["--out", str(dangling)], f"--out {dangling}: {dangling} is not a directory"),
        (
            ["--out", str(run["root"] / "t"), "--tokenizer", str(run["dir"] / "config.yaml")],
            "--tokenizer: " + str(run["dir"] / "config.yaml") + " is not a sentencepiece",
        ),
        (
            ["--out", str(run["root"] / "t"), "--tokenizer", str(run["root"] / "nope.model")],
            "error: --tokenizer: " + str(run["root"] / "nope.model") + ": no such file or directory",
        ),
        # a place no directory can be made, a run dir that is not there: one line (tracebacks)
        (["--out", "/proc/export"], "--out /proc/export: cannot create it ("),
        (["--out", str(run["root"] / "x"), "--run-dir", "nowhere"], "run dir nowhere: no such directory"),
    ]:
        assert exporting.main(["--run-dir", str(run["dir"]), *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err


@pytest.mark.slow
def test_a_model_json_that_is_not_the_checkpoints_is_refused_before_reading(run, capsys):
    """A run dir whose model.json no longer describes its checkpoint's parameters (edited, or
    another run's): export and evaluate name the first parameter and both shapes in one line,
    where export wrote a config.json that did not fit its weights and evaluate raised Flax's
    error. A --seq-len of 0 is refused, where it fell back to the run's."""
    import shutil

    edited = run["root"] / "edited"
    shutil.copytree(run["dir"], edited)
    described = json.loads((edited / "model.json").read_text())
    described["intermediate_size"] += 16
    (edited / "model.json").write_text(json.dumps(described))
    text = run["root"] / "doc.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    message = f"checkpoint {edited / 'checkpoints'}"
    for command, argv in [
        (exporting.main, ["--run-dir", str(edited), "--out", str(run["root"] / "edited-hf")]),
        (
            evaluation.main,
            ["--run-dir", str(edited), "--ppl-files", f"doc={text}", "--out", str(edited / "e")],
        ),
    ]:
        assert command(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err
        assert (
            "does not hold the parameters its run dir describes (model.json, or config.yaml without one)"
            in err
        ), err
        assert not (run["root"] / "edited-hf").exists()
    argv = ["--run-dir", str(run["dir"]), "--ppl-files", f"doc={text}", "--seq-len", "0"]
    assert evaluation.main([*argv, "--out", str(run["root"] / "e0")]) == 2
    assert "--seq-len must be in [1, " in capsys.readouterr().err


@pytest.mark.parametrize(
    "model_type, settings",
    [
        ("bpe", {}),
        # Llama 2's tokenizer.model: byte fallback, digits apart, whitespace-only pieces, no normalisation
        (
            "bpe",
            dict(
                byte_fallback=True,
                split_digits=True,
                allow_whitespace_only_pieces=True,
                remove_extra_whitespaces=False,
                normalization_rule_name="identity",
            ),
        ),
        ("unigram", dict(byte_fallback=True, split_digits=True, allow_whitespace_only_pieces=True)),
    ],
    ids=["bpe", "bpe-llama2", "unigram-llama2"],
)
def test_sentencepiece_models_export_to_a_tokenizer_that_encodes_alike(model_type, settings, tmp_path):
    """A sentencepiece BPE or unigram model trained here on English text: ``AutoTokenizer`` on the
    exported files encodes held-out documents, runs of spaces, digits, unknown characters and the
    export's probes as sentencepiece does (a unigram model: but for segmentations that tie)."""
    from train.sources import builtin_documents

    docs = builtin_documents()
    texts = [d.replace("\n", " ") for d in docs[:60]]
    settings = {"character_coverage": 0.999, **settings}
    model = train_sentencepiece(tmp_path / "sp", model_type, texts, vocab_size=1000, **settings)
    ours = SentencePieceTokenizer(str(model))
    out = tmp_path / "out"
    out.mkdir()
    files, note = exporting.write_tokenizer(ours, out, 1 << 20)
    assert files == ["spiece.model", "tokenizer.json", "tokenizer_config.json"], note
    hf = transformers.AutoTokenizer.from_pretrained(str(out))
    texts = docs[60:] + list(sources.PROBES)
    texts += [
        "    four spaces  two\t\ttabs ",
        "1234567890 3,000,000 x86 a1b2",
        "\u65e5\u672c \u2603\u2603 \u2708",
    ]
    unknown = ties = 0
    for text in texts:
        want, got = ours.encode(text), hf.encode(text)
        unknown += want.count(2)
        if model_type == "unigram" and got != want:
            # Two segmentations of (nearly) the same score: sentencepiece sums in float32 over the
            # whole text, so rounding decides; any other difference fails.
            score = ours.processor.get_score
            a, b = (sum(float(score(i)) for i in ids) for ids in (want, got))
            assert abs(a - b) <= 1e-6 * abs(a) + 1e-3, text[:80]
            ties += 1
            continue
        assert got == want, text[:80]
    assert ties <= 2
    merged = [t for t in ours.encode(" ".join(docs[60:])) if len(ours.processor.id_to_piece(t)) > 2]
    assert len(merged) > 1000  # the merges were exercised, not only single characters
    if not settings.get("byte_fallback"):
        assert unknown > 0  # and runs of unknown characters, as UNK


def test_export_keeps_no_tokenizer_that_would_encode_otherwise(tmp_path, monkeypatch):
    """A sentencepiece model of another kind (here ``char``) or with unused pieces is not
    converted; and tokenizer files with which ``AutoTokenizer`` would encode otherwise than the
    run (here T5Tokenizer's config, which appends EOS) are removed, the note naming the text that
    differs."""
    for kind in ("char", "unigram"):
        train_sentencepiece(tmp_path / kind, kind)
    out = tmp_path / "out"
    out.mkdir()
    files, note = exporting.write_tokenizer(SentencePieceTokenizer(str(tmp_path / "char.model")), out, 32)
    assert (
        files == []
        and "only sentencepiece unigram and BPE models are converted" in note
        and not any(out.iterdir())
    )
    # an unused piece (sentencepiece merges through it, then splits it again)
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString((tmp_path / "unigram.model").read_bytes())
    proto.pieces[10].type = proto.pieces[10].UNUSED
    (tmp_path / "unused.model").write_bytes(proto.SerializeToString())
    files, note = exporting.write_tokenizer(SentencePieceTokenizer(str(tmp_path / "unused.model")), out, 32)
    assert files == [] and "uses unused pieces, which are not converted" in note and not any(out.iterdir())

    def t5_tokenizer(tok, directory, max_length):  # the export before issue 23
        (directory / "spiece.model").write_bytes(tok.path.read_bytes())
        config = {"tokenizer_class": "T5Tokenizer", "extra_ids": 0, "eos_token": "</s>"}
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
        return ["spiece.model", "tokenizer_config.json"], ""

    monkeypatch.setattr(exporting, "_write_sentencepiece", t5_tokenizer)
    files, note = exporting.write_tokenizer(SentencePieceTokenizer(str(tmp_path / "unigram.model")), out, 32)
    assert files == [] and note.startswith(f"none written (transformers would encode {sources.PROBES[0]!r}")
    assert not any(out.iterdir())


@pytest.mark.slow
def test_init_from_starts_the_run_from_the_exported_weights(run, exported):
    """The first step's loss is the exported model's loss on the first batch (computed here by
    transformers), and the run's model is the directory's."""
    from train.config import load_config
    from train.data import build_data

    new = run["root"] / "continued"
    sets = [*run["sets"], "train.steps=1", "train.eval_every=1", f"model.init_from={exported}"]
    run_cli(new, *sets)
    first = json.loads((new / "metrics.jsonl").read_text().splitlines()[0])
    cfg = load_config(str(ROOT / "configs" / "tiny.yaml"), sets)
    data = build_data(cfg.data, cfg.train.seq_len, quiet=True)
    batch = data.read_train(next(data.train_indices(cfg.train.batch_size, cfg.train.seed)))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(exported))
    inputs, targets = (torch.from_numpy(x.astype(np.int64)) for x in (batch[:, :-1], batch[:, 1:]))
    with torch.no_grad():
        logits = model(inputs).logits.double()
    want = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    assert first["step"] == 1 and first["loss"] == pytest.approx(want, rel=1e-5)
    assert json.loads((new / "model.json").read_text())["name"] == exported.name


@pytest.mark.slow
def test_a_run_from_init_from_resumes_without_its_directory(run, exported, tmp_path):
    """A resume continues from the checkpoint, not from ``init_from``: with the directory moved
    away since (it was read again, and the resume refused), the run goes on from its model.json
    to its end; a new run from the moved path is refused in one line."""
    import shutil

    source = tmp_path / "source"
    shutil.copytree(exported, source)
    sets = [*run["sets"], f"model.init_from={source}", "checkpoint.every=2", "train.eval_every=2"]
    run_cli(tmp_path / "r", *sets, "train.steps=2")
    built = (tmp_path / "r" / "model.json").read_text()
    shutil.move(source, tmp_path / "moved")
    run_cli(tmp_path / "r", *sets, "train.steps=4", extra=["--resume"])
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 4, summary
    assert (tmp_path / "r" / "model.json").read_text() == built
    steps = [r["step"] for r in read_metrics(tmp_path / "r" / "metrics.jsonl") if "loss" in r]
    assert steps == sorted(set(steps)) and steps[-1] == 4, steps  # each step once, to the end
    fresh = run_cli(tmp_path / "fresh", *sets, "train.steps=2", check=False)
    assert fresh.returncode == 2 and f"model.init_from: {source} is not a directory" in fresh.stderr
    # A run dir without model.json (made before runs wrote one) has its model in the directory
    # only: another one is refused, where its config would have been read as the run's model.
    (tmp_path / "r" / "model.json").unlink()
    other = [*run["sets"], f"model.init_from={tmp_path / 'moved'}", "checkpoint.every=2"]
    old = run_cli(tmp_path / "r", *other, "train.steps=6", extra=["--resume"], check=False)
    assert old.returncode == 2 and "holds no model.json to take the model from" in old.stderr, old.stderr


@pytest.mark.slow
def test_init_from_mismatches_are_one_line_errors(run, exported, tmp_path):
    from train.config import load_config
    from train.model import model_config

    base = [f"model.init_from={exported}", "model.name=null"]

    def error(*sets, vocab=60):
        cfg = load_config(str(ROOT / "configs" / "tiny.yaml"), [*base, *sets])
        with pytest.raises(UserError) as e:
            model_config(cfg, vocab)
        return str(e.value)

    text = error("model.overrides={hidden_size: 128, num_hidden_layers: 2}")
    assert "hidden_size 128 in the config, 64 in" in text and "num_hidden_layers" not in text
    assert "model_type 'qwen3' in the config, 'llama' in" in error("model.name=qwen3-tiny")
    assert "the tokenizer has 70000 ids" in error(vocab=70000)
    assert "is not a directory" in error(f"model.init_from={tmp_path / 'none'}")
    # Through the CLI: exit 2, one line, no run dir files; a missing weights file is named.
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in ("config.json", "generation_config.json"):
        (broken / f).write_text((exported / f).read_text())
    proc = run_cli(tmp_path / "r", *run["sets"], f"model.init_from={broken}", "model.name=null", check=False)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and "holds no model.safetensors" in err and len(err.splitlines()) == 1, err


def test_init_from_is_checked_before_any_data_work_and_warns_of_byte_ids(
    run, exported, tmp_path, monkeypatch
):
    """A tokenizer with more ids than the model's vocabulary, or a weight file missing, was said
    only once the whole token store was built; a model with its own tokenizer trained on byte ids
    without a word."""
    import shutil
    import warnings

    from train import setup as setting
    from train.config import load_config

    monkeypatch.setattr(setting, "build_data", lambda *a, **k: pytest.fail("the data was built first"))
    tiny = str(ROOT / "configs" / "tiny.yaml")

    def setup(*sets):
        cfg = load_config(tiny, ["model.name=null", *sets])
        return setting.make_setup(cfg, quiet=True, clock=setting.Clock())

    big = tmp_path / "big.model"
    train_sentencepiece(tmp_path / "big", vocab_size=64)
    with pytest.raises(
        UserError, match=r"the tokenizer has 64 ids but the model in .* has a vocabulary of 60"
    ):
        setup(f"model.init_from={exported}", f"data.tokenizer={big}")
    gone = tmp_path / "gone"
    shutil.copytree(exported, gone)
    (gone / "model.safetensors").unlink()
    with pytest.raises(UserError, match=r"model.init_from: .*/gone holds no model.safetensors"):
        setup(f"model.init_from={gone}", f"data.tokenizer={run['tokenizer']}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(UserError, match="the tokenizer has 257 ids but the model"):
            setup(f"model.init_from={exported}")  # data.tokenizer: bytes
    (message,) = [str(w.message) for w in caught if "init_from" in str(w.message)]
    assert message.startswith(f"model.init_from {exported} has its own tokenizer (tokenizer.json), but ")
    assert message.endswith(f"set data.tokenizer={exported}")
    # fewer positions than train.seq_len: said before the data too (the export keeps the run's)
    positions = json.loads((exported / "config.json").read_text())["max_position_embeddings"]
    tokenizer = f"data.tokenizer={run['tokenizer']}"
    with pytest.raises(UserError, match=rf"train.seq_len \({2 * positions}\) exceeds the model's"):
        setup(f"model.init_from={exported}", tokenizer, f"train.seq_len={2 * positions}")


SHARDED_LOAD = textwrap.dedent("""
    import sys, jax, numpy as np
    import models
    from train.config import MeshSection
    from train.sharding import make_mesh, param_shardings
    assert jax.device_count() == 8
    cfg = models.get_config("llama3.2-tiny", scan_layers=True)
    params = models.init_params(cfg, jax.random.PRNGKey(0))
    models.write_hf_dir(sys.argv[1], cfg, params, max_shard_bytes=50_000)
    mesh = make_mesh(MeshSection(data=2, fsdp=2, tensor=2))
    shardings = param_shardings(models.logical_axes(cfg), models.abstract_params(cfg), mesh)
    loaded = models.load_hf_params(sys.argv[1], cfg, shardings)
    for (path, x), want, s in zip(jax.tree_util.tree_leaves_with_path(loaded), jax.tree.leaves(params),
                                  jax.tree.leaves(shardings)):
        assert x.sharding == s, (path, x.sharding, s)
        for shard in x.addressable_shards:  # each device holds its block only, with the right values
            assert shard.data.shape == s.shard_shape(x.shape)
            np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(want)[shard.index])
    assert sum(not s.is_fully_replicated for s in jax.tree.leaves(shardings)) >= 8
    print("OK")
""")


@pytest.mark.slow
def test_sharded_loading_puts_each_block_on_its_device(tmp_path):
    env = cpu_devices(8)
    proc = subprocess.run(
        [sys.executable, "-c", SHARDED_LOAD, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-4000:]


# ------------------------------------------------------------------------------- train.evaluate


TASK = [
    {"context": "the quick brown", "choices": ["fox", "dog jumps"], "label": 0},
    {"context": "over the lazy ", "choices": ["dog", "fox 7"], "label": 1},  # trailing space moves
    {"context": "", "choices": ["the", "lazy dog"], "label": 0},  # empty context: EOS
]


def write_task(path):
    path.write_text("\n".join(json.dumps(x) for x in TASK) + "\n")
    return path


def test_a_diverged_models_text_perplexity_is_capped_as_the_training_curves(tmp_path):
    """A loss past ``log(float max)`` (about 709 nats a token) overflowed ``exp`` after every window
    was scored, and the evaluation was lost; it is capped at ``exp(50)``, as in metrics.jsonl."""
    from train.metrics import perplexity
    from train.sources import make_tokenizer

    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox. " * 20)

    class Diverged:
        max_len = 33

        def score(self, rows):
            return np.array([-800.0 * w.sum() for _, w in rows])

    got = evaluation.text_perplexity(Diverged(), [str(text)], make_tokenizer("bytes"))
    assert got["loss"] == pytest.approx(800.0) and got["ppl"] == perplexity(800.0) == pytest.approx(
        np.exp(50)
    )


@pytest.mark.parametrize("batch_size", [4, 1])
def test_evaluate_matches_hand_computed_scores(tmp_path, batch_size):
    """A tiny model and the byte tokenizer: each choice's log-likelihood and the perplexity of a
    text file (per token, byte and word), computed here from the logits with the rules spelled
    out. At batch size 1 more batches are in flight than ``Scorer`` reads back at once: each score
    still lands on its row."""
    cfg = models.get_config("llama2-tiny")
    params = random_params(cfg, seed=3)
    write_hf_dir(tmp_path / "m", cfg, params)
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 3)
    argv = ["--hf", str(tmp_path / "m"), "--tokenizer", "bytes", "--seq-len", "32"]
    argv += ["--batch-size", str(batch_size)]
    argv += ["--ppl-files", f"fox={text}", "--tasks", f"toy={write_task(tmp_path / 'toy.jsonl')}"]
    assert evaluation.main([*argv, "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "eval.json").read_text())

    forward = jax.jit(lambda t: models.forward(cfg, params, t))

    def logp(tokens):
        # The model is causal: the logits of a prefix are those of the same tokens padded.
        padded = np.zeros((1, 48), np.int32)
        padded[0, : len(tokens) - 1] = tokens[:-1]
        logits = np.asarray(forward(padded), np.float64)[0, : len(tokens) - 1]
        logits -= logits.max(-1, keepdims=True)
        logprobs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        return logprobs[np.arange(len(tokens) - 1), tokens[1:]]

    b = lambda s: list(s.encode())  # noqa: E731
    cases = [
        [(b("the quick brown"), b(" fox")), (b("the quick brown"), b(" dog jumps"))],
        [(b("over the lazy"), b("  dog")), (b("over the lazy"), b("  fox 7"))],
        [([256], b(" the")), ([256], b(" lazy dog"))],
    ]
    scores = [json.loads(line) for line in (tmp_path / "out" / "scores-toy.jsonl").read_text().splitlines()]
    for example, pairs, got in zip(TASK, cases, scores, strict=True):
        want = [logp(c + k)[-len(k) :].sum() for c, k in pairs]
        np.testing.assert_allclose(got["loglikelihoods"], want, rtol=1e-5)
        assert got["pred"] == int(np.argmax(want))
        lengths = [len(c) for c in example["choices"]]  # acc_norm: per character of the choice
        assert got["pred_norm"] == int(np.argmax(np.asarray(want) / lengths))
    hits = [s["pred"] == s["label"] for s in scores]
    assert report["tasks"]["toy"]["acc"] == pytest.approx(np.mean(hits))

    stream = b(text.read_text()) + [256]
    windows = [stream[i : i + 33] for i in range(0, len(stream), 33)]
    total = sum(logp(w).sum() for w in windows if len(w) >= 2)
    count = sum(len(w) - 1 for w in windows if len(w) >= 2)
    assert report["perplexity"]["fox"]["tokens"] == count
    assert report["perplexity"]["fox"]["ppl"] == pytest.approx(np.exp(-total / count), rel=1e-5)
    # Per byte and per word of the text (what models of other tokenizers compare on).
    # The text's whole loss (its 136 tokens, EOS included, at the mean of the 131 scored: the first
    # of each window is not) per byte and per word of it.
    # Words as lm-evaluation-harness counts them (re.split on whitespace: the trailing space adds one).
    fox, words = report["perplexity"]["fox"], len(re.split(r"\s+", text.read_text()))
    assert (fox["bytes"], fox["words"]) == (len(text.read_bytes()), words) == (135, 28), fox
    assert fox["text_tokens"] == len(stream) == 136 and count == 131
    nll = -total / count * 136
    assert fox["bits_per_byte"] == pytest.approx(nll / 135 / np.log(2), rel=1e-5)
    assert fox["byte_perplexity"] == pytest.approx(np.exp(nll / 135), rel=1e-5)
    assert fox["word_perplexity"] == pytest.approx(np.exp(nll / 28), rel=1e-5)


@pytest.mark.slow
def test_evaluate_agrees_with_transformers(run, exported, tmp_path):
    """The exported run scored by train.evaluate --hf and by transformers with its own
    tokenizer, lm-evaluation-harness' way (context and pair encoded, the context cut off)."""
    task = write_task(tmp_path / "toy.jsonl")
    out = tmp_path / "out"
    argv = ["--hf", str(exported), "--seq-len", "32", "--tasks", f"toy={task}", "--out", str(out)]
    assert evaluation.main(argv) == 0
    scores = [json.loads(line) for line in (out / "scores-toy.jsonl").read_text().splitlines()]
    tok = transformers.AutoTokenizer.from_pretrained(str(exported))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(exported)).eval()

    def encode(s):
        return tok(s, add_special_tokens=False)["input_ids"]

    for example, got in zip(TASK, scores, strict=True):
        for choice, ll in zip(example["choices"], got["loglikelihoods"], strict=True):
            context, continuation = example["context"], " " + choice
            if context:
                spaces = len(context) - len(context.rstrip())
                if spaces:
                    context, continuation = context[:-spaces], context[-spaces:] + continuation
                ctx = encode(context)  # the harness: the context alone, the pair whole
                cont = encode(context + continuation)[len(ctx) :]
            else:
                ctx, cont = [tok.eos_token_id], encode(continuation)
            ids = torch.tensor([ctx + cont])
            with torch.no_grad():
                logprobs = torch.log_softmax(model(ids[:, :-1]).logits.double(), -1)[0]
            want = logprobs[-len(cont) :].gather(-1, ids[0, -len(cont) :, None]).sum().item()
            assert ll == pytest.approx(want, rel=1e-4)

    # and a run dir evaluates as its export does
    argv = ["--run-dir", str(run["dir"]), "--tasks", f"toy={task}", "--out", str(tmp_path / "run")]
    assert evaluation.main(argv) == 0
    again = [json.loads(line) for line in (tmp_path / "run" / "scores-toy.jsonl").read_text().splitlines()]
    for a, b in zip(scores, again, strict=True):
        np.testing.assert_allclose(a["loglikelihoods"], b["loglikelihoods"], rtol=1e-5)
    # Without --seq-len an export is scored at its run's length (training_run.json), as the run
    # dir is, not at the model's position limit.
    argv = ["--hf", str(exported), "--tasks", f"toy={task}", "--out", str(tmp_path / "hf-default")]
    assert evaluation.main(argv) == 0
    trained = json.loads((exported / "training_run.json").read_text())["seq_len"]
    lengths = [json.loads((tmp_path / d / "eval.json").read_text())["seq_len"] for d in ("hf-default", "run")]
    assert (
        lengths == [trained, trained]
        and trained < json.loads((exported / "config.json").read_text())["max_position_embeddings"]
    )


def test_evaluate_hf_reads_a_sentencepiece_only_directory_as_auto_tokenizer_does(tmp_path):
    """A Llama 2 style directory (``tokenizer.model`` and a ``LlamaTokenizer`` config, no
    ``tokenizer.json``): ``train.evaluate --hf`` encodes with BOS first, as ``AutoTokenizer`` (and
    so lm-evaluation-harness) does; without a config the sentencepiece model is read as it is."""
    from train.evaluate import _hf_tokenizer, encode_pair

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([f"the quick brown fox {i} jumps over the lazy dog" for i in range(300)]),
        model_prefix=str(tmp_path / "tokenizer"),
        vocab_size=60,
        model_type="bpe",
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
    )
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,  # as in Llama 2's own tokenizer_config.json
        "add_eos_token": False,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, hf = _hf_tokenizer(tmp_path, None), transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in ["the quick fox", " lazy dog 7", "dog\njumps", ""]:
        assert ours.encode(text) == hf.encode(text), text
    assert ours.encode("the fox")[0] == ours.bos_id == 1
    assert encode_pair(ours, "the quick", " fox") == (
        [1, *hf.encode("the quick")[1:]],
        hf.encode("the quick fox")[len(hf.encode("the quick")) :],
    )
    (tmp_path / "tokenizer_config.json").unlink()
    bare = _hf_tokenizer(tmp_path, None)
    assert bare.bos_id is None and bare.encode("the fox") == hf.encode("the fox")[1:]


def test_evaluate_counts_skipped_records_and_keeps_an_earlier_evaluation(run, tmp_path, capsys):
    """Records that hold no text are skipped and counted, as a token store counts them (they were
    dropped unsaid); an evaluation already in ``--out`` stays unless ``--overwrite`` (a second
    evaluation replaced the first and left its per-example scores beside the new report)."""
    texts = [json.dumps({"text": f"the quick brown fox {i} is lazy"}) for i in range(20)]
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("\n".join([*texts[:10], '{"text": "cut sh', '{"title": "no text"}', *texts[10:]]) + "\n")
    task = lm_harness.write_task(tmp_path / "toy.jsonl")
    out, base = tmp_path / "eval", ["--run-dir", str(run["dir"]), "--out", str(tmp_path / "eval")]
    capsys.readouterr()
    assert evaluation.main([*base, "--tasks", f"{NAME}={task}"]) == 0
    assert evaluation.main([*base, "--ppl-files", f"mixed={mixed}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {out} holds an evaluation (eval.json); choose another --out or pass --overwrite"
    assert json.loads((out / "eval.json").read_text())["tasks"]  # the first one, kept
    assert evaluation.main([*base, "--ppl-files", f"mixed={mixed}", "--overwrite"]) == 0
    report = json.loads((out / "eval.json").read_text())
    assert report["perplexity"]["mixed"]["documents"] == 20 and not report["tasks"]
    assert report["perplexity"]["mixed"]["skipped"] == {"broken_json": 1, "missing_text": 1}
    said = "mixed: 2 input records skipped: {'broken_json': 1, 'missing_text': 1}"
    assert said in capsys.readouterr().out and said in (out / "eval.md").read_text()
    assert not list(out.glob("scores-*.jsonl"))


def test_named_files_take_the_name_before_the_first_equals_sign():
    """``--ppl-files``/``--tasks`` items: a path may hold ``=`` (a partitioned data dir,
    ``lang=en/``), which the name used to run up to."""
    parse = lambda text: evaluation.parse_named(text, "--ppl-files")  # noqa: E731
    assert parse("r=/d/lang=en/r.txt") == {"r": ["/d/lang=en/r.txt"]}
    assert parse("/d/r.txt") == {"r": ["/d/r.txt"]}
    assert parse("web=a.txt+/d/x=1/b.txt,wiki.val.txt") == {
        "web": ["a.txt", "/d/x=1/b.txt"],
        "wiki": ["wiki.val.txt"],
    }
    with pytest.raises(UserError, match=r"--ppl-files: name 'a b' must be letters, digits"):
        parse("a b=x.txt")
    with pytest.raises(
        UserError, match=r"name '/d/lang' must be .* \(a path with '=' in it needs a name: NAME=PATH\)"
    ):
        parse("/d/lang=en/r.txt")
    with pytest.raises(UserError, match=r"--ppl-files: 'r=' names no file"):
        parse("r=")


def test_evaluate_errors_name_the_problem(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps(TASK[0]) + "\n" + json.dumps({"context": "x", "choices": ["a", "b"], "label": 2})
    )
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"context": "caf\u00e9"}'.encode("latin-1"))
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps(t) + "\n" for t in TASK))
    for argv, message in [
        # before the model loads (a traceback at the end before)
        (
            ["--hf", str(tmp_path), "--tasks", f"g={good}", "--out", str(bad)],
            f"--out {bad}: {bad} is not a directory",
        ),
        (["--hf", str(tmp_path), "--tasks", f"bad={bad}"], f"{bad}:2: 'label' must be the index"),
        (["--hf", str(tmp_path)], "nothing to evaluate"),
        (["--tasks", f"bad={bad}"], "give one of --run-dir and --hf"),
        (["--hf", str(tmp_path), "--ppl-files", "x=nope.txt"], "holds no config.json"),
        (["--hf", str(tmp_path), "--tasks", f"bad={bad}", "--batch-size", "0"], "--batch-size must be >= 1"),
        (["--hf", str(tmp_path), "--tasks", f"a/b={bad}"], "name 'a/b' must be letters"),
        (["--hf", str(tmp_path), "--tasks", f"latin={latin}"], "is not UTF-8 text"),
        (["--hf", str(tmp_path), "--tasks", f"t={bad},t={latin}"], "the name 't' is given twice"),
        # '+' joins texts, not tasks: offered for --ppl-files only
        (
            ["--hf", str(tmp_path), "--ppl-files", f"t={good},t={good}"],
            "given twice (join files under one name with '+')",
        ),
        (
            ["--hf", str(tmp_path), "--tasks", f"{bad},{tmp_path / 'bad.txt'}"],
            "the name 'bad' is given twice",
        ),
        (
            ["--hf", str(tmp_path), "--tasks", f"bad={bad}", "--step", "5"],
            "--step picks a checkpoint of --run-dir",
        ),
    ]:
        assert evaluation.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
        assert "--tasks" not in argv or "'+'" not in err, err
    # A run dir that is not there is said so, and nothing is made in its place (its default --out,
    # eval/ under it, was made first, and the error named missing files).
    typo = tmp_path / "typo"
    assert evaluation.main(["--run-dir", str(typo), "--ppl-files", f"t={good}"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"run dir {typo}: no such directory" in err and not typo.exists(), err
    # A file given as the run dir, or a directory as a task file, is said to be one.
    assert evaluation.main(["--run-dir", str(good), "--ppl-files", f"t={good}"]) == 2
    assert f"run dir {good}: not a directory" in capsys.readouterr().err
    assert evaluation.main(["--hf", str(tmp_path), "--tasks", f"t={tmp_path}"]) == 2
    assert f"task file {tmp_path} is a directory" in capsys.readouterr().err


# ------------------------------------------------------------------------ lm-evaluation-harness


@pytest.mark.slow
def test_lm_eval_harness_scores_the_export_as_train_evaluate_does(run, exported, tmp_path, monkeypatch):
    """lm-evaluation-harness' ``HFLM`` on the export of a sentencepiece run (whose exported
    tokenizer once appended EOS to every encoding, so the harness scored other tokens than the
    choices'), and ``train.evaluate`` on the export and on the run dir: the same log-likelihood per
    choice (1e-3 nats) and the same accuracies."""
    task = lm_harness.write_task(tmp_path / "toy.jsonl")
    tasks = ["--tasks", f"{NAME}={task}"]
    want = evaluate_scores(["--hf", str(exported), *tasks], tmp_path / "hf")
    assert_same_scores(harness_scores(exported, task, tmp_path / "harness", monkeypatch), want)
    run_dir = ["--run-dir", str(run["dir"]), "--seq-len", "256"]  # the export's length, as the harness'
    assert_same_scores(evaluate_scores([*run_dir, *tasks], tmp_path / "run"), want, tol=1e-4)


@pytest.mark.slow
def test_a_qwen2_export_puts_a_tokenizer_transformers_would_rebuild_apart(run, tmp_path, monkeypatch, capsys):
    """transformers reads a ``qwen2`` directory's tokenizer with ``Qwen2Tokenizer``, which puts
    Qwen's normalizer and pre-tokenizer in place of the file's: the export of a qwen2.5 run on a
    sentencepiece model wrote none and the harness failed (an IndexError). Its files now go to
    ``tokenizer/``, which the harness takes as ``tokenizer=`` and ``train.evaluate --hf`` finds:
    the same scores. Moved up beside ``config.json``, ``train.evaluate --hf`` warns that the
    harness would read them otherwise. The run's ``data.tokenizer`` is relative to where it
    started; export and evaluate find it from another directory (they looked for it there)."""
    shutil.copy(run["tokenizer"], tmp_path / "sp.model")
    relative = os.path.relpath(tmp_path / "sp.model", ROOT)  # the trainer runs from ROOT (run_cli)
    sets = [s for s in run["sets"] if not s.startswith("data.tokenizer=")]
    run_cli(tmp_path / "qwen", *sets, f"data.tokenizer={relative}", "model.name=qwen2.5-tiny")
    monkeypatch.chdir(run["root"])
    out = tmp_path / "hf"
    capsys.readouterr()
    assert exporting.main(["--run-dir", str(tmp_path / "qwen"), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    apart = out / "tokenizer"
    assert f"lm-evaluation-harness takes --model_args pretrained={out},tokenizer={apart}" in said, said
    assert sorted(p.name for p in apart.iterdir()) == [
        "spiece.model",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert not (out / "tokenizer.json").exists()
    # The model card says where the tokenizer is: AutoTokenizer on the directory itself finds no
    # tokenizer files there, and (Qwen2Tokenizer) encodes every text as nothing, with no error.
    card = (out / "README.md").read_text()
    assert (
        'AutoTokenizer.from_pretrained("DIR/tokenizer")' in card
        and "pretrained=DIR,tokenizer=DIR/tokenizer" in card
    )
    assert transformers.AutoTokenizer.from_pretrained(str(out)).encode("hello 12345") == []
    ours, hf = SentencePieceTokenizer(str(tmp_path / "sp.model")), transformers.AutoTokenizer
    for text in ["the quick brown fox 12 jumps", "  lazy\tdog  ", ""]:
        assert hf.from_pretrained(str(apart)).encode(text) == ours.encode(text)
    task = lm_harness.write_task(tmp_path / "toy.jsonl")
    want = evaluate_scores(["--hf", str(out), "--tasks", f"{NAME}={task}"], tmp_path / "ours")
    assert_same_scores(harness_scores(out, task, tmp_path / "harness", monkeypatch, tokenizer=apart), want)
    run_dir = ["--run-dir", str(tmp_path / "qwen"), "--seq-len", "256", "--tasks", f"{NAME}={task}"]
    assert_same_scores(evaluate_scores(run_dir, tmp_path / "run"), want, tol=1e-4)
    # The same files moved up beside config.json: AutoTokenizer (the harness) would rebuild them
    # as Qwen2Tokenizer; evaluate --hf, reading the file, says its scores are not the harness's.
    moved = tmp_path / "moved"
    shutil.copytree(out, moved)
    for f in apart.iterdir():
        shutil.copy(f, moved / f.name)
    shutil.rmtree(moved / "tokenizer")
    argv = ["--hf", str(moved), "--tasks", f"{NAME}={task}", "--out", str(tmp_path / "m")]
    warned = rf"^{re.escape(str(moved))}: transformers.AutoTokenizer, which lm-evaluation-harness"
    with pytest.warns(UserWarning, match=warned):
        assert evaluation.main(argv) == 0
    # data.tokenizer=DIR reads them there too (continued pretraining of the export); an export over
    # DIR would then remove the tokenizer it reads: refused, nothing touched.
    from train.sources import make_tokenizer

    assert make_tokenizer(str(out)).encode("the quick brown fox") == ours.encode("the quick brown fox")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    argv = ["--run-dir", str(tmp_path / "qwen"), "--out", str(out), "--overwrite"]
    capsys.readouterr()
    assert exporting.main([*argv, "--tokenizer", str(apart / "spiece.model")]) == 2
    assert f"--out {out} holds the run's tokenizer ({apart / 'spiece.model'})" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def documented_command(program: str) -> list[str]:
    """``docs/models.md``'s command line that starts with ``program`` (backslash continuations joined)."""
    found = re.search(rf"^{program} (?:.*\\\n)*.*$", (ROOT / "docs" / "models.md").read_text(), flags=re.M)
    assert found, f"docs/models.md has no {program} command"
    return shlex.split(found.group(0).replace("\\\n", " "))


@pytest.mark.slow
def test_the_documented_lm_eval_command_scores_the_export(run, exported, tmp_path):
    """``docs/models.md``'s ``lm_eval`` command as written, its model directory and benchmarks replaced by
    the export and a local task (and ``--device cpu``: no GPU here), agrees with ``train.evaluate``."""
    argv = documented_command("lm_eval")
    for i, arg in enumerate(argv[:-1]):
        if arg == "--tasks":
            argv[i + 1] = NAME
        if arg == "--model_args":
            settings = [a for a in argv[i + 1].split(",") if not a.startswith("pretrained=")]
            argv[i + 1] = ",".join([f"pretrained={exported}", *settings])
    task = lm_harness.write_task(tmp_path / "toy.jsonl")
    got = harness_cli_scores([*argv, "--device", "cpu"], task, tmp_path / "cli", dict(os.environ))
    want = evaluate_scores(["--hf", str(exported), "--tasks", f"{NAME}={task}"], tmp_path / "ours")
    assert_same_scores(got, want)
