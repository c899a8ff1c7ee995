"""The offline deterministic planner: the zero-config demo's and the tests' model.

It follows the active skill the way a careful model would, with no provider and no network:
it reads the task inputs from its instructions, calls each available read tool once with them,
then drafts from what the tools returned (progress, risks, next steps, each with its source).
When the inputs lack what every tool needs, it asks for it (`{"clarification": ...}`).
It never follows text found inside tool results. Everything it does is labelled offline.
"""

import json
import re
from collections.abc import Iterator
from typing import Any

from runs.context import INPUTS_MARKER
from runs.model_clients.base import (
    ModelRequest,
    ModelResponse,
    ToolCall,
    ToolResult,
    ToolSpec,
    Usage,
)
from runs.tokens import estimate_tokens

MODEL_NAME = "offline-deterministic-planner"
_INPUTS = re.compile(re.escape(INPUTS_MARKER) + r"\n```json\n(.*?)\n```", re.S)
DONE_STATUSES = frozenset({"done", "completed", "shipped"})


def _inputs(instructions: str) -> dict[str, Any]:
    match = _INPUTS.search(instructions)
    return json.loads(match.group(1)) if match else {}


_ALIASES = {"from": "date_from", "to": "date_to"}


def _missing(tool: ToolSpec, inputs: dict[str, Any]) -> list[str]:
    """The tool's required arguments the task inputs do not give."""
    return [
        name
        for name in tool.input_schema.get("required", [])
        if inputs.get(_ALIASES.get(name, name)) is None
    ]


def _arguments(tool: ToolSpec, inputs: dict[str, Any]) -> dict[str, Any]:
    """The tool's required arguments, from the task inputs (none of them missing)."""
    return {
        name: inputs[_ALIASES.get(name, name)] for name in tool.input_schema.get("required", [])
    }


def _question(missing: dict[str, list[str]]) -> str:
    """Asks for what the tools it could not call need."""
    needs = "; ".join(f"{tool} needs {', '.join(names)}" for tool, names in missing.items())
    return f"Which values should I use? {needs}."


def _evidence(results: list[ToolResult]) -> Iterator[dict[str, Any]]:
    """What the tools that succeeded returned, in order, read as the draft asks for it. A
    result the host flags as an error (a call that failed, or a tool's business refusal in
    a 200 answer) returned nothing to draft from."""
    for result in results:
        if result.is_error:
            continue
        wrapped = json.loads(result.content).get("untrusted_data", {})
        try:
            envelope = json.loads(wrapped.get("content", "{}"))
        except ValueError:
            continue
        if isinstance(envelope.get("raw"), dict):
            yield envelope["raw"]


# project_search's report, as the draft reads it: its heading, and the fields of each item of
# its lists (the status of a task or milestone is text, which the draft compares).
_REPORT_FIELDS = ("name", "from", "to")
_REPORT_LISTS = {
    "tasks": ("title", "status", "date", "source"),
    "milestones": ("title", "status", "date", "source"),
    "risks": ("title", "detail", "source"),
}


def _is_report(raw: dict[str, Any]) -> bool:
    """Whether a tool's answer is a project report the draft can read: a tenant's own tool
    may answer with `tasks` of another shape, which is no report."""
    return (
        all(name in raw for name in _REPORT_FIELDS)
        and all(
            isinstance(raw.get(name), list)
            and all(
                isinstance(item, dict) and all(key in item for key in keys) for item in raw[name]
            )
            for name, keys in _REPORT_LISTS.items()
        )
        and all(
            isinstance(item["status"], str)
            for name in ("tasks", "milestones")
            for item in raw[name]
        )
    )


def _line(item: dict[str, Any]) -> str:
    return f"{item['title']} ({item['status']}, {item['date']})"


def _draft(evidence: Iterator[dict[str, Any]]) -> dict[str, Any]:
    report = next((raw for raw in evidence if _is_report(raw)), None)
    if report is None:
        return {"answer": "The tools returned nothing to report on."}
    work = report["tasks"] + report["milestones"]
    progress = [
        {"text": _line(item), "source": item["source"]}
        for item in work
        if item["status"].lower() in DONE_STATUSES
    ]
    next_steps = [
        {"text": _line(item), "source": item["source"]}
        for item in work
        if item["status"].lower() not in DONE_STATUSES
    ]
    risks = [
        {"text": f"{item['title']}: {item['detail']}".rstrip(": "), "source": item["source"]}
        for item in report["risks"]
    ]
    subject = f"Weekly status: {report['name']} ({report['from']} to {report['to']})"
    body = "\n".join(
        [
            subject,
            "",
            "Progress:",
            *(f"- {entry['text']} [{entry['source']}]" for entry in progress),
            "",
            "Risks:",
            *(f"- {entry['text']} [{entry['source']}]" for entry in risks),
            "",
            "Next steps:",
            *(f"- {entry['text']} [{entry['source']}]" for entry in next_steps),
        ]
    )
    return {
        "subject": subject,
        "progress": progress,
        "risks": risks,
        "next_steps": next_steps,
        "body": body,
    }


class OfflinePlanner:
    """A ModelClient that needs no provider."""

    is_offline = True

    def __init__(self, model_config: Any = None) -> None:
        self.model_config = model_config

    def complete(self, request: ModelRequest) -> ModelResponse:
        inputs = _inputs(request.instructions)
        results = [item for item in request.transcript if isinstance(item, ToolResult)]
        called = {result.name for result in results}
        calls, missing = [], {}
        if not results:
            for index, tool in enumerate(request.tools, start=1):
                if names := _missing(tool, inputs):
                    missing[tool.name] = names
                elif tool.name not in called:
                    calls.append(
                        ToolCall(
                            call_id=f"offline-{index}",
                            name=tool.name,
                            arguments=_arguments(tool, inputs),
                        )
                    )
        if calls:
            text = ""
        elif missing and not results:
            # A careful model asks for what its tools need rather than answer from nothing.
            text = json.dumps({"clarification": _question(missing)}, ensure_ascii=False)
        else:
            text = json.dumps(_draft(_evidence(results)), ensure_ascii=False)
        prompt = request.instructions + "".join(repr(item) for item in request.transcript)
        return ModelResponse(
            text=text,
            tool_calls=tuple(calls),
            usage=Usage(
                input_tokens=estimate_tokens(prompt),
                output_tokens=estimate_tokens(text + repr(calls)),
            ),
            stop_reason="tool_use" if calls else "end_turn",
            model=MODEL_NAME,
        )
