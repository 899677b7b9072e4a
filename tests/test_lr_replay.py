"""``tim-plugins lr-replay`` on the sample logs in tests/data (TRL JSONL, verl FileLogger JSONL, wandb CSV)."""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path

import pytest

from tim_plugins.apps import lr_replay
from tim_plugins.lr_control import LengthTriggeredLRDecay

DATA = Path(__file__).parent / "data"
FILES = {
    "trl": DATA / "lr_replay_trl.jsonl",  # TRL log_history rows (+ eval rows without a length)
    "verl": DATA / "lr_replay_verl.jsonl",  # verl FileLogger rows {"step", "data"}, NaN literals for gaps
    "wandb": DATA / "lr_replay_wandb.csv",  # wandb UI CSV export with __MIN/__MAX columns
}
RAMP_START = 121  # see tests/data/make_lr_replay_samples.py


def _main(argv):
    parser = argparse.ArgumentParser()
    lr_replay.register(parser.add_subparsers())
    args = parser.parse_args(["lr-replay", *argv])
    return args.func(args)


def _verl_series():
    """Independent parse of the verl file (json per line, NaN literal) → (steps, lengths, k3)."""
    steps, lengths, k3 = [], [], []
    for line in FILES["verl"].read_text().splitlines():
        row = json.loads(line)
        steps.append(row["step"])
        lengths.append(row["data"]["response_length/mean"])
        k3.append(row["data"]["rollout_corr/k3_kl"])
    return steps, lengths, k3


def _expected_fires(**options):
    steps, lengths, k3 = _verl_series()
    ctrl = LengthTriggeredLRDecay(**options)
    fires = []
    for s, x, k in zip(steps, lengths, k3):
        ctrl.observe(s, x, kl_k3=k)
        if ctrl.metrics()["tim/lr/triggered"]:
            fires.append((s, ctrl.scale))
    return fires


@pytest.mark.parametrize("name", list(FILES))
def test_replay_each_format(name, tmp_path, capsys):
    out = tmp_path / "traj.csv"
    plot = tmp_path / "replay.png"
    assert _main([str(FILES[name]), "--out", str(out), "--plot", str(plot)]) == 0
    text = capsys.readouterr().out
    with out.open() as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["step"]) for r in rows] == list(range(1, 201))
    fires = [(int(r["step"]), float(r["tim/lr/scale"])) for r in rows if float(r["tim/lr/triggered"]) == 1.0]
    assert fires == _expected_fires()  # the same run in three formats → the same decisions
    assert fires[0][0] >= RAMP_START and fires[0][0] - RAMP_START <= 20  # spikes/burst/gaps before: no fire
    assert [s for _, s in fires] == [0.5, 0.25, 0.125][: len(fires)]
    assert float(rows[-1]["tim/lr/skipped"]) == 4  # the missing steps 40, 90-92
    assert rows[39]["length"] == "" and rows[39]["tim/lr/scale"] == "1.0"
    for step, scale in fires:
        assert f"{step:>8}" in text and f"{scale:.4g}" in text
    assert f"triggers: {len(fires)}" in text
    data = plot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_json_out_options_and_extra_signal(tmp_path, capsys):
    out = tmp_path / "traj.json"
    argv = [str(FILES["verl"]), "--signals", "kl_k3", "--kl-k3-floor", "0", "--margin", "0.3", "--out", str(out)]
    assert _main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["columns"] == {"length": "response_length/mean", "step": "step", "kl_k3": "rollout_corr/k3_kl"}
    assert doc["config"]["margin"] == 0.3 and doc["config"]["signals"] == ["kl_k3"]
    want = _expected_fires(signals=("kl_k3",), kl_k3_floor=0.0, margin=0.3)
    assert doc["fires"] == [s for s, _ in want]
    length_only = [s for s, _ in _expected_fires(margin=0.3)]
    assert doc["fires"][0] < length_only[0]  # k3 (which surges from step 111) warns earlier
    assert doc["steps"][39]["length"] is None  # NaN gap written as null (strict JSON)
    assert "kl_k3_floor=0.0" in capsys.readouterr().out


