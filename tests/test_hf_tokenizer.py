"""Hugging Face ``tokenizer.json`` tokenizers (Llama 3 and Qwen ship byte-level BPE ones) as
``data.tokenizer``: encoding as ``transformers.AutoTokenizer`` does, the token store and its
refusals, a run through the CLI, its export (``AutoTokenizer`` on the exported directory gives the
run's token ids), ``model.init_from`` with the checkpoint's own tokenizer, and ``train.evaluate``
and lm-evaluation-harness on the export. The tokenizers are trained here (no download)."""

import json
import pathlib
import shutil

import numpy as np
import pytest
from lm_harness import NAME, assert_same_scores, evaluate_scores, harness_scores, write_task
from test_train import FAST, run_cli

from train import export as exporting
from train.config import DataSection
from train.errors import UserError
from train.sources import Counts, HFTokenizer, file_documents, file_sha256, is_validation, make_tokenizer
from train.store import open_store

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORDS = "the quick brown fox jumps over a lazy dog while seven tired owls sing of rain".split()
TEXTS = [
    "the quick brown fox",
    "lazy dog\nover  two   lines\n\n\ttabbed",
    "  leading and trailing  ",
    "unseen: café naïve 日本語 😀 ﬁ",
    "a special <|end_of_text|> inside, and <|begin_of_text|> too",
    "",
]


def documents(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    seps = [" ", " ", " ", "  ", "\n", "\n\n", ", "]
    return [
        "".join(str(w) + str(rng.choice(seps)) for w in rng.choice(WORDS, rng.integers(8, 40))) + "é 日本"
        for _ in range(n)
    ]


def build_tokenizer(folder: pathlib.Path, bos: bool, after: tuple | None = None, **config) -> pathlib.Path:
    """A byte-level BPE ``tokenizer.json`` like Llama 3's (``bos``: its post-processor puts
    ``<|begin_of_text|>`` first) or Qwen's (no BOS), and its ``tokenizer_config.json``;
    ``after``: a token and its id that the post-processor puts after every text instead (T5's EOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents(200, seed=1), trainer)
    if after:
        tok.post_processor = processors.TemplateProcessing(
            single=f"$A {after[0]}", pair=f"$A {after[0]} $B:1", special_tokens=[after]
        )
    elif bos:
        begin = ("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A",
            pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
            special_tokens=[begin],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.save(str(folder / "tokenizer.json"))
    base = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|end_of_text|>"}
    base["bos_token"] = "<|begin_of_text|>" if bos else None
    (folder / "tokenizer_config.json").write_text(json.dumps({**base, **config}))
    return folder


@pytest.fixture(scope="module")
def llama_like(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok") / "llama", bos=True)


@pytest.fixture(scope="module")
def qwen_like(tmp_path_factory):
    # A pad token the file lacks: transformers adds it as a new special token, and so does the run.
    return build_tokenizer(tmp_path_factory.mktemp("tok") / "qwen", bos=False, pad_token="<|pad|>")


@pytest.mark.parametrize("model", ["unigram", "wordlevel"])
def test_characters_the_model_has_no_piece_for_are_not_special_text(model, tmp_path):
    """A model's unk (a T5 export's Unigram ``<unk>``, id 2) for characters it has no piece for is
    no special token written in the text: such a document is not counted, one holding the text
    ``<unk>`` or ``</s>`` is."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from train.sources import document_tokens, holds_special_text

    words = ["the", "quick", "fox"]
    if model == "unigram":
        pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [(w, -1.0) for w in words]
        tok = Tokenizer(models.Unigram(pieces, unk_id=2))
    else:
        vocab = {t: i for i, t in enumerate(["<pad>", "</s>", "<unk>", *words])}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    hf = HFTokenizer(str(tmp_path))
    assert hf.unknown == (2, "<unk>")
    texts = ["the quick fox", "the zebra fox", "the <unk> fox", "the fox </s> quick"]
    ids = document_tokens(hf, texts)
    assert 2 in ids[1] and 2 in ids[2]  # the unknown word and the written token: both unk
    said = [holds_special_text(hf, t, i) for t, i in zip(texts, ids, strict=True)]
    assert said == [False, False, True, True]


