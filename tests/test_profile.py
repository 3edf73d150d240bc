"""train.profile: S_tau over the recordings after ``profile.from_step``, per basis, the first
basis's note, and ``python -m train.profile`` reading a finished profile again."""

import json
import pathlib

import numpy as np
import pytest
import yaml

from train import profile as profiling
from train.config import load_config, to_dict
from train.errors import UserError

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
TYPES = ("q", "k", "v", "o", "up", "gate", "down")
PROFILE = ["mode=profile", "optimizer.update_proj_gap=200", "profile.steps=400", "profile.every=20"]


def recorder(first: dict, later: dict) -> profiling.AlignmentRecorder:
    """Recordings every 20 steps to 400 under a refresh every 200: each type's ``S`` is
    ``first[type]`` under the first basis (steps 20 to 200) and ``later[type]`` after, as the
    Llama 2 60M profile of ``benchmarks/results/wiki60m`` was, with down best aligned under the first
    basis and lowest under the second."""
    rec = profiling.AlignmentRecorder(ema=0.9)
    for step in range(20, 401, 20):
        values = first if step <= 200 else later
        rec.record(
            step, {f"['layers_{i}']['{t}_proj']['kernel']": values[t] for i in range(2) for t in TYPES}
        )
    return rec


FIRST = {"q": 0.66, "k": 0.65, "v": 0.67, "o": 0.70, "up": 0.688, "gate": 0.689, "down": 0.76}
LATER = {"q": 0.908, "k": 0.916, "v": 0.944, "o": 0.92, "up": 0.919, "gate": 0.917, "down": 0.85}


def test_the_recorders_smoothed_trajectory_is_an_ema_that_starts_at_the_first_value():
    """``smoothed`` (alignment.json's curves): s_1 = v_1, s_t = ema * s_(t-1) + (1 - ema) * v_t."""
    rec = profiling.AlignmentRecorder(ema=0.9)
    for step, value in ((1, 1.0), (2, 0.0), (3, 0.5)):
        rec.record(step, {"['layers_0']['q_proj']['kernel']": value})
    assert rec.smoothed["q"] == pytest.approx([1.0, 0.9, 0.9 * 0.9 + 0.1 * 0.5])


def test_s_tau_averages_the_recordings_after_from_step_and_per_basis():
    rec = recorder(FIRST, LATER)
    assert rec.steps == list(range(20, 401, 20))
    both = rec.s_tau()
    for t in TYPES:
        assert both[t] == pytest.approx((FIRST[t] + LATER[t]) / 2)
        assert rec.s_tau(200)[t] == pytest.approx(LATER[t])
        assert rec.s_tau(199)[t] == pytest.approx((FIRST[t] + 10 * LATER[t]) / 11)  # step 200 kept
    assert list(both) == list(TYPES)  # the paper's order
    assert rec.s_tau(400) == {}
    per_basis = rec.by_basis(200)
    assert list(per_basis) == [1, 201]
    assert [per_basis[b]["recordings"] for b in (1, 201)] == [10, 10]
    assert per_basis[1]["s_tau"] == pytest.approx(FIRST) and per_basis[201]["s_tau"] == pytest.approx(LATER)
    assert [profiling.basis_step(s, 200) for s in (1, 200, 201, 400, 401)] == [1, 1, 201, 201, 401]


def test_the_outputs_say_where_the_first_basis_chose_other_receivers(tmp_path, capsys):
    """The 60M profile's case: over every recording ``gate`` is the lowest type besides the
    donors, after the first basis ``down`` is (the paper's receiver); the outputs keep the
    paper's S_p and say so, with the from_step that leaves the first basis out."""
    rec = recorder(FIRST, LATER)
    cfg = load_config(TINY, PROFILE)
    got = profiling.write_outputs(rec, tmp_path, cfg)
    assert got["allocation"]["receivers"] == ["gate"]
    alignment = json.loads((tmp_path / "alignment.json").read_text())
    assert alignment["from_step"] == 0 and alignment["update_proj_gap"] == 200
    assert alignment["s_tau_by_basis"]["201"]["s_tau"] == pytest.approx(LATER)
    note = alignment["note"]
    assert note.startswith("10 of the 20 recordings in S_tau were made under the first basis"), note
    assert "(profile.from_step=200) the receivers would be ['down'], not ['gate']" in note
    assert "S_tau after step 200 (lowest first): down 0.8500, q 0.9080" in note
    said = capsys.readouterr().out
    assert f"note: {note}" in said and said.startswith("S_tau (lowest first): k 0.7830, q 0.7840")
    assert (tmp_path / "alignment.png").stat().st_size > 0
    # Left out: the allocation is the paper's (q, k -> down), and nothing to note.
    cfg = load_config(TINY, [*PROFILE, "profile.from_step=200"])
    got = profiling.write_outputs(rec, tmp_path, cfg)
    assert got["allocation"]["receivers"] == ["down"] and got["allocation"]["ranks"]["down"] == 32
    assert json.loads((tmp_path / "alignment.json").read_text())["note"] is None
    assert capsys.readouterr().out.startswith("S_tau after step 200 (lowest first): down 0.8500")
    # A host whose bases move at every step (OSD) or on intervals of their own (Q-GaLore) has no
    # windows of one basis: none are given, and no note.
    for host in ("osd", "q_galore", "ldadam"):
        got = profiling.write_outputs(rec, tmp_path, load_config(TINY, [*PROFILE, f"optimizer.host={host}"]))
        alignment = json.loads((tmp_path / "alignment.json").read_text())
        assert alignment["s_tau_by_basis"] is None and alignment["note"] is None
        assert got["allocation"]["receivers"] == ["gate"]
    capsys.readouterr()
    # Where the first basis orders the types as the later ones do, there is nothing to note.
    profiling.write_outputs(recorder(LATER, LATER), tmp_path, load_config(TINY, PROFILE))
    assert json.loads((tmp_path / "alignment.json").read_text())["note"] is None


