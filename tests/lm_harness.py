"""lm-evaluation-harness on a model directory, offline: a local JSONL multiple-choice task made a
harness task (a YAML in its own folder), scored by the harness' ``HFLM`` in this process or by
the ``lm_eval`` command; and the same task's scores from ``train.evaluate``."""

import json
import pathlib
import subprocess
import sys

import pytest
import yaml

NAME = "moara_toy"
# A context with a trailing space (moved to the continuation) and an empty one (the prefix token).
TASK = [
    {"context": "the quick brown", "choices": ["fox", "dog jumps"], "label": 0},
    {"context": "over the lazy ", "choices": ["dog", "fox 7"], "label": 1},
    {"context": "", "choices": ["the", "lazy dog"], "label": 0},
    {"context": "a fox\nand  two dogs:", "choices": ["lazy", "quick brown é"], "label": 1},
]
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def write_task(path: pathlib.Path, examples=TASK) -> pathlib.Path:
    path.write_text("\n".join(json.dumps(x) for x in examples) + "\n")
    return path


def harness_task(folder: pathlib.Path, task: pathlib.Path) -> pathlib.Path:
    """A folder holding the harness task ``NAME`` over the JSONL ``task`` (datasets' cache in it)."""
    folder.mkdir(parents=True, exist_ok=True)
    spec = {
        "task": NAME,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(task)}, "cache_dir": str(folder / "datasets")},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{context}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{label}}",
        "target_delimiter": " ",
        "metric_list": [
            {"metric": m, "aggregation": "mean", "higher_is_better": True} for m in ("acc", "acc_norm")
        ],
    }
    (folder / f"{NAME}.yaml").write_text(yaml.safe_dump(spec))
    return folder


def _scores(samples: list[dict]) -> list[list[float]]:
    return [[float(r[0]) for r in s["filtered_resps"]] for s in sorted(samples, key=lambda s: s["doc_id"])]


def harness_scores(
    model_dir, task: pathlib.Path, work: pathlib.Path, monkeypatch, tokenizer=None
) -> tuple[list, dict]:
    """Each example's choice log-likelihoods and the ``acc``/``acc_norm`` of the harness' ``HFLM``
    on ``model_dir`` (its Python API: ``simple_evaluate`` with a task manager of this task only),
    with the tokenizer of ``model_dir`` or of the directory ``tokenizer``."""
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(harness_task(work, task)), include_defaults=False)
    out = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={model_dir}" + (f",tokenizer={tokenizer}" if tokenizer else ""),
        tasks=[NAME],
        task_manager=manager,
        batch_size=4,
        device="cpu",
        log_samples=True,
    )
    results = out["results"][NAME]
    return _scores(out["samples"][NAME]), {m: results[f"{m},none"] for m in ("acc", "acc_norm")}


def harness_cli_scores(argv: list[str], task: pathlib.Path, work: pathlib.Path, env: dict) -> tuple:
    """The same from the ``lm_eval`` command ``argv`` (run with this task folder included and its
    samples written under ``work``)."""
    pytest.importorskip("lm_eval")
    folder = harness_task(work / "task", task)
    args = [*argv, "--include_path", str(folder), "--output_path", str(work / "out"), "--log_samples"]
    lm_eval = pathlib.Path(sys.executable).with_name("lm_eval")
    proc = subprocess.run(
        [str(lm_eval), *args[1:]], env={**env, **OFFLINE}, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (samples,) = (work / "out").rglob(f"samples_{NAME}_*.jsonl")
    (results,) = (work / "out").rglob("results_*.json")
    task_results = json.loads(results.read_text())["results"][NAME]
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    return _scores(rows), {m: task_results[f"{m},none"] for m in ("acc", "acc_norm")}


def evaluate_scores(argv: list[str], out: pathlib.Path) -> tuple[list, dict]:
    """Each example's choice log-likelihoods and the task's ``acc``/``acc_norm`` from
    ``python -m train.evaluate argv --tasks NAME=... --out out`` (in this process)."""
    from train import evaluate as evaluation

    assert evaluation.main([*argv, "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / f"scores-{NAME}.jsonl").read_text().splitlines()]
    report = json.loads((out / "eval.json").read_text())["tasks"][NAME]
    return [r["loglikelihoods"] for r in rows], {m: report[m] for m in ("acc", "acc_norm")}


def assert_same_scores(got: tuple[list, dict], want: tuple[list, dict], tol: float = 1e-3) -> None:
    """Per-choice log-likelihoods within ``tol`` nats, and the same accuracies."""
    (got_lls, got_acc), (want_lls, want_acc) = got, want
    assert len(got_lls) == len(want_lls)
    for a, b in zip(got_lls, want_lls, strict=True):
        assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b, strict=True)) <= tol, (a, b)
    assert got_acc == pytest.approx(want_acc, abs=1e-9)
