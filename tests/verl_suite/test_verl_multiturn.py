"""verl's real multi-turn agent loop through its own ``python -m verl.trainer.main_ppo``: ``ToolAgentLoop``
(experimental/agent_loop/tool_agent_loop.py, ``rollout.agent.default_agent_loop=tool_agent``,
``rollout.multi_turn.enable=true``), trainer mode ``tim_sync`` with the monitor on, GRPO, FSDP2 actor, vLLM CPU-build
rollout, fp32 on both sides and a mismatch of known size injected from the first step (``cpu_site/inject_mismatch.py``:
the rollout's stored log-probs shifted by ±DELTA token by token). One run, STEPS steps.

Multi-turn without a tool-calling model: the toy model samples random text, so a test-only tool parser registered in
verl's own registry (``cpu_site/multiturn_tool.py``, ``multi_turn.format``) makes every assistant turn call a
test tool (a verl ``BaseTool`` from a tool config YAML) that answers a short fixed text; ``max_assistant_turns``
bounds the loop. verl's loop writes each tool answer (and the chat template's scaffolding around it) into the
response with ``response_mask`` 0, through its Continuous Token builder for the model's ``model_type`` (Qwen2: the
ChatML builder, which needs ``<|im_end|>``): the test model is the toy model with ChatML's two special tokens added
and a ChatML chat template (``chatml_toy_model``).

Reference, independent of tim's accumulators and turn keys: verl's own stored tensors, recorded by the driver after
each old-log-prob pass (``cpu_site/turn_probe.py``: ``response_mask``, ``rollout_log_probs``, ``old_log_probs``,
``num_turns``). Per step and turn (the environment segments before a token, counted token by token by
``naive_turns.turns_naive``) the test recomputes in float64 the count, k3 = mean(exp(d) - 1 - d), mean d, mean |d| and
max |d| with d = old - rollout over the ``response_mask`` tokens, and checks them against the logged
``tim/by_turn/<k>/*``; the turns also against verl's ``num_turns`` (per sample and ``training/num_turns/*``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("verl")
pytest.importorskip("vllm")

import main_ppo_run as M  # noqa: E402
from naive_turns import turns_naive  # noqa: E402

pytestmark = pytest.mark.slow

STEPS, DELTA = 3, 0.1
BATCH, N = 4, 2  # prompts per step, samples per prompt (base_overrides)
MAX_ASSISTANT_TURNS = 3
PROMPT_LEN, RESPONSE_LEN = 48, 80  # a ChatML-wrapped toy prompt is ~20 tokens; a turn ~5-15 tokens, a tool answer ~12
RUN_TIMEOUT_S = 900
REL = 1e-6
# d = ±DELTA per token plus fp32 noise (~1e-7): every turn's k3 lies between the two signs' values
K3_LO, K3_HI = math.exp(-DELTA) - 1 + DELTA, math.exp(DELTA) - 1 - DELTA

CHATML_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                   "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chatml_toy_model(src: Path, dst: Path) -> Path:
    """The toy model with ChatML's ``<|im_start|>`` / ``<|im_end|>`` added as special tokens (embeddings resized
    to the new vocabulary, 385: still odd) and a ChatML chat template that renders ``tool`` messages. verl's agent
    loop picks its Continuous Token builder by ``config.json`` ``model_type`` (qwen2 -> the Qwen/ChatML builder,
    utils/tokenizer/continuous_token_wiring.py), which requires ``<|im_end|>`` in the tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (dst / "config.json").exists():
        return dst
    tok = AutoTokenizer.from_pretrained(src)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(src, dtype="float32")
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    model.save_pretrained(dst)
    tok.save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def run(tmp_path_factory, toy_model_path):
    import multiturn_tool

    wd = tmp_path_factory.mktemp("verl_multiturn")
    model = chatml_toy_model(Path(toy_model_path), wd / "chatml_model")
    files = M.prepare(wd, model)
    assert files["model"] == model  # used in place: it has its own chat template
    tools = multiturn_tool.tool_config(wd / "tools.yaml")
    probe = wd / "turn_probe.jsonl"
    cpu = [o for o in M.CPU_OVERRIDES if not o.startswith("actor_rollout_ref.rollout.max_model_len=")]
    overrides = M.base_overrides(files, wd, steps=STEPS, batch=BATCH, n=N, response_length=RESPONSE_LEN,
                                 prompt_length=PROMPT_LEN) + cpu + [
        f"actor_rollout_ref.rollout.max_model_len={PROMPT_LEN + RESPONSE_LEN}",
        "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
        f"actor_rollout_ref.rollout.multi_turn.format={multiturn_tool.PARSER}",
        f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={MAX_ASSISTANT_TURNS}",
        "trainer.v1.trainer_mode=tim_sync",
        "+tim.monitor.enable=true",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
    ]
    result = M.run_main_ppo(overrides, cwd=wd, timeout=RUN_TIMEOUT_S, log_path=wd / "run.log",
                            extra_env={"TIM_TEST_INJECT_MISMATCH": f"1:{DELTA}", "TIM_TEST_TURN_PROBE": str(probe)})
    print(f"[verl_multiturn] exit {result.returncode} after {result.seconds:.0f} s; log {wd / 'run.log'}")
    if result.returncode != 0:
        pytest.fail(f"main_ppo failed (exit {result.returncode}):\n{result.output[-4000:]}")
    records = [json.loads(line) for line in probe.read_text().splitlines()]
    return result, {r["step"]: r["rows"] for r in records}, len(records)


