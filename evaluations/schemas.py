"""The shape of an eval case's definition, as the runner (`evaluations.services`) and the
metrics (`evaluations.metrics`) read it: a case that breaks it is refused when saved, not
misread (a string of messages sent a character at a time) or failed when its eval run runs."""

from typing import Any

from examples.models import ProjectUpdate
from registry.canonical import is_hashable
from registry.schemas import document_errors
from runs.choices import RunStatus
from runs.redaction import holds_secret
from runs.tools.envelope import ErrorCategory

UNHASHABLE = (
    "Holds a number outside the exactly representable range (integers within ±2^53-1, "
    "finite floats); the case could not be hashed canonically."
)
CREDENTIAL = (
    "Holds a credential (a key, a token or a password), which every model call of the case's "
    "runs would send to the provider: remove it."
)
_TEXT = {"type": "string", "minLength": 1}
_NAMES = {"type": "array", "items": _TEXT}
_OBJECT = {"type": "object"}

# What the sandbox's tables hold (`examples.models`): a fixture beyond them would fail every
# eval run of its suite when the case's business data is loaded, not be refused when saved.
_FIELD = {**_TEXT, "maxLength": 200}
_VERSION = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
# A day of the current week (0 is its Monday), within a century of it.
_DAY = {"type": "integer", "minimum": -36500, "maximum": 36500}

_UPDATE = {
    "type": "array",
    "prefixItems": [
        {"enum": ProjectUpdate.Kind.values},
        _FIELD,
        {**_TEXT, "maxLength": 32},
        {"type": "string"},
        _DAY,
    ],
    "minItems": 5,
    "maxItems": 5,
}
_LEAD = {
    "type": "array",
    "prefixItems": [
        {**_TEXT, "maxLength": 32},
        _FIELD,
        {"type": "string", "maxLength": 254},
        _VERSION,
        {"type": "boolean"},
    ],
    "minItems": 4,
    "maxItems": 5,
}
_PROJECT = {
    "type": "object",
    "properties": {
        "key": {"type": "string", "pattern": "^[-a-zA-Z0-9_]{1,63}$"},
        "name": _FIELD,
        "visible": {"type": "boolean"},
        "updates": {"type": "array", "items": _UPDATE},
        "leads": {"type": "array", "items": _LEAD},
    },
    "required": ["key"],
    "additionalProperties": False,
}

CASE_FIELD_SCHEMAS: dict[str, dict[str, Any]] = {
    "messages": {"type": "array", "items": _TEXT, "minItems": 1},
    "metadata": {"anyOf": [_OBJECT, {"type": "array", "items": _OBJECT}]},
    "session_state": _OBJECT,
    "fixture": {
        "type": "object",
        "properties": {
            "projects": {"type": "array", "items": _PROJECT},
            "faults": {
                "type": "object",
                "additionalProperties": {"enum": ErrorCategory.values},
            },
            "tool_descriptions": {"type": "object", "additionalProperties": _TEXT},
            "attachment": {
                "type": "object",
                "properties": {"name": _TEXT, "text": {"type": "string"}},
                "required": ["name", "text"],
                "additionalProperties": False,
            },
        },
        "additionalProperties": False,
    },
    "expected": {
        "type": "object",
        "properties": {
            "status": {"enum": RunStatus.values},
            "skill": {"type": ["string", "null"]},
            "mode": _TEXT,
            "tools_called": _NAMES,
            "tools_not_called": _NAMES,
            "recipient_record_id": _TEXT,
            "sections": _NAMES,
            "cites_sources": {"type": "boolean"},
            "max_steps": {"type": "integer", "minimum": 0},
        },
        "additionalProperties": False,
    },
    "forbidden": {
        "type": "object",
        "properties": {"tools": _NAMES, "recipients": _NAMES, "text": _NAMES},
        "additionalProperties": False,
    },
}


def case_errors(fields: dict[str, Any]) -> dict[str, list[str]]:
    """Every way each field of a case's definition breaks its shape, by field. A field must
    also hash once stored (`is_hashable`): the suite's content hash (`suite_content_hash`)
    reads it back from PostgreSQL, where a decimal of 2^53 or more (1e20, in free-form
    metadata or session state) becomes a whole number RFC 8785 refuses, and every start of
    an eval run of the suite, or install of it, would fail."""
    errors = {}
    for field, schema in CASE_FIELD_SCHEMAS.items():
        if field not in fields:
            continue
        found = document_errors(fields[field], schema)
        if not found and not is_hashable(fields[field]):
            found = [UNHASHABLE]
        if not found and field == "fixture":
            found = _twice_errors(fields[field]) + _credential_errors(fields[field])
        if found:
            errors[field] = found
    return errors


def _twice_errors(fixture: dict[str, Any]) -> list[str]:
    """A project's key, and a record's id within its project, name one row of the sandbox:
    a second project of the key would be dropped when the data is loaded, a second record of
    the id would fail it."""
    errors = []
    keys: set[str] = set()
    for index, project in enumerate(fixture.get("projects", [])):
        if project["key"] in keys:
            errors.append(f"projects/{index}: {project['key']} is a project of this case already.")
        keys.add(project["key"])
        records: set[str] = set()
        for lead_index, lead in enumerate(project.get("leads", [])):
            if lead[0] in records:
                errors.append(
                    f"projects/{index}/leads/{lead_index}: {lead[0]} is a record of this "
                    "project already."
                )
            records.add(lead[0])
    return errors


def _credential_errors(fixture: dict[str, Any]) -> list[str]:
    """The tool descriptions the sandbox shows the model instead of the tools' own
    (`runs.loop._tool_specs`) are sent as written in every model call of the case's runs, as a
    tool version's are, so they are refused what a tool version is refused
    (`registry.schemas.credential_errors`): what the run's redaction would remove as a
    credential. The message names the tool, never the value."""
    return [
        f"tool_descriptions/{tool}: {CREDENTIAL}"
        for tool, text in fixture.get("tool_descriptions", {}).items()
        if holds_secret(text)
    ]