@pytest.mark.parametrize("kind", ["bos", "no_bos", "eos_after", "split_special_tokens"])
def test_a_special_tokens_text_inside_a_document_is_counted_and_said(kind, tmp_path, capsys):
    """Documents holding a special token's text (encoded as that token, as AutoTokenizer does):
    counted per split in the manifest and said by train.prepare; the tokens the post-processor
    puts around a text (BOS first, T5's EOS after) and the separator EOS are not counted, and
    with ``split_special_tokens`` nothing is."""
    from train import prepare

    after = ("<|end_of_text|>", 1) if kind == "eos_after" else None
    config = {"split_special_tokens": True} if kind == "split_special_tokens" else {}
    folder = build_tokenizer(tmp_path / "tok", bos=kind == "bos", after=after, **config)
    texts = documents(40)
    for i in (3, 17, 30):  # the text of the EOS, of the BOS, and both
        texts[i] = texts[i].replace(
            " ", [" <|end_of_text|> ", " <|begin_of_text|>", "<|end_of_text|><|begin_of_text|>"][i % 3], 1
        )
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    store = tmp_path / "store"
    sets = ["data.source=files", f"data.paths=['{data}']", f"data.tokenizer={folder}", f"data.store={store}"]
    argv = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--workers", "1", "--quiet"]
    assert prepare.main(argv + [x for s in sets for x in ("--set", s)]) == 0
    special = json.loads((store / "manifest.json").read_text())["special_text"]
    fraction = DataSection().validation_fraction
    want = {split: 0 for split in ("train", "validation")}
    for i in (3, 17, 30) if kind != "split_special_tokens" else ():
        want["validation" if is_validation(texts[i], fraction) else "train"] += 1
    assert special == want
    err = capsys.readouterr().err
    if kind == "split_special_tokens":
        assert err == ""
    else:
        where = " and ".join(f"{n} {s}" for s, n in want.items() if n)
        assert err.startswith(f"warning: {where} documents hold the text of a special token"), err


def test_a_store_of_a_tokenizer_json_that_auto_tokenizer_rebuilds_says_so_once(tmp_path, capsys):
    """A ``tokenizer.json`` whose ``tokenizer_config.json`` names a class that rebuilds its rules
    (``Qwen2Tokenizer``: NFC in place of the file's normalizer): the store holds the file's tokens,
    and its build, the trainer's (``open_store``) as ``train.prepare``'s, says AutoTokenizer on
    that directory gives others. Opening the built store again says nothing."""
    folder = build_tokenizer(tmp_path / "tok", bos=False, tokenizer_class="Qwen2Tokenizer")
    tok = make_tokenizer(str(folder))
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert hf.encode("e\u0301") != tok.encode("e\u0301")  # (the premise: it rebuilds otherwise)
    data = tmp_path / "d.jsonl"
    docs = documents(30)
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    section = DataSection(source="files", paths=[str(data)], tokenizer=str(folder), store=str(tmp_path / "s"))
    opened = open_store(section, quiet=True)
    err = capsys.readouterr().err
    said = (
        f"warning: the store holds {folder / 'tokenizer.json'}'s tokens, but transformers.AutoTokenizer "
        f"on {folder} encodes "
    )
    assert err.startswith(said) and err.count("\n") == 1, err
    assert "train.export writes tokenizer files that give the store's" in err
    train = [d for d in docs if not is_validation(d, section.validation_fraction)]
    stream = opened.splits["train"]
    want = [t for d in train for t in [*tok.encode(d), tok.eos_id]]
    np.testing.assert_array_equal(stream.read(0, stream.tokens), want)
    open_store(section, quiet=True)
    assert capsys.readouterr().err == ""


def test_encodes_as_auto_tokenizer_does(llama_like, qwen_like):
    for folder, first in ((llama_like, [0]), (qwen_like, [])):
        ours = make_tokenizer(str(folder))
        assert isinstance(ours, HFTokenizer)
        assert make_tokenizer(str(folder / "tokenizer.json")).identity() == ours.identity()
        hf = transformers.AutoTokenizer.from_pretrained(str(folder))
        for text in TEXTS:
            assert ours.encode(text) == hf.encode(text), text
            assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
            assert ours.encode(text)[: len(first)] == first  # Llama 3's BOS is part of the encoding
        batch = ours.encode_batch(TEXTS)
        assert [list(ids) for ids in batch] == [hf.encode(t) for t in TEXTS]
        assert (ours.eos_id, ours.bos_id, ours.vocab_size) == (hf.eos_token_id, hf.bos_token_id, len(hf))
        assert ours.decode(ours.encode(TEXTS[1], add_special_tokens=False)) == TEXTS[1]
        identity = ours.identity()
        assert identity["kind"] == "hf" and identity["sha256"] == file_sha256(folder / "tokenizer.json")
        assert identity["name"] == f"{folder.name}/tokenizer.json" and identity["eos_id"] == 1
    qwen = make_tokenizer(str(qwen_like))
    assert qwen.vocab_size == 321 and qwen.encode("<|pad|>") == [320]  # the added pad token


