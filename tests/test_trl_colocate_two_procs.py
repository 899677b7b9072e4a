"""The weight-sync check in TRL's vLLM colocate mode with two processes (CPU, gloo, ``torch.distributed.run``), each
rank with its own vLLM engine (the CPU build, TRL's own ``LLM(distributed_executor_backend="external_launcher",
seed=process_index)``) and its own TIMCallback, under DDP and under FSDP2.

One launch (tests/trl_colocate_two_procs_run.py; bounded in time, its process group killed at the end:
tests/bounded.py) runs four ``GRPOTrainer.train()`` one after the other in the same two processes:

- fault-free, DDP and FSDP2 (``fsdp_config={"version": 2}``, applied on a CPU launch by tests/cpu_fsdp2.py; TRL
  streams ``param.full_tensor()`` per parameter, and the check compares what is streamed): both ranks' syncs are
  checked, every parameter of each, and nothing is named;
- rank 1's engine loader drops layer 1's tensors at the sync after optimizer step 1 (rank 0's syncs untouched;
  installed test-side under the callback's wrappers), with ``TIMConfig(parity_probe=True, action="stop")``: rank 1's
  check names ``sync-tensors-stale`` with exactly those tensors, rank 0's check finds its own engine fine, the cause
  metrics of the log rows are the merged ones on both ranks, both ranks stop at step 2 and the launch exits cleanly
  within its bound.

A second launch runs the fault-free and the faulty run with ``GRPOConfig(vllm_tensor_parallel_size=2)``: the two
ranks form one tensor-parallel group of one engine (TRL's ``distributed_executor_backend="external_launcher"``,
``seed=process_index // 2``: 0 on both), each rank holding its shard in-process (vLLM's TP group of both ranks, half
the input features of o / down, half the rows of q and gate / up, half the padded vocabulary; the one KV head
replicated). TRL's sync has each rank load full tensors; each rank's check reads only the elements its shard holds.
Fault-free, both ranks check every tensor at every sync (none unread) and name nothing; with rank 1's loader dropping
layer 1 at the sync after step 1, rank 1's check names exactly those tensors, rank 0 names them as rank 1's ("(on rank
1)"), and both stop at step 2. The same tests as above run on it (``mode="tp2"``), the engines' references being
each rank's shard of the trainer's parameters, sliced from the model's config as vLLM shards them (``_tp_shard``).

References, independent of the check: the names the fault dropped (recorded as it dropped them) and the trainer's
parameter names; the trainer's whole parameters at each sync (FSDP2 shards gathered) against each rank's engine
parameters read directly after training, q/k/v and gate/up stacked as vLLM merges them, cast to the engine's dtype:
after a fault-free run each engine holds the last sync's weights; after the fault, rank 1's engine holds layer 1 of
the sync before and the rest of the faulty sync, rank 0's the faulty sync's whole.

Test-side shims (tests/trl_cpu_vllm.py): ``keep_plain_linear_weights`` (TRL 1.16's ``model.load_weights`` fails on
the CPU build's packed linear weights, trl/generation/vllm_generation.py L511), the engine's KV cache size, and one
engine per rank for the launch's trainers (the first trainer's TRL call builds it; each run's first sync loads that
run's initial weights; a later trainer gets it back with the global RNG seeded as a new engine's worker seeds it:
TRL seeds it per process just before, trl/trainer/grpo_trainer.py L1103, and the ranks of one TP engine must sample
the same tokens).

Cost on the shared 2-core machine: ~45 s for the first launch when idle (each rank's start with its engine ~27 s,
then the four runs ~1-3 s each), ~35-40 s for the TP=2 one (its two runs ~1 s); ~0.95 GiB peak RSS per rank.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("vllm")
pytest.importorskip("datasets")
torch = pytest.importorskip("torch")

from bounded import run_bounded  # noqa: E402
from trl_colocate_two_procs_run import (COLUMNS_TP2, CONFIGS, FAULT_RANK, FAULT_STEP, SKIPPED, STEPS,  # noqa: E402
                                        TP2_CONFIGS)

pytestmark = [pytest.mark.trl, pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
RUNNER = Path(__file__).with_name("trl_colocate_two_procs_run.py")
TIMEOUT_S = 400  # ~45 s idle; several times that under other load. A hang (a rank waiting on the other) ends here.
RANKS = (0, 1)
MODES = ("ddp", "fsdp2", "tp2")  # the fault-free runs and the runs with a fault set by the test
# TRL 1.16's FSDP1 sync leaves out the root unit's parameters: its run (no fault set) is checked apart
ROOT_UNIT = ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]
MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}  # Qwen2's packing
VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE: the vocabulary is padded to a multiple of it, then split


def _launch(configs: tuple, model, out: Path) -> dict:
    """One launch of ``configs``: {config: {"ranks": [rank_r.json], "tensors": [rank_r.pt], "dump": folder}}, its
    wall time and output. It must end by itself, with exit status 0, within TIMEOUT_S."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(RUNNER),
           "--model", str(model), "--out", str(out), "--config", ",".join(configs)]
    t0 = time.time()
    proc, timed_out = run_bounded(cmd, TIMEOUT_S, cwd=ROOT)
    wall = time.time() - t0
    assert not timed_out, f"ran past {TIMEOUT_S} s and was killed (a rank waiting on the other):\n{proc.stdout[-4000:]}"
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-6000:]}"
    print(f"\n[trl colocate 2 procs {','.join(configs)}] {wall:.0f} s wall")
    runs = {}
    for config in configs:
        folder = out / config
        ranks = [json.loads((folder / f"rank_{r}.json").read_text()) for r in RANKS]
        tensors = [torch.load(folder / f"rank_{r}.pt") for r in RANKS]
        print(f"[trl colocate 2 procs {config}] set-up {ranks[0]['init_s']:.0f} s, train {ranks[0]['train_s']:.1f} s, "
              f"peak RSS per rank {max(r['peak_rss_mib'] for r in ranks):.0f} MiB")
        runs[config] = {"ranks": ranks, "tensors": tensors, "dump": folder / "dump"}
    return {"runs": runs, "stdout": proc.stdout, "wall": wall, "configs": configs}


