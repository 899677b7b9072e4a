"""What a `trl vllm-serve` server does to every request on its own, read by TRL server mode's callback.

tim-plugins' min-p logits processor on the server, started the way a user appends it (``--logits-processors
tim_plugins.integrations.vllm.min_p:TIMMinPLogitsProcessor --additional-config '{"tim_min_p": 0.001}'``, forwarded
to ``vllm serve``): it cuts every request at that min-p whatever GRPOConfig.min_p says. The server runs in float32
(``trl vllm-serve --dtype float32``, the audit's dtype fix), like the trainer: with the same cut on both sides the two
stacks' log-probs agree (TRL's own ``sampling/sampling_logp_difference/mean`` is the reference), and any gap left is
the cut. Before: the parity audit read neither the server's processors nor its additional_config, so it called a
sampler that prunes every request unpruned (no finding, or a false one against a trainer that matched it), and
``TIMConfig(safe_vocab=True)``, the audit's own fix, was refused as "this sampler keeps the whole vocabulary".

A server returning raw log-probs: the safe vocabulary is refused there (before: it trained, every ratio reading the
kept mass).

The harness (server launch, CPU weight transfer) is tests/test_trl_vllm_server.py's.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("trl")
pytest.importorskip("vllm")
requests = pytest.importorskip("requests")
datasets = pytest.importorskip("datasets")

from test_trl_callback import make_trainer  # noqa: E402
from test_trl_vllm_server import _launch_two_procs, serve  # noqa: E402
from trl_server_client import patch_client, reload_checkpoint  # noqa: E402

from tim_plugins.integrations.trl import TIMCallback, TIMConfig  # noqa: E402
from tim_plugins.rollout.vllm_min_p_config import CONFIG_KEY, PROCESSOR_FQCN  # noqa: E402

pytestmark = [pytest.mark.trl, pytest.mark.vllm, pytest.mark.slow]

SERVER_MIN_P = 1e-3


@pytest.fixture(scope="module")
def min_p_server(toy_model_path, tmp_path_factory):
    extra = ("--logits-processors", PROCESSOR_FQCN, "--additional-config", json.dumps({CONFIG_KEY: SERVER_MIN_P}))
    log = tmp_path_factory.mktemp("vllm_min_p_server") / "server.log"
    with serve(toy_model_path, log, extra, dtype="float32") as base_url:
        yield base_url


def _server_min_p(base_url) -> float:
    """The server's own word for its cut: its /server_info."""
    info = requests.get(f"{base_url}/server_info", params={"config_format": "json"}, timeout=10).json()["vllm_config"]
    assert PROCESSOR_FQCN in info["model_config"]["logits_processors"]
    return info["additional_config"][CONFIG_KEY]


def _run(base_url, toy_model_path, tmp_path, config, steps=2):
    reload_checkpoint(base_url, toy_model_path)
    mp = pytest.MonkeyPatch()
    (tmp_path / "synced").mkdir()
    patch_client(mp.setattr, tmp_path / "synced", [])
    try:
        trainer = make_trainer(toy_model_path, tmp_path, use_vllm=True, vllm_mode="server",
                               vllm_server_base_url=base_url, vllm_server_timeout=60, max_steps=steps,
                               loss_type="grpo")  # GRPOConfig: min_p=None, top_p=1.0, top_k=0
        cb = TIMCallback(trainer, config)
        trainer.add_callback(cb)
        trainer.train()
        return trainer, cb
    finally:
        mp.undo()


def _trl_logp_gap(trainer) -> list[float]:
    return [h["sampling/sampling_logp_difference/mean"] for h in trainer.state.log_history
            if "sampling/sampling_logp_difference/mean" in h]


def test_the_audit_reads_the_servers_min_p_processor(min_p_server, toy_model_path, tmp_path):
    """No safe vocabulary: the server prunes, the trainer does not. The audit names the truncation with the server's
    own min-p, and TRL's own log-prob gap shows it (fp32 on both sides: only the cut separates them)."""
    trainer, cb = _run(min_p_server, toy_model_path, tmp_path, TIMConfig())
    rollout, _ = cb.parity_specs
    assert rollout.min_p == _server_min_p(min_p_server) == SERVER_MIN_P
    (finding,) = [f for f in cb.findings if f.code == "sampler-truncation-unmatched"]
    assert finding.severity == "error" and finding.rollout_value == {"min_p": SERVER_MIN_P}, finding
    assert "TIMConfig(safe_vocab=True)" in finding.fix["trl"]
    assert min(_trl_logp_gap(trainer)) > 1e-3  # the kept mass, as TRL measures it


def test_safe_vocab_follows_the_servers_min_p_processor(min_p_server, toy_model_path, tmp_path):
    """The audit's fix as printed, TIMConfig(safe_vocab=True) with safe_vocab_min_p=None: the trainer cuts where the
    server does (its /server_info), the audit finds no truncation left, and TRL's own gap between the server's
    processed log-probs and the trainer's is gone at every step."""
    trainer, cb = _run(min_p_server, toy_model_path, tmp_path, TIMConfig(safe_vocab=True))
    assert cb.truncation.min_p == _server_min_p(min_p_server)
    assert "sampler-truncation-unmatched" not in {f.code for f in cb.findings}
    assert "dtype-mismatch" not in {f.code for f in cb.findings}  # trl vllm-serve --dtype float32
    gaps = _trl_logp_gap(trainer)
    assert len(gaps) == 2 and max(gaps) < 1e-5, gaps