@pytest.mark.parametrize(
    "sets,message",
    [
        (
            ["profile.from_step=400"],
            r"profile.from_step must be in \[0, 400\) \(the profile's last recording is at step "
            r"400\), got 400",
        ),
        (["profile.from_step=-1"], r"profile.from_step must be in \[0, 400\)"),
        (
            ["profile.from_step=390", "profile.steps=399"],
            r"must be in \[0, 380\) \(the profile's last recording is at step 380\)",
        ),
    ],
)
def test_a_from_step_that_leaves_no_recording_is_refused(sets, message):
    with pytest.raises(UserError, match=message):
        load_config(TINY, [*PROFILE, *sets])


def finished_profile(run_dir: pathlib.Path, rec) -> pathlib.Path:
    """A profiling run's dir as ``python -m train`` leaves it: its config and its outputs."""
    run_dir.mkdir()
    cfg = load_config(TINY, PROFILE)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
    profiling.write_outputs(rec, run_dir, cfg)
    return run_dir


def test_the_command_reads_a_finished_profile_again_with_another_from_step(tmp_path, capsys):
    run = finished_profile(tmp_path / "prof", recorder(FIRST, LATER))
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    assert profiling.main([str(run), "--from-step", "200"]) == 0
    out = run / "from-step-200"
    allocation = json.loads((out / "allocation.json").read_text())
    assert allocation["receivers"] == ["down"] and allocation["s_tau"] == pytest.approx(LATER)
    alignment = json.loads((out / "alignment.json").read_text())
    assert alignment["from_step"] == 200 and alignment["steps"] == list(range(20, 401, 20))
    assert (out / "alignment.png").is_file()
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before  # the run's own kept
    # --from-step 0 reproduces the run's own outputs (the plot aside).
    assert profiling.main([str(run), "--from-step", "0", "--out", str(tmp_path / "again")]) == 0
    for name in ("alignment.json", "allocation.json"):
        assert (tmp_path / "again" / name).read_bytes() == before[name]
    capsys.readouterr()


def test_the_command_refuses_in_one_line(tmp_path, capsys):
    run = finished_profile(tmp_path / "prof", recorder(FIRST, LATER))
    cases = [
        ([str(run), "--from-step", "400"], "error: profile.from_step must be in [0, 400)"),
        (
            [str(tmp_path / "none"), "--from-step", "2"],
            f"error: run dir {tmp_path / 'none'}: no such directory",
        ),
        (
            [str(tmp_path), "--from-step", "2"],
            f"error: {tmp_path} holds no alignment.json: not a finished profiling run",
        ),
    ]
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "alignment.json").write_text("{}")
    cases.append(
        (
            [str(tmp_path / "broken"), "--from-step", "2"],
            "error: " + str(tmp_path / "broken" / "alignment.json") + ": not a profile's alignment record",
        )
    )
    for argv, said in cases:
        assert profiling.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(said) and err.count("\n") == 1, err
    assert not (run / "from-step-400").exists()


def test_mean_of_recordings_matches_numpy():
    """S_tau is the plain mean of the recorded values (the paper's E over t and W)."""
    rng = np.random.default_rng(0)
    rec = profiling.AlignmentRecorder(ema=0.5)
    values = rng.uniform(0.5, 1.0, size=(6, len(TYPES)))
    for i, row in enumerate(values):
        rec.record(10 * (i + 1), {f"['{t}_proj']['kernel']": v for t, v in zip(TYPES, row, strict=True)})
    got = rec.s_tau(30)
    np.testing.assert_allclose([got[t] for t in TYPES], values[3:].mean(axis=0))
