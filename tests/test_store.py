"""The token store (``train.store``, ``python -m train.prepare``) and the lazy grain loader over
it (``train.data``): byte-identical builds whatever the interruption or the worker count, reuse,
refusals, skipped records, record ranges of TFDS splits, and the rows each device reads."""

import errno
import gzip
import hashlib
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types

import numpy as np
import pytest
from helpers import HELD_MARKER, alive, cpu_devices, tokenize_holding_a_counter, tokenize_or_die

from train import store as token_store
from train.config import DataSection
from train.data import Data, build_data
from train.errors import EXIT_PEER_LOST, EXIT_PREEMPTED, IOFault, UserError, cli
from train.sources import ByteTokenizer, Counts, file_documents, is_validation, make_tokenizer
from train.store import building, open_store, planning

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORDS = "the quick brown fox jumps over a lazy dog while seven tired owls sing of rain".split()


def write_corpus(directory: pathlib.Path, files: int = 6, docs: int = 40, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for f in range(files):
        path = directory / f"part-{f:02d}.jsonl{'.gz' if f % 2 else ''}"
        lines = [
            json.dumps({"text": " ".join(rng.choice(WORDS, rng.integers(20, 200)))}) for _ in range(docs)
        ]
        data = ("\n".join(lines) + "\n").encode()
        path.write_bytes(gzip.compress(data, mtime=0) if f % 2 else data)
        paths.append(str(path))
    return paths


def tree_hashes(directory: pathlib.Path) -> dict:
    """Every file of a store but its lock, by relative path, with its sha256."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def prepare_cli(*args, env=None, check=True):
    proc = subprocess.run(
        [sys.executable, "-m", "train.prepare", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def files_section(paths, **kw) -> DataSection:
    return DataSection(source="files", paths=list(paths), **kw)


# A prepare that stops in the middle of piece 3 (its first documents read, nothing renamed) and
# touches a marker file: the test then signals it at a known point of the build.
STALL = textwrap.dedent(
    """
    import pathlib, sys, time
    import train.sources as s
    original = s.path_documents
    def stalling(path, counts, start=0, stop=None):
        for i, doc in enumerate(original(path, counts, start, stop)):
            if path.name.startswith("part-03") and i == 30:
                pathlib.Path(sys.argv[1]).touch()
                time.sleep(120)
            yield doc
    s.path_documents = stalling
    from train.prepare import main
    sys.exit(main(sys.argv[2:]))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_interrupted_prepare_then_rerun_gives_the_identical_store(sig, tmp_path):
    paths = write_corpus(tmp_path / "corpus", files=6)
    sets = ["--set", "data.source=files", "--set", f"data.paths=[{tmp_path / 'corpus'}/part-*]"]
    prepare_cli(*sets, "--out", str(tmp_path / "whole"), "--workers", "2")

    marker = tmp_path / "stalled"
    cut = tmp_path / "cut"
    proc = subprocess.Popen(
        [sys.executable, "-c", STALL, str(marker), *sets, "--out", str(cut), "--workers", "1", "--quiet"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while not marker.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    assert marker.exists(), proc.communicate()[1][-2000:]
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    shards = {p.name for p in (cut / "shards").iterdir()}
    assert not (cut / token_store.MANIFEST).exists()
    assert {"00000.json", "00001.json", "00002.json"} <= shards and "00003.json" not in shards
    assert "train-00003.bin" not in shards  # the piece in progress never looks complete
    if sig == signal.SIGTERM:
        assert proc.returncode == EXIT_PREEMPTED and "run the same command again" in err
        assert not [n for n in shards if n.endswith(".tmp")]  # cleaned up on the way out
    else:
        assert proc.returncode == -signal.SIGKILL
        assert f"train-00003.bin.{proc.pid}.tmp" in shards  # what the killed build left

    again = prepare_cli(*sets, "--out", str(cut), "--workers", "2")
    assert "token store" in again.stdout
    assert tree_hashes(cut) == tree_hashes(tmp_path / "whole")
    manifest = json.loads((cut / token_store.MANIFEST).read_text())
    assert [i["path"] for i in manifest["inputs"]] == [str(pathlib.Path(p).resolve()) for p in paths]
    assert manifest["inputs"][1]["sha256"] == hashlib.sha256(pathlib.Path(paths[1]).read_bytes()).hexdigest()


def test_the_store_imports_no_jax():
    """The build's worker processes import ``train.store`` (and through it ``train.sources``);
    spawned, each imports them afresh: JAX stays out of them."""
    code = (
        "import sys, train.store\n"
        "assert 'train.store.building' in sys.modules and 'train.sources' in sys.modules\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'jaxlib', 'flax', 'optax'}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_full_disk_leaves_no_complete_looking_piece_and_a_rerun_finishes(tmp_path, monkeypatch):
    paths = write_corpus(tmp_path / "corpus", files=4)
    plan = token_store.plan(files_section(paths))
    token_store.build(tmp_path / "whole", plan, workers=1, quiet=True)
    full_from_piece_2(monkeypatch)
    with pytest.raises(IOFault) as fault:  # the trainer and train.prepare exit 74 on it
        token_store.build(tmp_path / "full", plan, workers=1, quiet=True)
    assert str(fault.value) == (
        f"building the token store {tmp_path / 'full'} failed: no space left on device; completed "
        "shards are kept"
    )
    left = {p.name for p in (tmp_path / "full" / "shards").iterdir()}
    assert left - {"validation-00000.bin", "validation-00001.bin"} == {
        "00000.json",
        "00001.json",
        "train-00000.bin",
        "train-00001.bin",
    }
    assert not (tmp_path / "full" / token_store.MANIFEST).exists()
    monkeypatch.undo()
    token_store.build(tmp_path / "full", plan, workers=1, quiet=True)
    assert tree_hashes(tmp_path / "full") == tree_hashes(tmp_path / "whole")


def full_from_piece_2(monkeypatch) -> None:
    """The token store's shard writes fail for no space from piece 2 on (until ``undo``)."""
    original = building._ShardWriter.write

    def fill_up(self, ids):
        if "00002" in self.path.name:
            raise OSError(errno.ENOSPC, "No space left on device")
        original(self, ids)

    monkeypatch.setattr(building._ShardWriter, "write", fill_up)


@pytest.mark.parametrize("change", ["tokenizer", "fraction"])
def test_a_build_continued_with_another_tokenizer_or_fraction_redoes_its_pieces(
    change, tmp_path, monkeypatch, sp_model
):
    """A build cut short (a full disk at piece 2), then run again in the same directory with
    another tokenizer or validation fraction, gives the store an uninterrupted build with the new
    settings gives: the pieces made with the old ones are not kept (they were, and the manifest
    named the new tokenizer over the old one's ids)."""
    paths = write_corpus(tmp_path / "corpus", files=4)
    before = files_section(paths, validation_fraction=0.5)
    after = files_section(paths, **({"tokenizer": sp_model} if change == "tokenizer" else {}))
    token_store.build(tmp_path / "whole", token_store.plan(after), workers=1, quiet=True)
    full_from_piece_2(monkeypatch)
    with pytest.raises(IOFault):
        token_store.build(tmp_path / "cut", token_store.plan(before), workers=1, quiet=True)
    assert {"00000.json", "00001.json"} <= {p.name for p in (tmp_path / "cut" / "shards").iterdir()}
    monkeypatch.undo()
    token_store.build(tmp_path / "cut", token_store.plan(after), workers=1, quiet=True)
    assert tree_hashes(tmp_path / "cut") == tree_hashes(tmp_path / "whole")


def test_a_worker_killed_mid_build_is_one_line_and_a_rerun_finishes(tmp_path, monkeypatch, capsys):
    """A tokenizing worker the system kills (out of memory) ends the build with one line and exit
    69 (``ProcessLost``), not a wait that never ends; the pieces completed are
    kept, and the same build run again gives the store an uninterrupted one gives."""
    paths = write_corpus(tmp_path / "corpus", files=6)
    plan = token_store.plan(files_section(paths))
    token_store.build(tmp_path / "whole", plan, workers=1, quiet=True)
    monkeypatch.setattr(building, "tokenize_piece", tokenize_or_die)
    assert cli(lambda: token_store.build(tmp_path / "cut", plan, workers=2, quiet=True)) == EXIT_PEER_LOST
    err = capsys.readouterr().err
    assert err.startswith("error: a tokenizing worker process ended before its piece was done")
    assert "pieces completed are kept: run the same command again" in err and err.count("\n") == 1
    assert not (tmp_path / "cut" / token_store.MANIFEST).exists()
    assert "00002.json" not in {p.name for p in (tmp_path / "cut" / "shards").iterdir()}
    monkeypatch.undo()
    token_store.build(tmp_path / "cut", plan, workers=2, quiet=True)
    assert tree_hashes(tmp_path / "cut") == tree_hashes(tmp_path / "whole")


# A parent that starts one tokenizing worker as a build does (spawned, ``_init_worker``), prints
# its pid and waits: the test kills the parent.
ORPHAN = textwrap.dedent(
    """
    import multiprocessing, os, sys, time
    from train.store import building

    def worker(ready, *args):
        building._init_worker(*args)
        ready.set()
        time.sleep(120)  # as a worker waits for its next piece

    if __name__ == "__main__":
        ctx = multiprocessing.get_context("spawn")
        ready = ctx.Event()
        made_with = {"dtype": "uint16", "fraction": 0.0}
        process = ctx.Process(target=worker, args=(ready, os.getpid(), "bytes", made_with, None))
        process.start()
        if sys.argv[1] == "ready":  # killed once the worker is set up; else at once, maybe before
            ready.wait(60)
        print(process.pid, flush=True)
        time.sleep(120)
    """
)


@pytest.mark.parametrize("when", ["ready", "at once"])
def test_a_tokenizing_worker_ends_when_its_build_is_killed(when, tmp_path):
    """A build killed with SIGKILL cannot stop its workers: each ends on its own once its parent
    has gone (``_init_worker``), so that none goes on writing into the store a rerun continues;
    also when the build is killed before the worker has set itself up."""
    script = tmp_path / "orphan.py"
    script.write_text(ORPHAN)
    proc = subprocess.Popen([sys.executable, str(script), when], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    worker = int(proc.stdout.readline())
    if when == "ready":
        assert alive(worker, wait_s=1.0)  # set up and waiting while its parent lives
    proc.kill()
    proc.wait()
    survived = alive(worker)
    if survived:
        os.kill(worker, signal.SIGKILL)
    assert not survived


def test_a_piece_whose_shard_was_cut_short_is_tokenized_again(tmp_path):
    """A piece's record is trusted only with its shards whole: a shard shorter than the record
    says (a write the machine lost) is made again, not found damaged when the store opens."""
    paths = write_corpus(tmp_path / "corpus", files=3)
    plan = token_store.plan(files_section(paths))
    token_store.build(tmp_path / "whole", plan, workers=1, quiet=True)
    cut = tmp_path / "cut"
    token_store.build(cut, plan, workers=1, quiet=True)
    (cut / token_store.MANIFEST).unlink()  # as a build stopped before its end leaves it
    shard = cut / "shards" / "train-00001.bin"
    shard.write_bytes(shard.read_bytes()[:-6])
    token_store.build(cut, plan, workers=1, quiet=True)
    assert tree_hashes(cut) == tree_hashes(tmp_path / "whole")


def test_store_holds_the_documents_eos_separated_with_the_hash_split(tmp_path):
    paths = write_corpus(tmp_path / "corpus", files=3, docs=50)
    cfg = files_section(paths, validation_fraction=0.1)
    opened = open_store(cfg, quiet=True)
    docs = list(file_documents(paths, Counts()))
    tok = ByteTokenizer()
    for split, keep in (("train", False), ("validation", True)):
        want = [t for d in docs if is_validation(d, 0.1) == keep for t in tok.encode(d) + [tok.eos_id]]
        stream = opened.splits[split]
        np.testing.assert_array_equal(stream.read(0, stream.tokens), want)
    assert opened.manifest["dtype"] == "uint16"
    assert opened.manifest["splits"]["validation"]["documents"] == sum(is_validation(d, 0.1) for d in docs)
    # Windows are consecutive seq_len + 1 slices of the split, across shard boundaries.
    data = Data(opened, 33)
    flat = opened.splits["train"].read(0, opened.splits["train"].tokens)
    idx = np.arange(data.n_windows("train"))
    np.testing.assert_array_equal(data.read_train(idx), flat[: len(idx) * 33].reshape(-1, 33))
    assert len(opened.splits["train"].paths) == 3
    # A read leaves no shard mapped: pages read are page cache, not the process's RSS.
    maps = pathlib.Path("/proc/self/maps")
    if maps.exists():
        assert "shards/train-" not in maps.read_text()


def test_a_store_is_reused_not_rebuilt(tmp_path, monkeypatch):
    paths = write_corpus(tmp_path / "corpus", files=2)
    cfg = files_section(paths, cache_dir=str(tmp_path / "cache"))
    first = open_store(cfg, quiet=True)
    assert first.directory.parent == tmp_path / "cache" / "stores"
    before = tree_hashes(first.directory)
    stamps = {p: p.stat().st_mtime_ns for p in first.directory.rglob("*")}

    def refuse(*a, **k):
        raise AssertionError("the store was rebuilt")

    monkeypatch.setattr(token_store, "build", refuse)
    second = open_store(cfg, quiet=True)
    assert second.directory == first.directory and tree_hashes(second.directory) == before
    assert {p: p.stat().st_mtime_ns for p in first.directory.rglob("*")} == stamps
    # Another input (a changed file) is another cache entry.
    pathlib.Path(paths[0]).write_text(json.dumps({"text": "changed"}) + "\n")
    monkeypatch.undo()
    assert open_store(cfg, quiet=True).directory != first.directory


def test_prepare_builds_the_store_the_trainer_then_finds(tmp_path, monkeypatch, capsys):
    """``python -m train.prepare`` (its main, in this process) builds the store a data section's
    run then opens from the cache without building; its refusals are one line each."""
    from train import prepare

    paths = write_corpus(tmp_path / "corpus", files=2)
    tiny = str(ROOT / "configs" / "tiny.yaml")
    sets = ["data.source=files", f"data.paths={json.dumps(paths)}", f"data.cache_dir={tmp_path / 'cache'}"]
    argv = ["--config", tiny] + [x for s in sets for x in ("--set", s)]
    assert prepare.main([*argv, "--workers", "1", "--quiet"]) == 0
    out = capsys.readouterr().out
    directory = out.split("token store ")[1].split(":")[0]
    manifest = json.loads((pathlib.Path(directory) / token_store.MANIFEST).read_text())
    documents = {s: manifest["splits"][s]["documents"] for s in token_store.SPLITS}
    assert f"train {documents['train']:,} documents" in out and sum(documents.values()) == 80
    monkeypatch.setattr(token_store, "build", lambda *a, **k: pytest.fail("built again"))
    assert (
        str(open_store(files_section(paths, cache_dir=str(tmp_path / "cache")), quiet=True).directory)
        == directory
    )
    for more, message in [
        (["--workers", "0"], "error: --workers must be >= 1, got 0"),
        (
            ["--set", "data.source=store", "--set", "data.store=x"],
            "error: data.source is store: there is nothing",
        ),
        (["--out", paths[0]], f"error: --out {paths[0]}: {paths[0]} is not a directory"),
    ]:
        assert prepare.main([*argv, *more]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(message), err


def test_prepare_verify_finds_a_shard_changed_at_its_size(tmp_path, capsys):
    """``train.prepare --verify`` reads every shard against the sha256 the manifest recorded: a
    store as built passes, also named as ``data.source: store``; a shard whose bytes changed at
    its size (which opening the store does not see) is refused in one line naming it."""
    from train import prepare

    paths = write_corpus(tmp_path / "corpus", files=2)
    named = tmp_path / "s"
    sets = ["data.source=files", f"data.paths={json.dumps(paths)}", f"data.store={named}"]
    # (one worker: no process pool started in the test's own process)
    argv = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--workers", "1", "--quiet"]
    argv += [x for s in sets for x in ("--set", s)]
    assert prepare.main([*argv, "--verify"]) == 0
    splits = json.loads((named / token_store.MANIFEST).read_text())["splits"]
    shards = sum(len(s["shards"]) for s in splits.values())
    assert f"verified: {shards} shards" in capsys.readouterr().out
    as_store = [*argv, "--set", "data.source=store", "--verify"]
    assert prepare.main(as_store) == 0
    shard = named / "shards" / "train-00001.bin"
    tokens = np.fromfile(shard, np.uint16)
    i = int(np.flatnonzero(tokens[:-1] != tokens[1:])[0])
    tokens[[i, i + 1]] = tokens[[i + 1, i]]  # two of its tokens swapped: the same size, ids in range
    tokens.tofile(shard)
    capsys.readouterr()
    open_store(files_section(paths, store=str(named)), quiet=True)  # (opening sees nothing)
    for args in (as_store, [*argv, "--verify"]):
        assert prepare.main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            f"error: token store {named} is damaged: 1 of its {shards} shards differ from the sha256 "
            "its manifest recorded (shards/train-00001.bin); delete the store and build it again"
        ]
    assert prepare.main(argv) == 0  # without --verify: not read


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    spm = pytest.importorskip("sentencepiece")
    d = tmp_path_factory.mktemp("sp")
    corpus = d / "corpus.txt"
    corpus.write_text("\n".join(" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))) * 20)
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(d / "sp"), vocab_size=40, eos_id=1, pad_id=0, unk_id=2, bos_id=-1
    )
    return str(d / "sp.model")


def test_a_data_pattern_matching_nothing_says_from_where_a_relative_one_was_read(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as e:
        planning.expand_paths(["corpuz/*.txt"])
    assert (
        str(e.value)
        == f"data file pattern matches no file: corpuz/*.txt (a relative pattern, from {tmp_path})"
    )
    with pytest.raises(UserError) as e:
        planning.expand_paths([str(tmp_path / "corpuz" / "*.txt")])
    assert str(e.value) == f"data file pattern matches no file: {tmp_path / 'corpuz' / '*.txt'}"


def test_a_store_of_another_tokenizer_or_other_inputs_is_refused(tmp_path, sp_model):
    paths = write_corpus(tmp_path / "corpus", files=2)
    named = str(tmp_path / "named")
    open_store(files_section(paths, store=named), quiet=True)
    with pytest.raises(UserError) as e:
        open_store(files_section(paths, store=named, tokenizer=sp_model), quiet=True)
    assert "made with tokenizer bytes (vocab 257), but data.tokenizer is sentencepiece sp.model" in str(
        e.value
    )
    assert "\n" not in str(e.value)
    assert str(e.value).endswith(
        ": set data.tokenizer to the store's (e.g. --set data.tokenizer=PATH), or give data.store "
        "another directory"
    )
    with pytest.raises(UserError, match=r"made with tokenizer bytes .* sentencepiece sp.model"):
        open_store(DataSection(source="store", store=named, tokenizer=sp_model), quiet=True)
    remedy = "remove the store, or give data.store (train.prepare --out) another directory"
    with pytest.raises(UserError) as e:
        open_store(files_section(paths[:1], store=named), quiet=True)
    assert str(e.value) == (
        f"token store {named} was made from other data than the data section names (data.paths no "
        f"longer names part-01.jsonl.gz): {remedy}"
    )
    with pytest.raises(UserError, match=re.escape("(max_documents None, now 5): remove the store")):
        open_store(files_section(paths, store=named, max_documents=5), quiet=True)
    grown = pathlib.Path(paths[0])
    size = grown.stat().st_size
    grown.write_bytes(grown.read_bytes() + json.dumps({"text": "one more"}).encode() + b"\n")
    with pytest.raises(UserError) as e:
        open_store(files_section(paths, store=named), quiet=True)
    assert f"(part-00.jsonl was {size:,} bytes, now {grown.stat().st_size:,}): {remedy}" in str(e.value)
    # The store itself, with its own tokenizer, reads without its inputs.
    assert open_store(DataSection(source="store", store=named), quiet=True).splits["train"].tokens > 0
    with pytest.raises(UserError, match="is not a complete token store"):
        open_store(DataSection(source="store", store=str(tmp_path / "nothing")), quiet=True)


def test_an_input_edited_to_the_same_size_is_not_read_from_a_stale_store(tmp_path, monkeypatch):
    """A store recognises its inputs by name and size; an input rewritten in place at the same
    size (its modification time changed) is hashed again: a store made from its earlier bytes is
    refused, one touched but unchanged is used, and an interrupted build continued after the edit
    tokenizes the edited file's pieces again instead of mixing in the old ones."""
    paths = write_corpus(tmp_path / "corpus", files=3)
    plain = pathlib.Path(paths[0])  # part-00.jsonl
    named = files_section(paths, store=str(tmp_path / "named"))
    open_store(named, quiet=True)
    os.utime(plain, ns=(plain.stat().st_atime_ns, plain.stat().st_mtime_ns + 10**9))  # touched only
    assert open_store(named, quiet=True).splits["train"].tokens > 0
    with monkeypatch.context() as m:  # verified once: the next start does not hash it again
        m.setattr(token_store.reading.sources, "file_sha256", lambda path: pytest.fail(f"hashed {path}"))
        assert open_store(named, quiet=True).splits["train"].tokens > 0

    text = plain.read_bytes()

    def rewrite(data: bytes) -> None:  # in place, with a new modification time on any file system
        before = plain.stat().st_mtime_ns
        plain.write_bytes(data)
        os.utime(plain, ns=(before, before + 2 * 10**9))

    rewrite(text.replace(b"the", b"THE"))
    assert plain.stat().st_size == len(text) and b"THE" in plain.read_bytes()
    with pytest.raises(
        UserError, match=r"was made from another version of .*part-00\.jsonl \(sha256 \w{12}, now \w{12}\)"
    ):
        open_store(named, quiet=True)

    # A build stopped after its first piece, continued after the edit, equals a fresh build.
    rewrite(text)
    plan = token_store.plan(files_section(paths))
    cut = tmp_path / "cut"
    token_store.build(cut, plan, workers=1, quiet=True)
    (cut / token_store.MANIFEST).unlink()  # as a build stopped before its end leaves it
    rewrite(text.replace(b"the", b"THE"))
    plan = token_store.plan(files_section(paths))
    token_store.build(cut, plan, workers=1, quiet=True)
    token_store.build(tmp_path / "fresh", plan, workers=1, quiet=True)
    assert tree_hashes(cut) == tree_hashes(tmp_path / "fresh")


def test_an_input_of_the_same_name_and_size_elsewhere_must_have_the_same_bytes(tmp_path, monkeypatch):
    """A store knows its inputs by name and size, so that one made on another machine serves
    there: a file of the same name and size at another path is hashed (once), taken when its bytes
    are the input's, and refused when they are not (its store holds other tokens)."""
    paths = write_corpus(tmp_path / "a", files=2)
    open_store(files_section(paths, store=str(tmp_path / "s")), quiet=True)
    copies = tmp_path / "b"
    shutil.copytree(tmp_path / "a", copies)
    moved = [str(copies / pathlib.Path(p).name) for p in paths]
    assert open_store(files_section(moved, store=str(tmp_path / "s")), quiet=True).splits["train"].tokens
    with monkeypatch.context() as m:  # recorded as a copy: not hashed at the next start
        m.setattr(token_store.reading.sources, "file_sha256", lambda path: pytest.fail(f"hashed {path}"))
        open_store(files_section(moved, store=str(tmp_path / "s")), quiet=True)
    # The original, no longer named, edited at its size: the copies are what is read.
    original = pathlib.Path(paths[0])
    original.write_bytes(original.read_bytes().swapcase())
    assert open_store(files_section(moved, store=str(tmp_path / "s")), quiet=True).splits["train"].tokens
    other = tmp_path / "c"
    other.mkdir()
    swapped = other / "part-00.jsonl"
    swapped.write_bytes(pathlib.Path(moved[0]).read_bytes().swapcase())
    with pytest.raises(UserError) as e:
        open_store(files_section([str(swapped), paths[1]], store=str(tmp_path / "s")), quiet=True)
    assert str(e.value).startswith(
        f"token store {tmp_path / 's'} was made from another file named part-00.jsonl ("
        f"{pathlib.Path(paths[0]).resolve()}, sha256 "
    )
    assert str(e.value).endswith("remove the store, or give data.store another directory")


def test_a_stores_identity_is_its_tokens_not_its_tokenizers_file_name(tmp_path, sp_model):
    """``Data.identity`` (what a resume checks): equal for the same tokens made with the same
    tokenizer under another file name; checkpoints saved with the former hash, which held the
    name, resume too (``identities``)."""
    renamed = tmp_path / "renamed.model"
    shutil.copy(sp_model, renamed)
    paths = write_corpus(tmp_path / "corpus", files=2)
    made = [
        Data(open_store(files_section(paths, tokenizer=str(t), store=str(tmp_path / t.stem)), quiet=True), 9)
        for t in (pathlib.Path(sp_model), renamed)
    ]
    assert made[0].store.tokenizer["name"] != made[1].store.tokenizer["name"]
    assert made[0].identity() == made[1].identity()
    for data in made:  # the former hash, as checkpoints saved before hold it: the whole tokenizer entry
        m = data.store.manifest
        shards = {s: [sh["sha256"] for sh in m["splits"][s]["shards"]] for s in token_store.SPLITS}
        former = json.dumps({"tokenizer": m["tokenizer"], "shards": shards}, sort_keys=True)
        assert data.identities() == (data.identity(), hashlib.sha256(former.encode()).hexdigest())


def test_sentencepiece_store_and_uint32_for_large_vocabularies(tmp_path, sp_model):
    paths = write_corpus(tmp_path / "corpus", files=2, docs=10)
    opened = open_store(files_section(paths, tokenizer=sp_model, store=str(tmp_path / "sp")), quiet=True)
    assert opened.tokenizer["kind"] == "sentencepiece" and opened.tokenizer["vocab_size"] == 40
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=sp_model)
    docs = [d for d in file_documents(paths, Counts()) if not is_validation(d, 0.02)]
    want = [t for d in docs for t in sp.encode(d) + [1]]
    np.testing.assert_array_equal(opened.splits["train"].read(0, opened.splits["train"].tokens), want)
    big = token_store.Plan((), "bytes", {"vocab_size": 100_000}, {}, 0.02, None, "k")
    assert big.dtype == "uint32" and token_store.plan(files_section(paths)).dtype == "uint16"


def test_corrupt_records_are_skipped_and_counted_in_the_manifest(tmp_path):
    good = write_corpus(tmp_path / "corpus", files=1, docs=5)
    bad = tmp_path / "bad.jsonl.gz"
    with gzip.open(bad, "wb") as f:
        f.write(b'{"text": "good one"}\n{broken json\n{"text": ""}\n{"other": 1}\n')
        f.write(b'{"text": "\xff\xfe bad bytes"}\n\n{"text": "good two"}\n')
        # A lone surrogate escape is valid JSON but no UTF-8 text; a pair is one character.
        f.write(b'{"text": "lone \\ud83d here"}\n{"text": "pair \\ud83d\\ude00 here"}\n')
    opened = open_store(files_section([*good, str(bad)], store=str(tmp_path / "s")), quiet=True)
    m = opened.manifest
    assert m["skipped"] == {
        "broken_json": 1,
        "empty_text": 1,
        "missing_text": 1,
        "non_utf8": 1,
        "lone_surrogate": 1,
    }
    assert sum(m["splits"][s]["documents"] for s in ("train", "validation")) == 8


def test_inputs_whose_every_record_is_skipped_are_refused_with_the_counts(tmp_path, capsys):
    """Records without a "text" field: no store is made (``train.prepare`` exited 0 with no
    document), the refusal names the skipped records, and once the input is mended the same
    command builds the store."""
    from train import prepare

    data = tmp_path / "content.jsonl"
    data.write_text("".join(json.dumps({"content": f"document {i}"}) + "\n" for i in range(30)))
    tiny = str(ROOT / "configs" / "tiny.yaml")
    sets = ["data.source=files", f"data.paths=[{data}]", f"data.store={tmp_path / 's'}"]
    argv = ["--config", tiny, "--quiet", *[x for s in sets for x in ("--set", s)]]
    assert prepare.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: the inputs of token store {tmp_path / 's'} gave no train document (30 input "
        "records skipped: {'missing_text': 30})"
    ]
    assert not (tmp_path / "s" / token_store.MANIFEST).exists()
    with pytest.raises(UserError, match=r"gave no train document \(30 input records skipped: "):
        build_data(files_section([str(data)], store=str(tmp_path / "s")), seq_len=8)
    data.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(30)))
    assert prepare.main(argv) == 0
    assert json.loads((tmp_path / "s" / token_store.MANIFEST).read_text())["splits"]["train"]["documents"] > 0


def test_a_byte_order_mark_is_not_text_and_a_json_array_is_refused(tmp_path):
    """A UTF-8 byte-order mark first in a file (its first record was skipped as broken JSON, and a
    text file's first character was U+FEFF); a file holding a JSON array (it gave no document, or
    its last record alone, and exit 0)."""
    marked = tmp_path / "marked.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + b'{"text": "first"}\n{"text": "second"}\n')
    text = tmp_path / "marked.txt"
    text.write_bytes("\ufeffone document".encode())
    counts = Counts()
    assert list(file_documents([str(marked), str(text)], counts)) == ["first", "second", "one document"]
    assert counts.skipped == {}
    for name, body in [
        ("array.json", '[{"text": "a"}, {"text": "b"}]'),
        ("lines.jsonl", '[\n{"text": "a"},\n]'),
    ]:
        array = tmp_path / name
        array.write_text(body)
        with pytest.raises(UserError, match=rf"^data file {array} holds a JSON array; give JSON lines: "):
            list(file_documents([str(array)], Counts()))


def test_unreadable_inputs_and_tokenizer_files_are_one_line_errors(tmp_path, sp_model, monkeypatch):
    """A damaged gzip stream, a tokenizer file that is no sentencepiece model (Llama 3's tiktoken
    ``tokenizer.model``), and a ``~`` path are named in one line, not a traceback."""
    damaged = tmp_path / "damaged.jsonl.gz"
    whole = gzip.compress(b"".join(b'{"text": "document %d"}\n' % i for i in range(2000)))
    damaged.write_bytes(whole[:20] + bytes(b ^ 0xFF for b in whole[20:60]) + whole[60:])
    with pytest.raises(UserError, match=r"^cannot read data file .*damaged\.jsonl\.gz: ") as e:
        list(file_documents([str(damaged)], Counts()))
    assert "\n" not in str(e.value)
    tiktoken = tmp_path / "tokenizer.model"
    tiktoken.write_text("IQ== 0\nIg== 1\n")
    with pytest.raises(UserError, match=r"tokenizer\.model is not a sentencepiece model \(") as e:
        make_tokenizer(str(tiktoken))
    assert "\n" not in str(e.value)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "spiece.model").write_bytes(pathlib.Path(sp_model).read_bytes())
    assert make_tokenizer("~/spiece.model").vocab_size == 40


def test_a_runs_tokenizer_is_known_by_its_content_not_its_file_name(sp_model, tmp_path):
    """The tokenizer a run dir's summary records is checked by content (sha256, sizes): the same
    model file copied under another name is the run's (test_interop: another one is refused)."""
    from train.rundir import RunDir

    recorded = make_tokenizer(sp_model).identity()
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.write_summary({"data": {"tokenizer": recorded}})
    renamed = tmp_path / "renamed.model"
    renamed.write_bytes(pathlib.Path(sp_model).read_bytes())
    assert run.tokenizer(str(renamed)).identity() == recorded | {"name": "renamed.model"}


def test_max_documents_takes_the_first_documents_across_pieces(tmp_path, monkeypatch):
    monkeypatch.setattr(planning, "PIECE_BYTES", 3000)  # a plain file in several byte ranges
    paths = write_corpus(tmp_path / "corpus", files=3, docs=30)
    plan = token_store.plan(files_section(paths, max_documents=47))
    assert len(plan.pieces) > 6 and all(q.role == "mixed" for q in plan.pieces)
    stop, managers = building._stop, []

    def stop_and_look(pool):  # the workers stopped at the limit: their manager thread ends with them
        stop(pool)
        managers.extend(t for t in threading.enumerate() if type(t).__name__ == "_ExecutorManagerThread")

    monkeypatch.setattr(building, "_stop", stop_and_look)
    token_store.build(tmp_path / "two", plan, workers=2, quiet=True)
    assert not managers, "the pool's manager thread outlives the build's stop"
    token_store.build(tmp_path / "one", plan, workers=1, quiet=True)
    assert tree_hashes(tmp_path / "two") == tree_hashes(tmp_path / "one")
    opened = token_store.TokenStore(tmp_path / "two")
    docs = list(file_documents(paths, Counts()))[:47]
    tok = ByteTokenizer()
    want = [t for d in docs if not is_validation(d, 0.02) for t in tok.encode(d) + [tok.eos_id]]
    got = opened.splits["train"]
    np.testing.assert_array_equal(got.read(0, got.tokens), want)
    assert sum(opened.manifest["splits"][s]["documents"] for s in ("train", "validation")) == 47


def test_a_text_file_larger_than_a_piece_is_one_document_read_once(tmp_path, monkeypatch):
    monkeypatch.setattr(planning, "PIECE_BYTES", 100)  # JSON lines would be cut; text is not
    text = tmp_path / "wiki.test.raw"
    text.write_text("= Title =\n" + "a line of text\n" * 40)
    plan = token_store.plan(files_section([str(text)], validation_fraction=0.5))
    assert len(plan.pieces) == 1
    token_store.build(tmp_path / "store", plan, workers=1, quiet=True)
    opened = token_store.TokenStore(tmp_path / "store")
    assert sum(opened.manifest["splits"][s]["documents"] for s in ("train", "validation")) == 1
    assert sum(opened.splits[s].tokens for s in ("train", "validation")) == len(text.read_bytes()) + 1


def test_a_worker_stopped_inside_a_counter_update_does_not_hang_the_cut(tmp_path, monkeypatch):
    """``max_documents`` reached while a worker is inside ``_Counters.add`` (its lock held) when
    the build terminates it: the parent's cut of the piece that crosses the limit does not wait
    for that lock, which no one will release, and gives the store a one-worker build gives."""
    monkeypatch.setattr(planning, "PIECE_BYTES", 3000)
    paths = write_corpus(tmp_path / "corpus", files=3, docs=30)
    whole_plan = token_store.plan(files_section(paths))
    whole = token_store.build(tmp_path / "whole", whole_plan, workers=1, quiet=True)
    first = json.loads((tmp_path / "whole" / "shards" / "00000.json").read_text())
    # piece 0 read whole, piece 1 cut by the parent after the workers are stopped
    plan = token_store.plan(files_section(paths, max_documents=sum(first["documents"].values()) + 1))
    assert len(plan.pieces) > 4 and whole["splits"]["train"]["documents"] > 4
    token_store.build(tmp_path / "one", plan, workers=1, quiet=True)
    held = tmp_path / "held"
    monkeypatch.setenv(HELD_MARKER, str(held))
    monkeypatch.setattr(building, "tokenize_piece", tokenize_holding_a_counter)
    stop = building._stop

    def stop_once_held(pool):
        deadline = time.monotonic() + 60
        while not held.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        stop(pool)

    monkeypatch.setattr(building, "_stop", stop_once_held)
    done = []
    # In a thread: the build, were it stuck, fails the test instead of hanging the session.
    thread = threading.Thread(
        target=lambda: done.append(token_store.build(tmp_path / "two", plan, workers=2, quiet=True)),
        daemon=True,
    )
    thread.start()
    thread.join(timeout=90)
    assert held.exists(), "no worker was inside the counter's lock when the build stopped"
    assert done, "the build waits for a counter lock held by a terminated worker"
    assert tree_hashes(tmp_path / "two") == tree_hashes(tmp_path / "one")


def test_the_stop_waits_for_a_stuck_manager_thread_only_so_long(monkeypatch):
    """A pool whose manager thread does not end when its workers are gone (one stopped inside
    the write of a large result leaves it reading): the stop waits ``STOP_WAIT_S`` for it, then
    goes on, the workers ended and the pool shut down with its pending work cancelled."""
    monkeypatch.setattr(building, "STOP_WAIT_S", 0.3)
    release = threading.Event()
    manager = threading.Thread(target=release.wait, daemon=True)
    manager.start()
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    shut = []
    pool = types.SimpleNamespace(
        _processes={worker.pid: worker},
        _executor_manager_thread=manager,
        shutdown=lambda **how: shut.append(how),
    )
    worker.join = worker.wait  # (the multiprocessing.Process methods _stop uses)
    stopping = threading.Thread(target=building._stop, args=(pool,), daemon=True)
    started = time.monotonic()
    stopping.start()
    stopping.join(timeout=30)
    try:
        assert not stopping.is_alive(), "the stop waits on the manager thread without end"
        assert 0.3 <= time.monotonic() - started < 10 and manager.is_alive()
        assert worker.poll() is not None and shut == [{"wait": False, "cancel_futures": True}]
    finally:
        release.set()
        worker.kill()
        worker.wait()


def test_validation_paths_are_the_validation_split(tmp_path):
    train = write_corpus(tmp_path / "train", files=2, seed=1)
    val = write_corpus(tmp_path / "val", files=1, docs=7, seed=2)
    opened = open_store(files_section(train, validation_paths=val, store=str(tmp_path / "s")), quiet=True)
    m = opened.manifest
    assert m["splits"]["validation"]["documents"] == 7 and m["splits"]["train"]["documents"] == 80
    assert m["source"]["validation"] == "inputs"
    # max_documents caps the train documents; the validation files are read whole, however many
    # files (or pieces) they come in (each file was capped on its own: 3 x 5 here).
    vals = write_corpus(tmp_path / "vals", files=3, docs=7, seed=3)
    capped = files_section(train, validation_paths=vals, max_documents=5, store=str(tmp_path / "c"))
    m = open_store(capped, quiet=True).manifest
    assert m["splits"]["validation"]["documents"] == 21 and m["splits"]["train"]["documents"] == 5
    # A file whose name holds glob characters is read as written when no glob matches it.
    bracketed = tmp_path / "c4[1].jsonl"
    bracketed.write_bytes(pathlib.Path(train[0]).read_bytes())
    literal = files_section([str(bracketed)], validation_paths=val, store=str(tmp_path / "b"))
    assert open_store(literal, quiet=True).manifest["splits"]["train"]["documents"] == 40
    # A data.paths glob that also matches the validation file is refused, not trained on.
    glob_all = files_section([f"{tmp_path}/*/part-*"], validation_paths=val, store=str(tmp_path / "g"))
    with pytest.raises(
        UserError, match=r"data.validation_paths and data.paths both name .*val/part-00.jsonl:"
    ):
        open_store(glob_all, quiet=True)
    assert not (tmp_path / "g").exists()


def fake_tfds(n_train=7, n_val=3, random_access=True):
    """A stand-in for ``tensorflow_datasets`` with its ``builder().info``, ``data_source`` and
    sliced-split ``load`` interfaces, recording what is read."""
    calls = []
    records = {
        s: [{"text": f"{s} document {i} ".encode() * 5} for i in range(n)]
        for s, n in (("train", n_train), ("validation", n_val))
    }

    class Source:
        def __init__(self, split):
            self.split = split

        def __len__(self):
            return len(records[self.split])

        def __getitem__(self, i):
            calls.append(("get", self.split, i))
            return records[self.split][i]

    def data_source(name, split, download):
        if not random_access:
            raise NotImplementedError("tfrecord")
        return Source(split)

    def load(name, split, download):
        calls.append(("load", split))
        base, rng = split.split("[")
        a, b = (int(x) for x in rng.rstrip("]").split(":"))
        return records[base][a:b]

    splits = {s: types.SimpleNamespace(num_examples=len(r)) for s, r in records.items()}
    info = types.SimpleNamespace(splits=splits, version="3.1.0")
    module = types.SimpleNamespace(
        builder=lambda name: types.SimpleNamespace(info=info),
        data_source=data_source,
        load=load,
        as_numpy=lambda ds: iter(ds),
    )
    return module, calls


@pytest.mark.parametrize("random_access", [True, False])
def test_tfds_is_read_by_record_ranges_never_as_a_whole_split(random_access, tmp_path, monkeypatch):
    module, calls = fake_tfds(random_access=random_access)
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", module)
    monkeypatch.setattr(planning, "PIECE_RECORDS", 2)
    cfg = DataSection(source="tfds", tfds_name="c4/en", max_documents=5, store=str(tmp_path / "s"), workers=1)
    opened = open_store(cfg, quiet=True)
    m = opened.manifest
    assert m["splits"]["train"]["documents"] == 5 and m["splits"]["validation"]["documents"] == 3
    assert m["source"] == {
        "kind": "tfds",
        "name": "c4/en",
        "version": "3.1.0",
        "records": [5, 3],
        "validation": "inputs",
    }
    tok = ByteTokenizer()
    want = [t for i in range(5) for t in tok.encode(f"train document {i} " * 5) + [tok.eos_id]]
    np.testing.assert_array_equal(opened.splits["train"].read(0, opened.splits["train"].tokens), want)
    if random_access:
        assert sorted(c[2] for c in calls if c[1] == "train") == [0, 1, 2, 3, 4]
    else:
        assert ("load", "train[0:2]") in calls and ("load", "train[4:5]") in calls
        assert all(c[0] == "load" and "[" in c[1] for c in calls)


def test_loader_shuffles_lazily_reshuffles_each_epoch_and_resumes(tmp_path):
    paths = write_corpus(tmp_path / "corpus", files=2)
    data = build_data(files_section(paths, store=str(tmp_path / "s"), validation_fraction=0.2), seq_len=31)
    n = data.n_windows("train")
    indices = data.train_indices(batch_size=4, seed=3)
    flat = np.concatenate([next(indices) for _ in range(2 * n // 4 + 1)])  # batches span epochs
    epochs = [flat[:n], flat[n : 2 * n]]
    for epoch in epochs:  # a permutation of the windows, another one each epoch
        assert len(set(epoch.tolist())) == len(epoch) and not np.array_equal(epoch, np.sort(epoch))
    assert not np.array_equal(epochs[0], epochs[1])
    it = data.train_iterator(batch_size=4, seed=3)
    for _ in range(5):
        next(it)
    state = it.get_state()
    ahead = [next(it) for _ in range(3)]
    again = data.train_iterator(batch_size=4, seed=3)
    again.set_state(state)
    np.testing.assert_array_equal(np.stack([next(again) for _ in range(3)]), np.stack(ahead))
    indices = data.train_indices(batch_size=4, seed=3)
    order = [next(indices) for _ in range(8)]
    np.testing.assert_array_equal(ahead[0], data.read_train(order[5]))
    assert ahead[0].shape == (4, 32) and ahead[0].dtype == np.int32
    val = data.val_batches(4, 2)
    assert len(val) == 2 and val[0][0].shape == (4, 32) and val[0][1].shape == (4,)


SHARDED = textwrap.dedent(
    """
    import sys, types, numpy as np, jax
    from train.config import DataSection, MeshSection
    from train.data import build_data
    from train.sharding import global_batch, process_rows
    from train.sharding import batch_sharding, make_mesh
    data = build_data(DataSection(source="store", store=sys.argv[1]), seq_len=15)
    mesh = make_mesh(MeshSection(data=2, fsdp=2, tensor=2))
    sharding = batch_sharding(mesh, 8)
    shape = (8, data.window)
    # Rows split over data x fsdp (4 slices of 2 rows, each on the 2 tensor devices): an fsdp
    # device that held the rows of its data slice whole would compute them twice over.
    slices = {(i[0].start, i[0].stop) for i in sharding.devices_indices_map(shape).values()}
    assert sorted(slices) == [(0, 2), (2, 4), (4, 6), (6, 8)], slices
    assert process_rows(sharding, shape) is None  # one process holds every row
    # A process whose devices hold the first data slice reads rows 0-3 of each batch only.
    first = {d: i for d, i in sharding.addressable_devices_indices_map(shape).items() if i[0].start in (0, 2)}
    rows = process_rows(types.SimpleNamespace(addressable_devices_indices_map=lambda s: first), shape)
    assert rows.tolist() == [0, 1, 2, 3], rows
    everything, part = data.train_iterator(8, seed=0), data.train_iterator(8, seed=0, rows=rows)
    indices = data.train_indices(8, seed=0)
    for _ in range(3):
        idx, local = next(indices), next(part)
        want = data.read_train(idx)
        np.testing.assert_array_equal(local, want[:4])
        full = next(everything)
        for r in (None, np.arange(8)):
            batch = global_batch(full, sharding, r, shape)
            np.testing.assert_array_equal(np.asarray(batch), want)
    print("ok", len(jax.devices()))
    """
)


@pytest.mark.slow
def test_8_device_mesh_reads_the_same_global_batches_as_one_device(tmp_path):
    paths = write_corpus(tmp_path / "corpus", files=2)
    named = str(tmp_path / "s")
    open_store(files_section(paths, store=named, validation_fraction=0.2), quiet=True)
    proc = subprocess.run(
        [sys.executable, "-c", SHARDED, named],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=cpu_devices(8),
    )
    assert proc.returncode == 0 and "ok 8" in proc.stdout, proc.stderr[-3000:]


def test_damaged_store_is_a_clear_error(tmp_path):
    paths = write_corpus(tmp_path / "corpus", files=2)
    named = tmp_path / "s"
    open_store(files_section(paths, store=str(named)), quiet=True)
    shard = named / "shards" / "train-00001.bin"
    size = shard.stat().st_size
    whole = shard.read_bytes()
    for damage in (whole[:-2], whole + b"\0\0", None):  # shorter, longer, gone
        if damage is None:
            shard.unlink()
        else:
            shard.write_bytes(damage)
        found = "missing" if damage is None else r"\d+ bytes"
        with pytest.raises(
            UserError, match=rf"is damaged: shards/train-00001.bin is {found}, the manifest says"
        ):
            open_store(files_section(paths, store=str(named)), quiet=True)
    # Overwritten at its size: the ids read are no tokenizer's, in the loader's threads too.
    shard.write_bytes(b"\xff" * size)
    data = Data(open_store(files_section(paths, store=str(named)), quiet=True), 33)
    damaged = rf"^token store {named} is damaged: it holds token id 65535, not one of its tokenizer's 257; "
    batches = data.train_iterator(4, seed=0)
    with pytest.raises(UserError, match=damaged):
        for _ in range(data.n_windows("train") // 4 + 1):  # an epoch
            next(batches)
    manifest = json.loads((named / token_store.MANIFEST).read_text())
    # A manifest of the right format but the wrong shape: one line, not a KeyError.
    for key, value, problem in [
        ("splits", {}, "has no train split with its documents"),
        ("skipped", None, "has no source or skipped records"),
        (
            "splits",
            {**manifest["splits"], "validation": {"documents": 1, "shards": [{"file": "x", "tokens": 1}]}},
            r"has no list of validation shards \(each a file, its tokens and sha256\)",
        ),
        ("dtype", "foo", "has dtype 'foo', not uint16 or uint32"),
        ("tokenizer", None, "has no tokenizer with a vocab_size"),
    ]:
        (named / token_store.MANIFEST).write_text(json.dumps({**manifest, key: value}))
        with pytest.raises(
            UserError, match=rf"^token store {named} is damaged: its manifest.json {problem}; "
        ):
            open_store(DataSection(source="store", store=str(named)), quiet=True)
    (named / token_store.MANIFEST).write_text("[]")
    with pytest.raises(UserError, match=r"has format None version None; this moara-jax reads"):
        open_store(DataSection(source="store", store=str(named)), quiet=True)


def test_a_split_shorter_than_one_window_names_the_numbers(tmp_path):
    paths = write_corpus(tmp_path / "corpus", files=1, docs=3)
    cfg = files_section(paths, store=str(tmp_path / "s"), validation_paths=[])
    with pytest.raises(UserError, match=r"the train split has \d+ tokens, fewer than one window of 100001"):
        build_data(cfg, seq_len=100_000)
    tiny_val = write_corpus(tmp_path / "val", files=1, docs=1)
    cfg = files_section(paths, store=str(tmp_path / "v"), validation_paths=tiny_val)
    with pytest.raises(UserError, match=r"validation split has \d+ tokens.*data.validation_paths"):
        build_data(cfg, seq_len=1000)
