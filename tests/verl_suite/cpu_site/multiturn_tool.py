"""Test-only tool and tool parser (never shipped) that make verl 0.9.1's own multi-turn agent loop
(``ToolAgentLoop``, experimental/agent_loop/tool_agent_loop.py, ``default_agent_loop=tool_agent``) take several turns
with the toy model, which samples random text and never writes real tool-call syntax.

- ``AlwaysCallParser``, registered in verl's tool-parser registry (``ToolParser.register``, tool_parser.py) under
  ``PARSER``: every assistant turn "calls" the test tool once (the decoded turn is kept as the message's content).
  Selected with ``actor_rollout_ref.rollout.multi_turn.format=<PARSER>``; ``multi_turn.max_assistant_turns`` bounds
  the loop.
- ``FixedAnswerTool``: a ``BaseTool`` (verl/tools/base_tool.py) that answers every call with a short fixed text,
  declared in the tool config YAML ``tool_config(path)`` writes (``multi_turn.tool_config_path``).

verl imports this module by the YAML's ``class_name`` (tools/tool_registry.py ``get_tool_class``) in each
``AgentLoopWorker`` when it loads its tools, before it builds any agent loop, so the parser is registered in the
process that looks it up (``ToolAgentLoop.__init__`` -> ``ToolParser.get_tool_parser``). The module is on every
process's PYTHONPATH (``cpu_site/``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse

__all__ = ["ANSWER", "PARSER", "TOOL_NAME", "AlwaysCallParser", "FixedAnswerTool", "tool_config"]

PARSER = "tim_test_always_call"
TOOL_NAME = "tim_lookup"
ANSWER = "result: 42"


@ToolParser.register(PARSER)
class AlwaysCallParser(ToolParser):
    """One call of the test tool per assistant turn, whatever the model wrote."""

    async def extract_tool_calls(self, responses_ids: list[int], tools=None) -> tuple[str, list[FunctionCall]]:
        text = self.tokenizer.decode(responses_ids, skip_special_tokens=True)
        return text, [FunctionCall(name=TOOL_NAME, arguments=json.dumps({"query": "x"}))]


class FixedAnswerTool(BaseTool):
    """Answers every call with ``ANSWER`` (no state, no reward)."""

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        return ToolResponse(text=ANSWER), 0.0, {}


def tool_config(path: Path) -> Path:
    """Write verl's tool config YAML declaring ``FixedAnswerTool`` (JSON is valid YAML) and return its path."""
    config = {"tools": [{
        "class_name": f"{__name__}.FixedAnswerTool",
        "config": {"type": "native"},
        "tool_schema": {"type": "function", "function": {
            "name": TOOL_NAME, "description": "Looks the query up (test tool: a fixed answer).",
            "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": "what"}},
                           "required": ["query"]}}},
    }]}
    path.write_text(json.dumps(config, indent=1))
    return path