SPECIAL_CONFIGS = {
    "extra-dict": {"extra_special_tokens": {"image_token": "<|image_pad|>", "video_token": "<|video|>"}},
    "custom-key": {"image_token": "<|image_pad|>", "add_bos_token": True, "vision_token": None},
    "both-lists": {"additional_special_tokens": ["<|a|>"], "extra_special_tokens": ["<|b|>", "<|c|>"]},
    # what transformers 4.4x save_pretrained writes: the list, and an empty dict beside it
    "list-and-empty-dict": {"additional_special_tokens": ["<|a|>", "<|b|>"], "extra_special_tokens": {}},
    "dict-then-key": {"extra_special_tokens": {"video_token": "<|video|>"}, "image_token": "<|image_pad|>"},
    "one-name-twice": {"image_token": "<|a|>", "extra_special_tokens": {"image_token": "<|b|>"}},
    "explicit": {
        "model_specific_special_tokens": {"audio_token": "<|audio|>"},
        "image_token": {"__type": "AddedToken", "content": "<|image_pad|>", "special": True},
    },
    "explicit-and-key": {
        "image_token": "<|image_pad|>",
        "model_specific_special_tokens": {"audio_token": "<|audio|>"},
    },
}


@pytest.mark.parametrize("config", list(SPECIAL_CONFIGS.values()), ids=list(SPECIAL_CONFIGS))
def test_special_tokens_of_every_config_form_and_a_file_saved_truncating(config, tmp_path):
    """Model-specific special tokens (an ``extra_special_tokens`` dict, other ``*_token`` keys,
    ``model_specific_special_tokens``) get the ids and the whole-token matching transformers 5
    gives them, and a ``tokenizer.json`` saved with truncation and padding on encodes documents
    whole, as ``AutoTokenizer.encode`` does."""
    release = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    if config.get("extra_special_tokens") == {} and release < (5, 23):
        # The oracle itself differed: 5.17 let an empty extra_special_tokens hide the list, 5.23
        # (which train.sources follows, as transformers 4.x did) reads the list.
        pytest.skip(f"transformers {transformers.__version__} drops the list beside an empty dict")
    folder = build_tokenizer(tmp_path / "t", bos=False, **config)
    file = folder / "tokenizer.json"
    saved = json.loads(file.read_text())
    saved["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
    saved["padding"] = {
        "strategy": {"Fixed": 64},
        "direction": "Right",
        "pad_to_multiple_of": None,
        "pad_id": 1,
        "pad_type_id": 0,
        "pad_token": "<|pad|>",  # transformers takes it as the pad token when the config names none
    }
    file.write_text(json.dumps(saved))
    ours = make_tokenizer(str(folder))
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    texts = TEXTS + ["a <|image_pad|> b <|video|><|audio|> <|a|><|b|><|c|> image_token vision_token <|pad|>"]
    for text in texts:
        assert ours.encode(text) == hf.encode(text), text
    assert ours.vocab_size == len(hf)
    assert len(ours.encode(documents(1)[0])) > 8  # no truncation


def test_bad_tokenizer_files_are_one_line_errors(llama_like, tmp_path):
    def error(path) -> str:
        with pytest.raises(UserError) as e:
            make_tokenizer(str(path))
        assert "\n" not in str(e.value)
        return str(e.value)

    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(llama_like / "tokenizer.json", bare)
    assert "no tokenizer_config.json beside it to name the EOS token" in error(bare)
    (bare / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>"}))
    assert 'no EOS token: tokenizer_config.json beside it must name one (e.g. {"eos_token"' in error(bare)
    (bare / "tokenizer_config.json").write_text("{not json")
    assert "tokenizer_config.json is not JSON" in error(bare)
    assert "no tokenizer.json there" in error(tmp_path)
    assert "data.tokenizer is empty" in error("")
    (tmp_path / "other.json").write_text('{"a": 1}')
    assert "is not a tokenizers file" in error(tmp_path / "other.json")
    # BPE dropout: a store built twice would differ (random segmentations).
    dropping = tmp_path / "dropout"
    shutil.copytree(llama_like, dropping)
    spec = json.loads((dropping / "tokenizer.json").read_text())
    spec["model"]["dropout"] = 0.1
    (dropping / "tokenizer.json").write_text(json.dumps(spec))
    assert "its BPE model has dropout 0.1, which segments a text at random" in error(dropping)


def test_token_store_of_a_tokenizer_json_and_its_refusals(llama_like, tmp_path):
    data = tmp_path / "d.jsonl"
    docs = documents(60)
    data.write_text("\n".join(json.dumps({"text": d}) for d in docs) + "\n")
    store = str(tmp_path / "store")
    section = DataSection(source="files", paths=[str(data)], tokenizer=str(llama_like), store=store)
    opened = open_store(section, quiet=True)
    tok = make_tokenizer(str(llama_like))
    assert opened.tokenizer == tok.identity() and opened.manifest["dtype"] == "uint16"
    # each document is its encoding (BOS first) and EOS, in order, in its split
    for split in ("train", "validation"):
        want = [
            t
            for d in file_documents([str(data)], Counts())
            if is_validation(d, section.validation_fraction) == (split == "validation")
            for t in [*tok.encode(d), tok.eos_id]
        ]
        stream = opened.splits[split]
        np.testing.assert_array_equal(stream.read(0, stream.tokens), want)
        assert want[0] == tok.bos_id
    # the same tokenizer named by its file reads the store; another one is refused
    assert open_store(DataSection(source="store", store=store, tokenizer=str(llama_like / "tokenizer.json")))
    with pytest.raises(UserError) as e:
        open_store(DataSection(source="store", store=store, tokenizer="bytes"), quiet=True)
    message = str(e.value)
    assert f"made with tokenizer hf llama/tokenizer.json (sha256 {tok.identity()['sha256'][:12]}" in message
    assert "but data.tokenizer is bytes (vocab 257)" in message and "\n" not in message
    changed = build_tokenizer(tmp_path / "changed", bos=True)
    shutil.copy(llama_like / "tokenizer.json", changed / "tokenizer.json")
    config = json.loads((changed / "tokenizer_config.json").read_text())
    (changed / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|begin_of_text|>"}))
    elsewhere = DataSection(source="store", store=store, tokenizer=str(changed))
    with pytest.raises(UserError, match=r"is hf changed/tokenizer.json .* EOS '<\|begin_of_text"):
        open_store(elsewhere, quiet=True)
    # the same file and EOS, but special tokens split as text (split_special_tokens)
    (changed / "tokenizer_config.json").write_text(json.dumps({**config, "split_special_tokens": True}))
    with pytest.raises(UserError, match=r"settings [0-9a-f]{8}\), but .*-token settings [0-9a-f]{8}\): set "):
        open_store(elsewhere, quiet=True)
    # and so is a files section naming this store with the other tokenizer
    with pytest.raises(UserError, match="made with tokenizer hf llama/tokenizer.json"):
        open_store(DataSection(source="files", paths=[str(data)], tokenizer=str(changed), store=store))


def test_a_post_processor_eos_ends_each_document_once(tmp_path):
    """A ``tokenizer.json`` whose post-processor ends every text with EOS (T5's ``$A </s>``): a
    document in the token store and in ``train.evaluate``'s stream is its encoding, EOS last,
    and no second EOS after it (there were two)."""
    from train.evaluate import token_stream

    folder = build_tokenizer(tmp_path / "t5", bos=False, after=("<|end_of_text|>", 1))
    tok = make_tokenizer(str(folder))
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert tok.encode(TEXTS[0]) == hf.encode(TEXTS[0]) and hf.encode(TEXTS[0])[-1] == tok.eos_id == 1
    assert tok.identity()["settings"]["ends_with_eos"] is True
    data = tmp_path / "d.jsonl"
    docs = documents(40)
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    section = DataSection(source="files", paths=[str(data)], tokenizer=str(folder), store=str(tmp_path / "s"))
    opened = open_store(section, quiet=True)
    for split in ("train", "validation"):
        want = [
            t
            for d in docs
            if is_validation(d, section.validation_fraction) == (split == "validation")
            for t in hf.encode(d)
        ]
        stream = opened.splits[split]
        np.testing.assert_array_equal(stream.read(0, stream.tokens), want)
    stream, count, _ = token_stream([str(data)], tok)
    assert count.documents == len(docs) and list(stream) == [t for d in docs for t in hf.encode(d)]
    assert np.count_nonzero(stream == tok.eos_id) == len(docs)


def test_a_token_id_outside_the_vocabulary_is_refused_at_the_build(tmp_path):
    """A post-processor's token whose id the vocabulary lacks would wrap in the store's uint16."""
    folder = build_tokenizer(tmp_path / "odd", bos=False, after=("<|odd|>", 70000))
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "the quick brown fox"}) + "\n")
    section = DataSection(source="files", paths=[str(data)], tokenizer=str(folder), store=str(tmp_path / "s"))
    with pytest.raises(
        UserError, match=rf"^data.tokenizer gave token id 70000 for a document of {data}, outside"
    ):
        open_store(section, quiet=True)


