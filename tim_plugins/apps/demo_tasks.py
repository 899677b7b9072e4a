"""The task ``tim-plugins demo`` trains on: the prompts and graded rewards of the toy model (`toy_reward`, the
prompts of `tim_plugins.toy_model.synthetic_prompts`) and of a real chat model (`chat_prompts`, `chat_reward`).

The rewards are graded, not pass / fail, so that the completions of one prompt differ: GRPO learns from the spread
of rewards inside a group.
"""

from __future__ import annotations

import re

__all__ = ["toy_reward", "chat_prompts", "chat_reward"]

_SUM = re.compile(r"^Q: (\d+) \+ (\d+) = \? A:$")
_SORT = re.compile(r"^sort ([\d ]+) ->$")


def _closeness(question: re.Match, answer: re.Match | None) -> float:
    """How close the answer's number is to the sum of the question's two numbers: 1 when equal, falling linearly to 0
    as it moves the sum's own size away; 0 without a number."""
    truth = int(question.group(1)) + int(question.group(2))
    return max(0.0, 1.0 - abs(int(answer.group()) - truth) / max(truth, 1)) if answer else 0.0


def toy_reward(prompts, completions, **kwargs) -> list[float]:
    """A graded reward for the toy prompts, so that completions of one prompt differ (GRPO learns from the
    spread inside a group): sums score by how close the first number is to the answer, sorting by the share of
    digits in their sorted place, free text by sentence length up to 8 words when it ends with a full stop."""
    rewards = []
    for prompt, completion in zip(prompts, completions):
        text = completion.strip()
        if m := _SUM.match(prompt):
            rewards.append(_closeness(m, re.match(r"\d+", text)))
        elif m := _SORT.match(prompt):
            want = sorted(m.group(1).split())
            got = re.findall(r"\d", text)[: len(want)]
            rewards.append(sum(a == b for a, b in zip(got, want)) / len(want))
        else:
            words = text.rstrip(".").split()
            rewards.append(min(len(words), 8) / 8 if text.endswith(".") else 0.0)
    return rewards


_CHAT_SUM = re.compile(r"What is (\d+) plus (\d+)\?")
_CHAT_QUESTIONS = (
    "Why is the sky blue?", "What does a bee do?", "Why do leaves fall in autumn?", "What is a prime number?",
    "Why do we sleep?", "What is the capital of France?", "How does a bicycle stay upright?",
    "What is rain made of?",
)


def chat_prompts(tokenizer, n: int, seed: int = 0) -> list[str]:
    """``n`` prompts for a chat model, rendered with its chat template: every other one a sum of two numbers
    below 50 ("What is 12 plus 30? Reply with the number only."), the others a question to answer in one short
    sentence."""
    import random

    rng = random.Random(20_000 + seed)
    prompts = []
    for i in range(n):
        if i % 2 == 0:
            text = f"What is {rng.randrange(50)} plus {rng.randrange(50)}? Reply with the number only."
        else:
            text = f"{rng.choice(_CHAT_QUESTIONS)} Answer in one short sentence."
        prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                     add_generation_prompt=True))
    return prompts


def chat_reward(prompts, completions, **kwargs) -> list[float]:
    """The reward of `chat_prompts`, graded so that completions of one prompt differ: a sum scores by how close
    the first number of the answer is to the truth; a question by a finished sentence (ends with . ! or ?),
    shorter is better past 12 words."""
    rewards = []
    for prompt, completion in zip(prompts, completions):
        text = completion.strip()
        if m := _CHAT_SUM.search(prompt):
            rewards.append(_closeness(m, re.search(r"-?\d+", text)))
        else:
            words = len(text.split())
            rewards.append(min(1.0, 12 / max(words, 1)) if text.endswith((".", "!", "?")) and words else 0.0)
    return rewards