def test_trainer_state_json_and_explicit_columns(tmp_path, capsys):
    rows = [json.loads(line) for line in FILES["trl"].read_text().splitlines()]
    state = tmp_path / "trainer_state.json"
    state.write_text(json.dumps({"global_step": 200, "log_history": rows}))
    assert _main([str(state), "--out", str(tmp_path / "a.json")]) == 0
    a = json.loads((tmp_path / "a.json").read_text())["fires"]
    assert a == [s for s, _ in _expected_fires()]
    # a file with unusual names: explicit columns
    odd = tmp_path / "odd.csv"
    with odd.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["it", "len_tokens"])
        for r in rows:
            if "completions/mean_length" in r:
                w.writerow([r["step"], r["completions/mean_length"]])
    assert _main([str(odd)]) == 2
    assert "--length-col" in capsys.readouterr().err
    assert _main([str(odd), "--length-col", "len_tokens", "--step-col", "it", "--out", str(tmp_path / "b.json")]) == 0
    assert json.loads((tmp_path / "b.json").read_text())["fires"] == a
    assert _main([str(odd), "--length-col", "nope"]) == 2
    assert "'nope'" in capsys.readouterr().err


def test_errors_are_reported_not_raised(tmp_path, capsys):
    assert _main([str(FILES["wandb"]), "--margin", "-1"]) == 2
    assert "margin=-1.0" in capsys.readouterr().err
    assert _main([str(FILES["wandb"]), "--signals", "kl_k3"]) == 2  # the CSV export has no k3 column
    assert "--k3-col" in capsys.readouterr().err
    assert _main([str(tmp_path / "missing.jsonl")]) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1}\nnot json\n')
    assert _main([str(bad)]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err


@pytest.mark.parametrize("rows", ['{"step": null, "completions/mean_length": 5}\n' * 3,
                                  '{"step": "a", "completions/mean_length": 5}\n{"step": "b", '
                                  '"completions/mean_length": 6}\n'], ids=["null", "text"])
def test_no_numeric_step_is_reported_with_the_column_and_the_flag(rows, tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    log.write_text(rows)
    assert _main([str(log)]) == 2
    err = capsys.readouterr().err
    assert "no row of" in err and "numeric step in column 'step'" in err and "--step-col" in err, err


def test_a_dump_log_history_names_the_files_that_hold_the_length(tmp_path, capsys):
    """``DUMP_DIR/log_history.jsonl`` (what TIMConfig(dump_dir=...) and verl's +tim.dump.dir write beside the dump)
    holds tim/* metrics only, no response length: "name it with --length-col" cannot work there. The error says so
    and names the logs that hold the length; the one it names first, a trainer_state.json with the same steps,
    replays."""
    from tim_plugins.dump import LOG_HISTORY, append_log_history

    dump = tmp_path / "dump"
    dump.mkdir()
    for step in (1, 2, 3):
        append_log_history(dump, step, {"tim/token/kl_k3": 1e-4 * step, "tim/tokens": 90.0, "actor/lr": 1e-6})
    assert _main([str(dump / LOG_HISTORY)]) == 2
    (err,) = capsys.readouterr().err.splitlines()
    assert "--length-col" not in err and "holds the tim/* metrics only" in err, err
    assert "trainer_state.json" in err and "summary.json" in err, err
    state = tmp_path / "trainer_state.json"  # TRL's own log of the same run
    state.write_text(json.dumps({"log_history": [{"step": s, "completions/mean_length": 10.0 + s} for s in (1, 2, 3)]}))
    assert _main([str(state)]) == 0


def test_registered_in_cli():
    from tim_plugins.apps import cli

    assert "tim_plugins.apps.lr_replay" in cli.SUBCOMMAND_MODULES
    assert cli.main(["lr-replay", str(FILES["verl"])]) == 0


def test_column_detection():
    cols = ["Step", "r - train/completions/mean_length__MIN", "r - train/completions/mean_length",
            "r - train/grad_norm"]
    assert lr_replay.detect_column(cols, lr_replay.LENGTH_COLUMNS) == "r - train/completions/mean_length"
    assert lr_replay.detect_column(cols, lr_replay.GRAD_NORM_COLUMNS) == "r - train/grad_norm"
    assert lr_replay.detect_column(["actor/tim/token/kl_k3"], lr_replay.K3_COLUMNS) == "actor/tim/token/kl_k3"
    assert lr_replay.detect_column(["response_length/max", "response_length/mean"],
                                   lr_replay.LENGTH_COLUMNS) == "response_length/mean"
    assert lr_replay.detect_column(["foo_length"], lr_replay.LENGTH_COLUMNS) is None
    assert math.isnan(lr_replay._num("n/a"))