def test_init_from_takes_a_tokenizer_with_fewer_ids_not_more(llama_like, tmp_path):
    import jax

    import models
    from train.config import load_config
    from train.model import model_config

    tok = make_tokenizer(str(llama_like))
    cfg = models.get_config("llama3.2-tiny", vocab_size=tok.vocab_size + 20)
    models.write_hf_dir(tmp_path / "m", cfg, models.init_params(cfg, jax.random.PRNGKey(0)))
    sets = [f"model.init_from={tmp_path / 'm'}", "model.name=null", "model.overrides={}"]
    run = load_config(str(ROOT / "configs" / "tiny.yaml"), sets)
    assert model_config(run, tok.vocab_size).vocab_size == tok.vocab_size + 20
    with pytest.raises(UserError, match=f"the tokenizer has {tok.vocab_size + 21} ids"):
        model_config(run, tok.vocab_size + 21)


# ------------------------------------------------------------------- a run, its export, init_from


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory, llama_like):
    """A FAST run through the CLI on the Llama-3-like tokenizer (BOS first, EOS after each
    document), exported in float32."""
    root = tmp_path_factory.mktemp("hfrun")
    data = root / "d.jsonl"
    data.write_text("\n".join(json.dumps({"text": d}) for d in documents(300)) + "\n")
    sets = [*FAST, "data.source=files", f"data.paths=['{data}']", f"data.tokenizer={llama_like}"]
    run_cli(root / "run", *sets)
    out = root / "hf"
    assert exporting.main(["--run-dir", str(root / "run"), "--out", str(out)]) == 0
    return {"root": root, "dir": root / "run", "sets": sets, "export": out, "data": data}