@pytest.fixture(scope="module")
def launch_own_engines(toy_model_path, tmp_path_factory):
    """DDP, FSDP2 and FSDP1, each rank with its own engine: one launch."""
    return _launch(CONFIGS, toy_model_path, tmp_path_factory.mktemp("trl_colocate2"))


@pytest.fixture(scope="module")
def launch_tp2(toy_model_path, tmp_path_factory):
    """``vllm_tensor_parallel_size=2``: both ranks share one engine (vLLM's process groups are set once per process:
    a launch of its own)."""
    return _launch(TP2_CONFIGS, toy_model_path, tmp_path_factory.mktemp("trl_colocate2_tp2"))


@pytest.fixture
def launch(request):
    """The launch that ran the test's ``mode``."""
    mode = request.node.callspec.params["mode"]
    return request.getfixturevalue("launch_tp2" if mode == "tp2" else "launch_own_engines")


@pytest.fixture(scope="module")
def toy_config(toy_model_path) -> dict:
    return json.loads((Path(toy_model_path) / "config.json").read_text())


def _sync_steps(tensors: dict) -> list[int]:
    return [step for step, _ in tensors["snapshots"]]


def _snapshot(tensors: dict, step: int) -> dict:
    (params,) = [p for s, p in tensors["snapshots"] if s == step]
    return params