def test_another_safe_vocab_min_p_is_warned_against_the_servers(min_p_server, toy_model_path, tmp_path, caplog):
    """safe_vocab_min_p other than the server's cut: the warning names the server's processor and its value, not
    GRPOConfig.min_p=None, and the audit's finding carries the server's min-p."""
    with caplog.at_level("WARNING", logger="tim_plugins.trl"):
        trainer, cb = _run(min_p_server, toy_model_path, tmp_path, TIMConfig(safe_vocab=True, safe_vocab_min_p=1e-5),
                           steps=1)
    warned = [r.getMessage() for r in caplog.records if "safe_vocab_min_p=1e-05 differs" in r.getMessage()]
    assert len(warned) == 1 and f"tim_min_p={SERVER_MIN_P:g}" in warned[0], warned
    assert f"cuts at {SERVER_MIN_P:g}" in warned[0], warned
    (finding,) = [f for f in cb.findings if f.code == "sampler-truncation-unmatched"]
    assert finding.rollout_value == {"min_p": SERVER_MIN_P} and finding.trainer_value == {"min_p": 1e-5}, finding


@pytest.fixture(scope="module")
def raw_server(toy_model_path, tmp_path_factory):
    """A server that returns raw log-probs: `trl vllm-serve`'s processed_logprobs overridden (a later flag wins), as a
    plain `vllm serve` (which TRL now tells its users to run) returns them unless told otherwise."""
    log = tmp_path_factory.mktemp("vllm_raw_server") / "server.log"
    with serve(toy_model_path, log, ("--logprobs-mode", "raw_logprobs")) as base_url:
        yield base_url


def test_safe_vocab_refuses_a_server_without_processed_logprobs(raw_server, toy_model_path, tmp_path):
    """The safe vocabulary renormalises the trainer over the sampler's kept set; a server's raw log-probs are taken
    before the cut, so every ratio would read the kept mass (measured by hand: TRL's ratio mean 1.15 at top_p=0.8,
    the audit's logprobs-mode-not-processed logged and training on). Refused when the callback is created, with the
    server's value (its /server_info) and the fix."""
    info = requests.get(f"{raw_server}/server_info", params={"config_format": "json"}, timeout=10).json()
    mode = info["vllm_config"]["model_config"]["logprobs_mode"]
    assert mode == "raw_logprobs"
    mp = pytest.MonkeyPatch()
    (tmp_path / "synced").mkdir()
    patch_client(mp.setattr, tmp_path / "synced", [])
    try:
        trainer = make_trainer(toy_model_path, tmp_path, use_vllm=True, vllm_mode="server",
                               vllm_server_base_url=raw_server, vllm_server_timeout=60, max_steps=1, top_p=0.8,
                               min_p=1e-5)
        with pytest.raises(ValueError) as err:
            TIMCallback(trainer, TIMConfig(safe_vocab=True))
        TIMCallback(trainer, TIMConfig())  # the monitor alone attaches (its audit names the mode)
    finally:
        mp.undo()
    msg = str(err.value)
    assert f"logprobs_mode={mode!r}" in msg and "Fix: restart the server with --logprobs-mode processed_logprobs" in msg


def test_two_ranks_cut_and_judge_at_the_servers_min_p_alike(min_p_server, toy_model_path, tmp_path_factory):
    """Two ranks (tests/trl_server_two_procs_run.py): only the main process holds TRL's client and reads the server.
    ``safe_vocab``: every rank's safe vocabulary cuts at the server's min-p (before: the other rank read no server,
    found no cut, and refused TIMConfig(safe_vocab=True) while the main process went on), and both train every step.
    ``healthy`` (no safe vocabulary): the audit's errors the causes read (sampler-truncation-unmatched, the server's
    cut) are the main process's on both ranks (before: the other rank's were its own, without the server, so a cause
    the audit decides could be named on one rank alone)."""
    runs = _launch_two_procs(("healthy", "safe_vocab"), min_p_server, toy_model_path, tmp_path_factory)
    cut = _server_min_p(min_p_server)
    assert [r["safe_min_p"] for r in runs["safe_vocab"]] == [cut, cut]
    for config in ("healthy", "safe_vocab"):
        assert [r["global_step"] for r in runs[config]] == [3, 3]
        assert [r["causes"] for r in runs[config]] == [[], []]
    healthy = [r["audit_codes"] for r in runs["healthy"]]
    assert "sampler-truncation-unmatched" in healthy[0] and healthy[1] == healthy[0], healthy
    safe = [r["audit_codes"] for r in runs["safe_vocab"]]
    assert "sampler-truncation-unmatched" not in safe[0] and safe[1] == safe[0], safe
