"""One source of truth: README tables and CI agree with the code."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from tim_plugins.apps.measure import MeasureConfig
from tim_plugins.metrics import PROB_BUCKET_EDGES, mismatch_metrics

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOC_PAGES = sorted((ROOT / "docs").glob("*.md"))
# the README (a front page) and the reference pages under docs/ it links to, where every section lives once
DOCS = "\n".join([README, *(p.read_text() for p in DOC_PAGES)])


def _section(name: str) -> str:
    parts = DOCS.split(f"<!-- section:{name} -->")
    if len(parts) != 2:
        raise AssertionError(f"section {name!r} appears {len(parts) - 1} times in README.md + docs/*.md (once expected)")
    return parts[1].split(f"<!-- /section:{name} -->")[0]


def test_readme_links_every_docs_page_and_every_link_resolves():
    for page in DOC_PAGES:
        assert f"](docs/{page.name})" in README, page.name
    for source in [ROOT / "README.md", *DOC_PAGES]:
        text = re.sub(r"`[^`\n]*`", "", source.read_text())  # code spans hold no links
        for target in re.findall(r"\]\(([^)#]+?)(?:#[^)]*)?\)", text):
            if target.startswith(("http://", "https://")):
                continue
            assert (source.parent / target).exists(), f"{source.name}: link to {target}"


def test_metric_reference_lists_exactly_the_keys_the_monitor_emits():
    documented = set()
    for line in _section("metrics").splitlines():
        if line.startswith("| `tim/"):
            cell = line.split("|")[1]
            keys = re.findall(r"`([^`]+)`", cell)
            base = None
            for k in keys:
                if k.startswith("..."):
                    k = base.rsplit("/", 1)[0] + k[3:]
                base = k
                documented.add(k)
    r = torch.log_softmax(torch.randn(2, 5, 7), -1)[..., 0]
    emitted = set(mismatch_metrics(r, r + 0.1, None, is_weights=torch.ones(2, 5)))
    # the staleness / mismatch split of the loss passes (StepPipeline.loss_pass)
    from tim_plugins.pipeline import PipelineConfig, StepPipeline

    from tim_plugins.causes import CauseConfig

    pipe = StepPipeline(PipelineConfig(staleness=True, by_position=True, by_turn=True, compile=False,
                                       causes=CauseConfig()))
    pipe.measure(r, r + 0.1, torch.ones(2, 5, dtype=torch.bool), turn=torch.zeros(2, 5, dtype=torch.long))
    pipe.loss_pass(r, r + 0.1, r + 0.2, torch.ones(2, 5, dtype=torch.bool), lag=torch.zeros(2, 5, dtype=torch.long))
    by_key = ("tim/staleness/", "tim/split/", "tim/by_position/", "tim/by_lag/", "tim/by_turn/", "tim/cause/")
    emitted |= {k for k in pipe.compute(1, sync=False)[0] if k.startswith(by_key)}
    labels = {"tim/by_position/<label>": [f"tim/by_position/{x}" for x in ("0", "1", "2-3", "4-7")],
              "tim/by_lag/<label>": ["tim/by_lag/0"], "tim/by_turn/<label>": ["tim/by_turn/0"]}  # the buckets filled
    buckets = {f"tim/by_prob/{lo:g}-{hi:g}" for lo, hi in zip(PROB_BUCKET_EDGES[:-1], PROB_BUCKET_EDGES[1:])}
    expanded = set()
    for k in documented:
        if "<lo>-<hi>" in k:
            expanded |= {k.replace("tim/by_prob/<lo>-<hi>", b) for b in buckets}
        elif "<label>" in k:
            stem = k.split("/<label>/")[0] + "/<label>"
            expanded |= {k.replace(stem, b) for b in labels[stem]}
        else:
            expanded.add(k)
    assert expanded == emitted
    edges = ", ".join(f"{e:g}" for e in PROB_BUCKET_EDGES)
    assert f"edges {edges}" in _section("metrics")


def test_default_log_keys_in_the_docs_are_the_code_s():
    from tim_plugins.log_keys import STEP_FAMILIES, STEP_KEYS

    named = re.findall(r"`(tim/[^`]*)`", _section("default-log"))
    assert sorted(named) == sorted(STEP_KEYS + STEP_FAMILIES)


def test_the_verl_docs_print_the_installed_recipe_path():
    """docs/verl.md's command prints where the recipe is inside the installed package (tests/test_packaging.py: the
    wheel holds it at the same place), and that file is the recipe."""
    import subprocess
    import sys

    line = next(x for x in (ROOT / "docs" / "verl.md").read_text().splitlines()
                if x.startswith('python -c "import tim_plugins.integrations.verl'))
    code = line.split('python -c "', 1)[1].rsplit('"', 1)[0]
    printed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    # a wheel installs it as tim_plugins/integrations/verl/...; this editable install maps that package to integrations/
    assert printed.endswith("integrations/verl/recipes/run_grpo_tim.sh")
    recipe = ROOT / "integrations" / "verl" / "recipes" / "run_grpo_tim.sh"
    assert Path(printed).read_bytes() == recipe.read_bytes()
    assert "`tim_plugins/integrations/verl/recipes/run_grpo_tim.sh`" in _section("verl")


def test_measure_defaults_in_readme_match_the_config():
    text = _section("measure")
    cfg = MeasureConfig()
    assert f"| `--rollout` | `{cfg.rollout}` |" in text
    assert f"| `--trainer-dtype` | `{cfg.trainer_dtype}` |" in text
    row = f"| {cfg.num_prompts}, {cfg.max_new_tokens}, {cfg.batch_size}, {cfg.seed}, `{cfg.out}` |"
    assert row in text
    assert f"| {cfg.temperature:g}, {cfg.top_p:g}, {cfg.top_k}, {cfg.min_p:g} |" in text


def test_ci_runs_the_readme_test_command():
    quickstart = README.split("## Quickstart")[1].split("```")[1]
    test_cmd = [line.split("#")[0].strip() for line in quickstart.splitlines() if "test" in line][0]
    assert test_cmd == "make test"
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, re.M)


def test_lr_decay_defaults_in_readme_match_the_config():
    from tim_plugins.lr_control import LRDecayConfig

    cfg = LRDecayConfig()
    rows = {}
    for line in _section("mitigations").splitlines():
        m = re.match(r"^\| (`[^|]+`) \| ([^|]+) \|", line)
        if m and m.group(1) != "`mode`":
            names = re.findall(r"`([a-z_0-9]+)`", m.group(1))
            values = [v.strip() for v in m.group(2).split(",")]
            if len(names) == len(values) and all(hasattr(cfg, n) for n in names):
                rows.update(zip(names, values))
    assert len(rows) >= 10, rows
    for name, text in rows.items():
        assert float(text) == float(getattr(cfg, name)), (name, text, getattr(cfg, name))


def test_default_min_p_in_readme_matches_the_code():
    from tim_plugins.safe_vocab import DEFAULT_MIN_P

    m = re.search(r"`DEFAULT_MIN_P = ([0-9.e-]+)`", _section("safe-vocab"))
    assert m and float(m.group(1)) == DEFAULT_MIN_P


def test_readme_verl_overrides_are_the_recipe_s():
    """The drop-in block in the README's verl section is exactly what the recipe (and so the end-to-end test,
    tests/verl_suite/test_verl_main_ppo.py) passes to main_ppo."""
    import os
    import subprocess

    recipe = ROOT / "integrations" / "verl" / "recipes" / "run_grpo_tim.sh"
    blocks = _section("verl-overrides").split("```diff")[1:]
    assert len(blocks) == 2  # FSDP (the recipe's default), then STRATEGY=megatron
    for block, strategy in zip(blocks, ("fsdp2", "megatron")):
        out = subprocess.run(["bash", str(recipe)], env=dict(os.environ, TIM_PRINT_OVERRIDES="tim", STRATEGY=strategy),
                             capture_output=True, text=True, check=True).stdout
        block = block.split("```")[0]
        documented = [line[1:].strip().rstrip("\\").strip().strip("'") for line in block.splitlines()
                      if line.startswith("+")]
        assert documented == [line for line in out.splitlines() if line], strategy


def test_verl_recipe_default_min_p_is_the_core_default():
    from tim_plugins.safe_vocab import DEFAULT_MIN_P

    recipe = (ROOT / "integrations" / "verl" / "recipes" / "run_grpo_tim.sh").read_text()
    m = re.search(r"^MIN_P=\$\{MIN_P:-([0-9.e-]+)\}$", recipe, re.M)
    assert m and float(m.group(1)) == DEFAULT_MIN_P


def test_demo_defaults_in_readme_match_the_config():
    from tim_plugins.apps.demo import REAL_MODEL_DEFAULTS as real
    from tim_plugins.apps.demo import TOY_DEFAULTS as toy

    text = _section("demo")
    assert f"| `--steps` (per run; the default comparison runs two) | {toy['steps']} | {real['steps']} |" in text
    assert (f"| `--prompts-per-step` × `--num-generations` | {toy['prompts_per_step']} × {toy['num_generations']} | "
            f"{real['prompts_per_step']} × {real['num_generations']} |") in text
    assert f"| `--max-completion-length` | {toy['max_completion_length']} | {real['max_completion_length']} |" in text
    assert f"| `--learning-rate` | {toy['learning_rate']:g} | {real['learning_rate']:g} |" in text