@pytest.mark.slow
def test_export_of_a_tokenizer_json_run_encodes_as_the_run_did(hf_run, llama_like):
    """``AutoTokenizer`` on the exported directory gives the token ids the run trained on: its
    documents encoded one by one, each followed by EOS, are the run's token store."""
    from train.config import load_config
    from train.data import build_data

    out = hf_run["export"]
    summary = json.loads((hf_run["dir"] / "summary.json").read_text())
    assert summary["data"]["tokenizer"] == make_tokenizer(str(llama_like)).identity()
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["eos_token"] == "<|end_of_text|>"
    assert (out / "tokenizer.json").read_bytes() == (llama_like / "tokenizer.json").read_bytes()
    hf = transformers.AutoTokenizer.from_pretrained(str(out))
    limit = json.loads((out / "config.json").read_text())["max_position_embeddings"]
    assert hf.model_max_length == limit  # the model's, whatever the source's file said
    cfg = load_config(str(ROOT / "configs" / "tiny.yaml"), hf_run["sets"])
    store = build_data(cfg.data, cfg.train.seq_len, quiet=True).store
    for split in ("train", "validation"):
        want = [
            t
            for d in file_documents([str(hf_run["data"])], Counts())
            if is_validation(d, cfg.data.validation_fraction) == (split == "validation")
            for t in [*hf.encode(d), hf.eos_token_id]
        ]
        stream = store.splits[split]
        np.testing.assert_array_equal(stream.read(0, stream.tokens), want)
    ours = make_tokenizer(str(llama_like))
    for text in TEXTS:
        assert hf.encode(text) == ours.encode(text)
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["bos_token_id"]) == (1, 0)