def reference_by_turn(rows: list[dict]) -> dict[int, dict[str, float]]:
    """{turn: count, kl_k3, mean, abs_diff_mean, abs_diff_max} over the response_mask tokens of one step, in float64,
    the turn counted token by token (``turns_naive``)."""
    import torch

    acc: dict[int, list[float]] = {}
    for row in rows:
        mask = torch.tensor([row["mask"]], dtype=torch.long)
        turn = turns_naive(mask)[0].tolist()
        for m, k, r, t in zip(row["mask"], turn, row["rollout"], row["train"], strict=True):
            if not m:
                continue
            d = t - r
            a = acc.setdefault(k, [0.0, 0.0, 0.0, 0.0, 0.0])
            a[0] += 1
            a[1] += math.expm1(d) - d
            a[2] += d
            a[3] += abs(d)
            a[4] = max(a[4], abs(d))
    return {k: {"count": n, "kl_k3": k3 / n, "mean": s / n, "abs_diff_mean": ab / n, "abs_diff_max": mx}
            for k, (n, k3, s, ab, mx) in sorted(acc.items())}


def logged_by_turn(m: dict) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for key, value in m.items():
        if key.startswith("tim/by_turn/"):
            _, _, label, stat = key.split("/")
            out.setdefault(int(label), {})[stat] = value  # labels 0 .. 7 (8+ is out of reach here)
    return dict(sorted(out.items()))


def test_a_mismatch_present_from_the_first_step_names_no_cause(run):
    """A constant mismatch (±DELTA from step 1) is numerics, not a cause: no floor jump (there is no earlier floor
    to jump from), no confident disagreement (DELTA is far below the rule's gap), every tensor synced."""
    result, _, _ = run
    assert result.causes() == []
    for step, m in result.steps.items():
        assert m["tim/cause/named"] == 0.0 and m["tim/cause/confident_disagreements"] == 0.0, step
        assert m["tim/cause/sync_bad_tensors"] == 0.0 and m["tim/cause/sync_checked_tensors"] > 0, step


def test_the_run_recorded_one_batch_per_step(run):
    result, probe, n_records = run
    assert sorted(result.steps) == list(range(1, STEPS + 1))
    assert n_records == STEPS and sorted(probe) == list(range(1, STEPS + 1))
    for step, rows in probe.items():
        assert len(rows) == BATCH * N and not any(r["padding"] for r in rows), step


def test_per_turn_mismatch_equals_verls_own_tensors(run):
    result, probe, _ = run
    for step in range(1, STEPS + 1):
        m = result.steps[step]
        ref, logged = reference_by_turn(probe[step]), logged_by_turn(m)
        print(f"[verl_multiturn] step {step}: " + ", ".join(
            f"turn {k}: n={int(v['count'])} k3={v['kl_k3']:.6e} max|d|={v['abs_diff_max']:.4f}"
            for k, v in ref.items()))
        assert sorted(logged) == sorted(ref), (step, sorted(logged), sorted(ref))
        for k, want in ref.items():
            got = logged[k]
            assert got["count"] == want["count"], (step, k)
            for stat in ("kl_k3", "abs_diff_max", "abs_diff_mean"):
                assert got[stat] == pytest.approx(want[stat], rel=REL), (step, k, stat)
            assert got["mean"] == pytest.approx(want["mean"], rel=REL, abs=1e-12), (step, k)
            # the injected mismatch, in every turn
            assert K3_LO * (1 - 1e-3) <= want["kl_k3"] <= K3_HI * (1 + 1e-3), (step, k, want["kl_k3"])
            assert want["abs_diff_max"] == pytest.approx(DELTA, rel=1e-3), (step, k)
        # every monitored token is in exactly one turn
        assert sum(v["count"] for v in logged.values()) == m["tim/tokens"], step


def test_several_turns_occurred_and_match_verls_num_turns(run):
    import torch

    result, probe, _ = run
    seen = set()
    for step in range(1, STEPS + 1):
        m, rows = result.steps[step], probe[step]
        turns = sorted(logged_by_turn(m))
        seen |= set(turns)
        assert turns == list(range(len(turns))), (step, turns)  # turns 0, 1, ... without a gap
        # verl's num_turns = user (tool) turns + assistant turns + 1 (the prompt), ToolAgentLoop.run; every tool
        # answer that fits in the response is followed by another assistant turn: num_turns = 2 * tool answers + 2,
        # and the last turn of a sample is its number of tool answers in the response
        for row in rows:
            mask = np.asarray(row["mask"])
            last_model_token = int(np.nonzero(mask)[0].max())
            last_turn = int(turns_naive(torch.tensor([row["mask"]]))[0, last_model_token])
            assert row["num_turns"] == 2 * last_turn + 2, (step, row["num_turns"], last_turn)
            assert 0 <= last_turn < MAX_ASSISTANT_TURNS
        num_turns = np.array([r["num_turns"] for r in rows], dtype=np.float64)
        assert m["training/num_turns/max"] == num_turns.max() and m["training/num_turns/min"] == num_turns.min()
        assert m["training/num_turns/mean"] == pytest.approx(num_turns.mean(), rel=1e-12)
        # the turn keys logged are those of the sample with the most turns
        assert len(turns) == m["training/num_turns/max"] / 2, (step, turns, m["training/num_turns/max"])
    assert {0, 1} <= seen, seen  # the agent loop took more than one turn