def _tp_shard(name: str, value, config: dict, tp: int, rank: int):
    """The part of the trainer's ``value`` of ``name`` that tensor-parallel rank ``rank`` of ``tp`` holds, from the
    model's config alone: q / gate / up split by rows (output features), o / down weights by columns (input
    features), k / v by rows unless there are fewer KV heads than ranks (then each rank holds them whole), the
    vocabulary padded to a multiple of VOCAB_PADDING and split by rows (this rank's rows of the real vocabulary),
    norms whole. ``tp`` = 1: ``value``."""
    if tp == 1:
        return value
    module = name.rsplit(".", 2)[-2]
    if module in ("q_proj", "gate_proj", "up_proj"):
        return value.chunk(tp, dim=0)[rank]
    if module in ("k_proj", "v_proj"):
        kv_heads = config["num_key_value_heads"]
        if kv_heads >= tp:
            return value.chunk(tp, dim=0)[rank]
        return value.chunk(kv_heads, dim=0)[rank * kv_heads // tp]  # a KV head replicated over tp / kv_heads ranks
    if module in ("o_proj", "down_proj") and name.endswith(".weight"):
        return value.chunk(tp, dim=1)[rank]
    if module in ("embed_tokens", "lm_head"):
        vocab = config["vocab_size"]
        per_rank = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING // tp
        return value[rank * per_rank: min((rank + 1) * per_rank, vocab)]
    return value


def _engine_vs(tensors: dict, reference, config: dict, tp: int = 1, rank: int = 0) -> dict:
    """{trainer name: whether the engine's tensor holding it equals ``reference(name)`` cast to the engine's dtype},
    every engine parameter read whole (vLLM's merged q/k/v and gate/up split back by the trainer's shapes; the
    vocabulary padding cut off); with tensor-parallel rank ``rank`` of ``tp``, the reference is its shard of
    ``reference(name)`` (``_tp_shard``)."""
    out = {}
    for name, held in tensors["engine"].items():
        module, _, leaf = name.rpartition(".")
        parent, _, last = module.rpartition(".")
        parts = [".".join(x for x in (parent, p, leaf) if x) for p in MERGED.get(last, (last,))]
        values = [_tp_shard(p, reference(p), config, tp, rank) for p in parts]
        rows = [v.shape[0] for v in values]
        held = held[: sum(rows)]  # the embedding and lm_head: vLLM pads the vocabulary
        assert held.shape[0] == sum(rows), name
        for part, value, piece in zip(parts, values, torch.split(held, rows)):
            assert piece.shape == value.shape, (part, piece.shape, value.shape)
            out[part] = torch.equal(piece, value.to(held.dtype))
    return out


def _tp(run: dict) -> int:
    """The size of vLLM's tensor-parallel group the run's engines were built with (rank 0's)."""
    return run["ranks"][0]["engine"]["groups"]["tp"][0]


def _logged(rank: dict) -> dict:
    """{step: the step's log row} (the training rows: the final summary row has no tim/ keys)."""
    return {h["step"]: h for h in rank["log_history"] if "tim/cause/named" in h}


# ------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("mode", ("ddp", "fsdp2", "fsdp1"))
def test_each_rank_trains_with_its_own_engine(launch, mode):
    fsdp = mode.startswith("fsdp")
    for config in [c for c in (f"{mode}_clean", f"{mode}_fault") if c in launch["runs"]]:
        for r, rank in enumerate(launch["runs"][config]["ranks"]):
            assert rank["rank"] == r and rank["world_size"] == 2 and rank["backend"] == "gloo"
            assert rank["distributed_type"] == ("FSDP" if fsdp else "MULTI_CPU")
            assert rank["is_fsdp_enabled"] is fsdp and rank["fsdp_version"] == {"fsdp2": 2, "fsdp1": 1}.get(mode)
            assert rank["lm_head_class"] == ("DTensor" if mode == "fsdp2" else "Parameter")  # sharded under FSDP2
            engine = rank["engine"]
            # TRL's colocate LLM(...): seed = process_index // tensor_parallel_size, in-process (external launcher)
            assert engine["seed"] == r and engine["executor_backend"] == "external_launcher"
            assert engine["reader_is_this_engine"]  # the check reads this rank's engine
            # vLLM on the torchrun world: a tensor-parallel group and a data-parallel group of this rank alone
            assert engine["groups"] == {"world": [2, r], "tp": [1, 0], "dp": [1, 0]}
            assert not rank["diag"], rank["diag"]  # no sync_check_failed / _unavailable / _unread, nothing else


@pytest.mark.parametrize("mode", ("tp2",))
def test_both_ranks_share_one_tensor_parallel_engine(launch, mode, toy_config):
    """``GRPOConfig(vllm_tensor_parallel_size=2)``: the two ranks form one tensor-parallel group of one engine, each
    holding its shard in-process, and each rank's check reads its own shard and nothing else."""
    for config in TP2_CONFIGS:
        run = launch["runs"][config]
        for r, (rank, tensors) in enumerate(zip(run["ranks"], run["tensors"])):
            assert rank["rank"] == r and rank["world_size"] == 2 and rank["backend"] == "gloo"
            assert rank["distributed_type"] == "MULTI_CPU" and not rank["is_fsdp_enabled"]
            engine = rank["engine"]
            # TRL's colocate LLM(...): seed = process_index // tensor_parallel_size, the same on both ranks
            assert engine["seed"] == 0 and engine["executor_backend"] == "external_launcher"
            assert engine["reader_is_this_engine"]
            # vLLM on the torchrun world: one tensor-parallel group of both ranks, this rank its r-th member
            assert engine["groups"] == {"world": [2, r], "tp": [2, r], "dp": [1, 0]}
            # a shard, not the whole: half the input features of o / down, half the rows of gate / up
            trainer = _snapshot(tensors, 0)
            for layer in range(toy_config["num_hidden_layers"]):
                at = f"model.layers.{layer}."
                down, o = trainer[f"{at}mlp.down_proj.weight"], trainer[f"{at}self_attn.o_proj.weight"]
                assert tensors["engine"][f"{at}mlp.down_proj.weight"].shape == (down.shape[0], down.shape[1] // 2)
                assert tensors["engine"][f"{at}self_attn.o_proj.weight"].shape == (o.shape[0], o.shape[1] // 2)
                gate = trainer[f"{at}mlp.gate_proj.weight"]
                assert tensors["engine"][f"{at}mlp.gate_up_proj.weight"].shape == (gate.shape[0], gate.shape[1])
            # every tensor of every sync read on this rank's shard: none unread (sync_check_unread), nothing else,
            # although the run set one column per matrix (a row-parallel weight's other half would hold none): the
            # check took SyncCheckConfig.for_tensor_parallel(2), two columns, 64 elements
            assert not rank["diag"], rank["diag"]
            assert COLUMNS_TP2 == 1 and rank["check_grid"] == [2, 64]


@pytest.mark.parametrize("mode", MODES)
def test_fault_free_every_sync_of_both_ranks_is_checked_and_nothing_named(launch, mode):
    run = launch["runs"][f"{mode}_clean"]
    checked = 0
    for rank, tensors in zip(run["ranks"], run["tensors"]):
        assert _sync_steps(tensors) == list(range(STEPS))  # TRL syncs before each step's generation
        names = sorted(_snapshot(tensors, 0))  # the trainer's parameters under vLLM's names (TRL's name fix)
        reports = rank["reports"]
        assert [x["step"] for x in reports] == list(range(STEPS))
        for report in reports:
            assert sorted(report["statuses"]) == names and set(report["statuses"].values()) == {"ok"}
            assert report["causes"] == [] and report["bad"] == 0 and report["checked"] == len(names)
            assert report["not_sent"] == []  # DDP: every expected name was streamed; FSDP2: no expectation
        checked += len(reports)
        assert rank["named"] == [] and rank["cause_lines"] == [] and rank["trips"] == []
        logged = _logged(rank)
        assert sorted(logged) == list(range(1, STEPS + 1)) and rank["global_step"] == STEPS
        for row in logged.values():
            assert row["tim/cause/named"] == 0 and row["tim/cause/sync_bad_tensors"] == 0
            assert row["tim/cause/sync_checked_tensors"] == len(names)
    assert checked == 2 * STEPS
    assert not (run["dump"] / "causes.jsonl").exists()


@pytest.mark.parametrize("mode", MODES)
def test_fault_free_each_engine_holds_the_trainers_weights(launch, mode, toy_config):
    """The independent read: each rank's engine (tp2: its tensor-parallel shard of the shared engine), after
    training, holds the trainer's parameters at the last sync (and not those of the first: the check had something
    to find)."""
    run = launch["runs"][f"{mode}_clean"]
    tp = _tp(run)
    last = [_snapshot(t, STEPS - 1) for t in run["tensors"]]
    assert all(torch.equal(last[0][n], last[1][n]) for n in last[0])  # the ranks' replicas (gathered shards) agree
    for r, (tensors, params) in enumerate(zip(run["tensors"], last)):
        same = _engine_vs(tensors, params.__getitem__, toy_config, tp, r)
        assert sorted(same) == sorted(params) and all(same.values()), [n for n, ok in same.items() if not ok]
        first = _engine_vs(tensors, _snapshot(tensors, 0).__getitem__, toy_config, tp, r)
        assert sum(not ok for ok in first.values()) >= len(first) - 2  # trained: the engine's precision shows it


@pytest.mark.parametrize("mode", MODES)
def test_a_fault_on_one_rank_is_named_with_its_tensors_on_that_rank(launch, mode):
    run = launch["runs"][f"{mode}_fault"]
    names = sorted(_snapshot(run["tensors"][0], 0))
    skipped = sorted(n for n in names if n.startswith(SKIPPED))
    faulty, fine = run["ranks"][FAULT_RANK], run["ranks"][1 - FAULT_RANK]
    assert {int(k): sorted(v) for k, v in faulty["dropped"].items()} == {FAULT_STEP: skipped} and len(skipped) == 12
    assert fine["dropped"] == {}
    # each rank's check read its own engine: rank 1's found the dropped layer, rank 0's nothing
    by_step = {x["step"]: x for x in faulty["reports"]}
    assert sorted(by_step) == list(range(FAULT_STEP + 1))  # the syncs before the stop
    report = by_step[FAULT_STEP]
    assert [c["code"] for c in report["causes"]] == ["sync-tensors-stale"]
    assert sorted(report["causes"][0]["tensors"]) == skipped
    assert sorted(n for n, s in report["statuses"].items() if s != "ok") == skipped and report["bad"] == 12
    assert sorted(report["statuses"]) == names
    assert all(x["causes"] == [] for x in faulty["reports"] if x["step"] != FAULT_STEP)
    assert all(x["causes"] == [] and x["bad"] == 0 for x in fine["reports"])
    # rank 1's console line names the layer at the faulty sync
    (line,) = faulty["cause_lines"]
    assert line.startswith(f"tim-plugins cause [sync-tensors-stale] at step {FAULT_STEP}: ") and "Fix (TRL):" in line
    assert f"{SKIPPED}* (12 tensors)" in line
    assert [(c["code"], c["step"], sorted(c["tensors"])) for c in faulty["named"]] == [
        ("sync-tensors-stale", FAULT_STEP, skipped)]


@pytest.mark.parametrize("mode", MODES)
def test_the_engines_hold_what_the_checks_said(launch, mode, toy_config):
    """Independent of the check: after the stop, rank 1's engine (tp2: its shard) holds layer 1 as the sync before
    the fault sent it and the rest as the faulty sync did; rank 0's engine (its shard) holds the faulty sync's
    weights whole."""
    run = launch["runs"][f"{mode}_fault"]
    tp = _tp(run)
    for r, tensors in enumerate(run["tensors"]):
        assert _sync_steps(tensors) == list(range(FAULT_STEP + 1))
        now, before = _snapshot(tensors, FAULT_STEP), _snapshot(tensors, FAULT_STEP - 1)
        dropped = r == FAULT_RANK
        same = _engine_vs(tensors, lambda n: before[n] if dropped and n.startswith(SKIPPED) else now[n],
                          toy_config, tp, r)
        assert sorted(same) == sorted(now) and all(same.values()), (r, [n for n, ok in same.items() if not ok])
        # the faulty sync's values of layer 1, in the engine's precision, are not the sync before's: on rank 1 none
        # of its tensors holds them, on rank 0 all do (the check had something to tell apart)
        as_sent = _engine_vs(tensors, now.__getitem__, toy_config, tp, r)
        assert {ok for n, ok in as_sent.items() if n.startswith(SKIPPED)} == {not dropped}


@pytest.mark.parametrize("mode", MODES)
def test_a_fault_on_one_rank_reaches_both_ranks_log_rows_and_stops_both(launch, mode):
    run = launch["runs"][f"{mode}_fault"]
    stop = FAULT_STEP + 1  # the faulty sync precedes this step's generation; its window names the cause
    rows = [_logged(rank) for rank in run["ranks"]]
    for rank, logged in zip(run["ranks"], rows):
        assert rank["global_step"] == stop < STEPS + 1  # stopped, before max_steps
        assert rank["trips"] == [{"key": "tim/cause/named", "step": stop}]
        assert sorted(logged) == list(range(1, stop + 1))
        assert logged[stop - 1]["tim/cause/named"] == 0 and logged[stop - 1]["tim/cause/sync_bad_tensors"] == 0
        # merged over the ranks: rank 0's own check found 0 bad tensors, rank 1's the dropped layer
        assert logged[stop]["tim/cause/named"] == 1 and logged[stop]["tim/cause/sync_bad_tensors"] == 12
        assert logged[stop]["tim/cause/sync_checked_tensors"] == 27 and logged[stop]["tim/probe/tripped"] == 1
    for step in rows[0]:  # the ranks log the same merged cause metrics
        tim = {k: v for k, v in rows[0][step].items() if k.startswith(("tim/cause/", "tim/probe/"))}
        assert tim == {k: v for k, v in rows[1][step].items() if k.startswith(("tim/cause/", "tim/probe/"))}
    # rank 0 names rank 1's cause as rank 1 named it (the faulty sync's step, the dropped tensors), in its window
    fine, faulty = run["ranks"][1 - FAULT_RANK], run["ranks"][FAULT_RANK]
    skipped = sorted(n for n in _snapshot(run["tensors"][0], 0) if n.startswith(SKIPPED))
    assert [(c["code"], c["step"], sorted(c["tensors"])) for c in fine["named"]] == [
        ("sync-tensors-stale", FAULT_STEP, skipped)]
    assert fine["named"][0]["message"] == f"{faulty['named'][0]['message']} (on rank {FAULT_RANK})"
    # and so does its console line, which the user reads
    (line,) = fine["cause_lines"]
    assert line.startswith(f"tim-plugins cause [sync-tensors-stale] at step {FAULT_STEP}: ")
    assert f"{SKIPPED}* (12 tensors)" in line and f"(on rank {FAULT_RANK})" in line
    # beside the dump (rank 0 writes it), for the report: with the tensors
    causes = [json.loads(x) for x in (run["dump"] / "causes.jsonl").read_text().splitlines()]
    assert [(c["code"], c["window"], c["step"], sorted(c["tensors"])) for c in causes] == [
        ("sync-tensors-stale", stop, FAULT_STEP, skipped)]
    # both ranks said they stop; the launch ended by itself (the fixture), after both ranks wrote their results
    stops = re.findall(rf"parity probe tripped at step {stop} \(tim/cause/named=1\); stopping training",
                       launch["stdout"])
    assert len(stops) == 2 * sum(c.endswith("_fault") for c in launch["configs"])


def test_fsdp1_trls_sync_leaves_out_the_root_units_parameters_and_the_check_names_them(launch_own_engines, toy_config):
    """Under FSDP1, TRL 1.16's sync (``_iter_fsdp1_params``) walks the model it was given at ``GRPOTrainer.__init__``,
    before accelerate wrapped it: the layers' FSDP units are inside it, the root unit (the embeddings, the final norm,
    the lm_head) is not, so those three are never sent and the engine keeps the initial ones. The check (the names
    of the trainable parameters expected, no trainer value compared under sharding) names exactly those three stale
    at every sync after an optimizer step, on both ranks. Reference, independent of the check: each engine read
    directly after training holds the initial values of those three and the last sync's of everything else."""
    run = launch_own_engines["runs"]["fsdp1_clean"]
    for r, (rank, tensors) in enumerate(zip(run["ranks"], run["tensors"])):
        assert rank["distributed_type"] == "FSDP" and rank["fsdp_version"] == 1
        reports = {x["step"]: x for x in rank["reports"]}
        assert sorted(reports) == list(range(STEPS))
        for step, report in reports.items():
            assert sorted(report["not_sent"]) == ROOT_UNIT, step
            bad = sorted(n for n, st in report["statuses"].items() if st != "ok")
            if step == 0:  # the engine loaded the same initial weights: nothing to name yet
                assert bad == [] and report["causes"] == []
                continue
            assert bad == ROOT_UNIT and {report["statuses"][n] for n in bad} == {"stale"}
            assert [(c["code"], sorted(c["tensors"])) for c in report["causes"]] == [("sync-tensors-stale", ROOT_UNIT)]
            assert "(3 of them never sent)" in report["causes"][0]["message"]
        first, last = _snapshot(tensors, 0), _snapshot(tensors, STEPS - 1)
        same = _engine_vs(tensors, lambda n: first[n] if n in ROOT_UNIT else last[n], toy_config)
        assert sorted(same) == sorted(last) and all(same.values()), (r, [n for n, ok in same.items() if not ok])
        assert not any(torch.equal(first[n], last[n]) for n in ROOT_UNIT)  # the trainer moved them
        logged = _logged(rank)
        assert [logged[step]["tim/cause/named"] for step in sorted(logged)] == [0] + [1] * (STEPS - 1)