@pytest.mark.slow
def test_continued_pretraining_of_a_checkpoint_with_its_tokenizer_json(llama_like, tmp_path, capsys):
    """The recipe of ``docs/models.md``: ``model.init_from=DIR`` and ``data.tokenizer=DIR`` on a checkpoint
    whose vocabulary is larger than its tokenizer's; the first step's loss is the checkpoint's
    loss (computed here by transformers) on the first batch of the tokenizer's ids."""
    import jax

    torch = pytest.importorskip("torch")  # transformers computes the reference loss in PyTorch

    import models
    from train.config import load_config
    from train.data import build_data

    tok = make_tokenizer(str(llama_like))
    checkpoint = tmp_path / "checkpoint"
    cfg = models.get_config("llama3.2-tiny", vocab_size=tok.vocab_size + 24)
    models.write_hf_dir(checkpoint, cfg, models.init_params(cfg, jax.random.PRNGKey(1)))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama_like / name, checkpoint / name)
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"text": d}) for d in documents(200)) + "\n")
    sets = [*FAST, "train.steps=1", "train.eval_every=1", "data.source=files", f"data.paths=['{data}']"]
    sets += [f"data.tokenizer={checkpoint}", f"model.init_from={checkpoint}", "model.name=null"]
    sets += ["model.overrides={}"]
    run_cli(tmp_path / "run", *sets)
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    run_cfg = load_config(str(ROOT / "configs" / "tiny.yaml"), sets)
    loaded = build_data(run_cfg.data, run_cfg.train.seq_len, quiet=True)
    batch = loaded.read_train(next(loaded.train_indices(run_cfg.train.batch_size, run_cfg.train.seed)))
    assert batch.max() < tok.vocab_size and (batch == tok.bos_id).any()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint))
    inputs, targets = (torch.from_numpy(x.astype(np.int64)) for x in (batch[:, :-1], batch[:, 1:]))
    with torch.no_grad():
        logits = model(inputs).logits.double()
    want = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    assert first["step"] == 1 and first["loss"] == pytest.approx(want, rel=1e-5)
    assert json.loads((tmp_path / "run" / "model.json").read_text())["vocab_size"] == tok.vocab_size + 24
    # An export over the checkpoint would replace the tokenizer the run reads (it removed it, then
    # failed to copy it: a traceback, and the run's tokenizer gone): refused, nothing touched.
    from train import export as exporting

    before = {p.name: p.read_bytes() for p in checkpoint.iterdir()}
    argv = ["--run-dir", str(tmp_path / "run"), "--out", str(checkpoint), "--overwrite"]
    capsys.readouterr()
    assert exporting.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert f"--out {checkpoint} holds the run's tokenizer ({checkpoint / 'tokenizer.json'})" in err, err
    assert len(err.splitlines()) == 1
    assert {p.name: p.read_bytes() for p in checkpoint.iterdir()} == before


@pytest.mark.slow
def test_harness_and_train_evaluate_score_a_tokenizer_json_export_alike(
    hf_run, llama_like, tmp_path, monkeypatch
):
    """lm-evaluation-harness (``HFLM``, which encodes with the tokenizer's BOS) on the export, and
    ``train.evaluate`` on the export, on the export with ``--tokenizer``, and on the run dir:
    the same log-likelihood per choice (1e-3) and the same accuracies."""
    task = write_task(tmp_path / "toy.jsonl")
    tasks = ["--tasks", f"{NAME}={task}"]
    want = evaluate_scores(["--hf", str(hf_run["export"]), *tasks], tmp_path / "hf")
    assert_same_scores(harness_scores(hf_run["export"], task, tmp_path / "harness", monkeypatch), want)
    for argv, out in [
        (["--run-dir", str(hf_run["dir"]), "--seq-len", "256"], "run"),
        (["--hf", str(hf_run["export"]), "--tokenizer", str(llama_like / "tokenizer.json")], "override"),
    ]:
        assert_same_scores(evaluate_scores([*argv, *tasks], tmp_path / out), want, tol=1e-4)
