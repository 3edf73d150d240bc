"""The XLA flags python -m train sets (the ``xla`` config section): merged into XLA_FLAGS before
JAX starts, the user's own flags kept, unknown flags refused with one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from train import xla_flags
from train.config import load_config
from train.errors import UserError

ROOT = Path(__file__).resolve().parents[1]


def test_merge_keeps_the_users_flags_and_the_first_of_repeated_names():
    user = "--xla_gpu_enable_triton_gemm=true --xla_dump_to=/tmp/x"
    value, added = xla_flags.merged(
        user,
        [
            "--xla_gpu_enable_triton_gemm=false",  # the user set it: theirs wins
            "--xla_gpu_enable_latency_hiding_scheduler=true",
            "--xla_gpu_enable_latency_hiding_scheduler=false",  # a repeat: the first wins
        ],
    )
    assert added == ["--xla_gpu_enable_latency_hiding_scheduler=true"]
    assert value == user + " --xla_gpu_enable_latency_hiding_scheduler=true"
    assert xla_flags.merged("", ["--xla_a=1"]) == ("--xla_a=1", ["--xla_a=1"])


def test_gpu_sets_only_on_a_gpu_and_raw_flags_everywhere():
    sets = ["latency_hiding", "cublas_gemm"]
    raw = ["--xla_force_host_platform_device_count=2"]
    on_gpu = xla_flags.configured_flags(sets, raw, gpu=True)
    assert (
        on_gpu
        == list(xla_flags.GPU_FLAG_SETS["latency_hiding"] + xla_flags.GPU_FLAG_SETS["cublas_gemm"]) + raw
    )
    assert xla_flags.configured_flags(sets, raw, gpu=False) == raw
    assert xla_flags.DEFAULT_GPU_FLAG_SETS == ()  # none on until a GPU measurement shows it helps
    assert xla_flags.configured_flags(None, raw, gpu=True) == raw
    with pytest.raises(UserError, match=r"xla.gpu_flag_sets: unknown set\(s\) \['fast'\]"):
        xla_flags.configured_flags(["fast"], [], gpu=False)
    with pytest.raises(UserError, match="is not an XLA flag of the form"):
        xla_flags.configured_flags(None, ["xla_foo=1"], gpu=False)


def test_config_section_is_validated_at_load(tmp_path):
    cfg = load_config(ROOT / "configs" / "tiny.yaml", ["xla.gpu_flag_sets=[latency_hiding]"])
    assert cfg.xla.gpu_flag_sets == ["latency_hiding"] and cfg.xla.flags == []
    with pytest.raises(UserError, match="unknown set"):
        load_config(ROOT / "configs" / "tiny.yaml", ["xla.gpu_flag_sets=[nope]"])


def test_every_named_set_is_known_to_this_jaxlib_and_unknown_flags_are_refused():
    # XLA aborts the whole process on a flag it does not know: check_known asks a child first.
    every = sorted({f for flags in xla_flags.GPU_FLAG_SETS.values() for f in flags})
    xla_flags.check_known(every)
    with pytest.raises(UserError, match="--xla_not_a_flag"):
        xla_flags.check_known(["--xla_gpu_enable_latency_hiding_scheduler=true", "--xla_not_a_flag=1"])


def test_apply_refuses_once_a_backend_runs_and_leaves_the_users_value():
    jax.devices()  # this process's backend is up: XLA has read its flags
    env = {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false"}
    with pytest.raises(UserError, match="already running"):
        xla_flags.apply(["--xla_gpu_enable_latency_hiding_scheduler=true"], env)
    assert env == {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false"}
    assert xla_flags.apply(["--xla_gpu_enable_triton_gemm=true"], env) == []  # the user's value stays


def test_gpu_is_not_expected_when_jax_platforms_excludes_it(monkeypatch):
    import importlib.util

    def find_spec(name):  # JAX's CUDA 13 plugin installed, and no other
        return object() if name == "jax_plugins.xla_cuda13" else None

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    for platforms, expected in ((None, True), ("cuda", True), ("cuda,cpu", True), ("cpu", False)):
        if platforms is None:
            monkeypatch.delenv("JAX_PLATFORMS", raising=False)
        else:
            monkeypatch.setenv("JAX_PLATFORMS", platforms)
        assert xla_flags.gpu_platform_expected() is expected, platforms


@pytest.mark.slow
def test_train_sets_configured_flags_before_jax_starts(tmp_path):
    """A CPU-effective flag from the config takes effect: the run sees two host devices."""
    run = tmp_path / "run"
    sets = [
        "train.steps=2",
        "train.batch_size=8",
        "train.seq_len=32",
        "train.eval_every=2",
        "train.eval_batches=1",
        "xla.flags=[--xla_force_host_platform_device_count=2]",
    ]
    args = [
        sys.executable,
        "-m",
        "train",
        "--config",
        str(ROOT / "configs" / "tiny.yaml"),
        "--run-dir",
        str(run),
    ]
    # The session's flags (its compile settings) without a device count of its own.
    session = os.environ.get("XLA_FLAGS", "").split()
    kept = [f for f in session if xla_flags.flag_name(f) != "xla_force_host_platform_device_count"]
    env = dict(os.environ, XLA_FLAGS=" ".join(kept))
    proc = subprocess.run(
        args + [a for s in sets for a in ("--set", s)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**env, "JAX_PLATFORMS": "cpu"},
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "XLA flags added: --xla_force_host_platform_device_count=2" in proc.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert summary["devices"] == 2 and summary["mesh"]["data"] == 2
