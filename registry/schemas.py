"""Contracts of registry documents, checked with JSON Schema before anything is published."""

from collections.abc import Iterable
from typing import Any

import httpx
import semver
from django.conf import settings
from django.core.exceptions import ValidationError
from jsonschema import Draft202012Validator, validators
from jsonschema.exceptions import best_match
from jsonschema_specifications import REGISTRY as META_SCHEMAS
from referencing.exceptions import Unresolvable
from referencing.jsonschema import DRAFT202012

from registry.canonical import is_hashable
from registry.choices import DATA_CLASSIFICATION_LEVELS, AdapterKind, Risk, Role
from registry.errors import ValidationFailed
from registry.mcp.review import risk_at_least
from runs.redaction import holds_secret
from runs.workflows import WORKFLOWS

Errors = dict[str, list[str]]

_POSITIVE_INT = {"type": "integer", "minimum": 1}

RETRY_POLICY_SCHEMA = {
    "type": "object",
    "properties": {
        "max_attempts": {"type": "integer", "minimum": 1, "maximum": 10},
        "backoff_s": {"type": "number", "minimum": 0, "maximum": 60},
        "max_backoff_s": {"type": "number", "minimum": 0, "maximum": 600},
        "jitter": {"type": "boolean"},
    },
    "additionalProperties": False,
}
# What a tool's result holds: the fields no viewer without clearance sees, and, for an MCP
# tool, the output schema its server declared.
RESULT_CONTRACT_SCHEMA = {
    "type": "object",
    "properties": {
        "sensitive_fields": {"type": "array", "items": {"type": "string"}},
        "output_schema": {"type": "object"},
    },
}
RATE_LIMIT_SCHEMA = {
    "type": "object",
    "properties": {"requests": _POSITIVE_INT, "per_seconds": _POSITIVE_INT},
    "required": ["requests", "per_seconds"],
    "additionalProperties": False,
}
# An open circuit is kept in Redis for ten times its reset (`runs.tools.limits`), and Redis
# refuses expiries past 2^63 ms: a day stays far inside (a tool out for longer is revoked).
CIRCUIT_RESET_MAX_S = 86_400
CIRCUIT_BREAKER_SCHEMA = {
    "type": "object",
    "properties": {
        "failure_threshold": _POSITIVE_INT,
        "reset_after_s": {**_POSITIVE_INT, "maximum": CIRCUIT_RESET_MAX_S},
    },
    "required": ["failure_threshold", "reset_after_s"],
    "additionalProperties": False,
}


def whole(pattern: str) -> str:
    """A JSON Schema pattern the whole string must match. jsonschema searches with Python's
    `re`, whose `$` also matches before a final newline: the lookahead refuses that (and
    reads the same in ECMA-262, JSON Schema's dialect)."""
    return f"^(?:{pattern})$(?!\\n)"


_CREDENTIAL_REF = {"type": "string", "pattern": whole("[A-Z][A-Z0-9_]{0,127}")}
ADAPTER_CONFIG_SCHEMAS: dict[str, dict[str, Any]] = {
    AdapterKind.PYTHON: {
        "type": "object",
        "properties": {
            "handler": {
                "type": "string",
                "pattern": whole(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+"),
            }
        },
        "required": ["handler"],
        "additionalProperties": False,
    },
    AdapterKind.HTTP: {
        "type": "object",
        "properties": {
            "url": {"type": "string", "pattern": "^https?://"},
            "credential_ref": _CREDENTIAL_REF,
        },
        "required": ["url"],
        "additionalProperties": False,
    },
    AdapterKind.MCP: {
        "type": "object",
        "properties": {
            "server": {"type": "string", "minLength": 1},
            "remote_name": {"type": "string", "minLength": 1},
            "definition_hash": {"type": "string", "pattern": whole("[0-9a-f]{64}")},
            "proposed_risk": {"enum": list(Risk.values)},
        },
        "required": ["server", "remote_name", "definition_hash"],
        "additionalProperties": False,
    },
}
_STRING_LIST = {"type": "array", "items": {"type": "string", "minLength": 1}}
SKILL_RULES_SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": whole("[a-z0-9][a-z0-9_.-]*")},
            "scope": {"type": "string", "minLength": 1},
            "priority": {"type": "integer", "minimum": 0, "maximum": 1000},
            "text": {"type": "string", "minLength": 1},
        },
        "required": ["id", "scope", "priority", "text"],
        "additionalProperties": False,
    },
}
TRIGGERS_SCHEMA = {**_STRING_LIST, "minItems": 1}
REQUIRED_INPUTS_SCHEMA = {**_STRING_LIST, "uniqueItems": True}
EXAMPLES_SCHEMA = {"type": "array"}
ACCEPTANCE_RULES_SCHEMA = _STRING_LIST
OUTPUT_CONTRACT_SCHEMA = {
    "type": "object",
    "properties": {"sections": {**_STRING_LIST, "minItems": 1, "uniqueItems": True}},
    "required": ["sections"],
}


def _message(error: Any) -> str:
    location = "/".join(str(part) for part in error.absolute_path)
    return f"{location}: {error.message}" if location else error.message


def _is_whole_number(checker: Any, instance: Any) -> bool:
    return isinstance(instance, int) and not isinstance(instance, bool)


# JSON Schema counts 60.0 an integer; what reads a document's integers does not (Redis takes
# an expiry of "61.0" for no number, Python's range refuses a float), so a document's integer
# is written as one.
_DocumentValidator = validators.extend(
    Draft202012Validator,
    type_checker=Draft202012Validator.TYPE_CHECKER.redefine("integer", _is_whole_number),
)


def document_errors(document: Any, schema: dict[str, Any]) -> list[str]:
    """Every way `document` breaks `schema`, as readable lines."""
    validator = _DocumentValidator(schema)
    return sorted(_message(error) for error in validator.iter_errors(document))


def _in_place_subschemas(contents: dict[str, Any]) -> list[dict[str, Any]]:
    """The subschemas of `contents` that apply to the very value it checks, not to a part."""
    found = [contents.get(keyword) for keyword in ("not", "if", "then", "else")]
    for keyword in ("allOf", "anyOf", "oneOf"):
        value = contents.get(keyword)
        found += value if isinstance(value, list) else []
    dependent = contents.get("dependentSchemas")
    found += list(dependent.values()) if isinstance(dependent, dict) else []
    return [subschema for subschema in found if isinstance(subschema, dict)]


def _loops(steps: dict[int, list[int]]) -> bool:
    """Whether some path of `steps` (subschema -> the subschemas checked in its place) comes
    back to where it began."""
    finished: dict[int, bool] = {}  # False while on the path being followed
    for start in steps:
        if start in finished:
            continue
        finished[start] = False
        path = [(start, iter(steps[start]))]
        while path:
            node, following = path[-1]
            step = next(following, None)
            if step is None:
                finished[node] = True
                path.pop()
            elif finished.get(step) is False:
                return True
            elif step not in finished and step in steps:
                finished[step] = False
                path.append((step, iter(steps[step])))
    return False


def _reference_errors(schema: dict[str, Any]) -> list[str]:
    """Why the `$ref`s and `$dynamicRef`s of `schema` cannot be followed when a value is
    checked: one leads neither to a part of it nor to a JSON Schema meta-schema (nothing is
    fetched to find out), or they loop back without descending into a part of the value
    (checking would recurse without end)."""
    root = DRAFT202012.create_resource(schema)
    nowhere = []
    # Subschemas by identity, each with those checked in its place: references included.
    steps: dict[int, list[int]] = {}
    pending = [(META_SCHEMAS.resolver_with_root(root), root)]
    while pending:
        resolver, resource = pending.pop()
        contents = resource.contents
        if isinstance(contents, dict):
            here = steps[id(contents)] = [id(sub) for sub in _in_place_subschemas(contents)]
            for keyword in ("$ref", "$dynamicRef"):
                reference = contents.get(keyword)
                if not isinstance(reference, str):
                    continue
                try:
                    here.append(id(resolver.lookup(reference).contents))
                except Unresolvable:
                    nowhere.append(reference)
        pending += [(resolver.in_subresource(sub), sub) for sub in resource.subresources()]
    errors = []
    if nowhere:
        errors.append(
            "A reference must lead to a part of the input schema; these do not: "
            f"{', '.join(sorted(set(nowhere)))}."
        )
    if _loops(steps):
        errors.append(
            "References of the input schema lead back to where they began without descending "
            "into a part of the value; checking arguments would never end."
        )
    return errors


def input_schema_errors(schema: Any) -> list[str]:
    """Why `schema` is not a usable tool input schema: valid Draft 2020-12, an object, closed,
    referring to nothing outside itself and never in a loop."""
    if not isinstance(schema, dict):
        return ["The input schema must be a JSON object."]
    metaschema = Draft202012Validator(
        Draft202012Validator.META_SCHEMA, format_checker=Draft202012Validator.FORMAT_CHECKER
    )
    failure = best_match(metaschema.iter_errors(schema))
    if failure is not None:
        location = "/".join(str(part) for part in failure.absolute_path)
        where = f" at {location}" if location else ""
        return [f"Not a valid JSON Schema (Draft 2020-12){where}: {failure.message}"]
    errors = _reference_errors(schema)
    if not is_hashable(schema):
        errors.append(
            "The input schema holds a number outside the exactly representable range "
            "(integers within ±2^53-1, finite floats); it could not be hashed canonically."
        )
    if schema.get("type") != "object":
        errors.append('The input schema must have "type": "object".')
    if schema.get("additionalProperties") is not False:
        errors.append('The input schema must set "additionalProperties": false.')
    properties = schema.get("properties", {})
    missing = [name for name in schema.get("required", []) if name not in properties]
    if missing:
        errors.append(f"Required but not declared in properties: {', '.join(missing)}.")
    return errors


def semver_errors(version: str) -> list[str]:
    try:
        semver.Version.parse(version)
    except (ValueError, TypeError):
        return [f"'{version}' is not a semantic version such as 1.4.0."]
    return []


def _limit_errors(limit: Any, schema: dict[str, Any]) -> list[str]:
    """A result contract, retry policy, rate limit or circuit breaker: none (null or {}) or an
    object its schema accepts; "" or [] is neither."""
    if limit is None or limit == {}:
        return []
    return document_errors(limit, schema)


def handler_errors(handler: str) -> list[str]:
    """A `python` tool's handler comes from a module installed for tool handlers."""
    module = handler.rpartition(".")[0]
    if module in settings.PYTHON_TOOL_HANDLER_MODULES:
        return []
    installed = ", ".join(settings.PYTHON_TOOL_HANDLER_MODULES) or "none"
    return [
        f"A handler comes from a module installed for tools ({installed}); {module} is not one."
    ]


def url_errors(url: str) -> list[str]:
    """An `http` tool's URL is one the HTTP client sends its calls to: otherwise every call
    fails, as a bug of the tool (a URL the client cannot parse) or as a service that could
    not be reached (no host, no port), retried for nothing. RFC 3986 has no space in a URL."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL:
        parsed = None
    if (
        parsed is None
        or not parsed.host
        or (parsed.port is not None and not 1 <= parsed.port <= 65535)
        or any(character.isspace() or not character.isprintable() for character in url)
    ):
        return [
            "url: not one a call can be sent to: http:// or https://, a host, a port from 1 "
            "to 65535 if any, and no space or control character (percent-encode them)."
        ]
    return []


# What of a version every model call of a run using it is sent (runs.loop, runs.context).
TOOL_MODEL_FIELDS = ("description", "when_not_to_use", "returns", "input_schema")
SKILL_MODEL_FIELDS = ("instructions", "rules", "examples", "output_contract")
CREDENTIAL_MESSAGE = (
    "Holds a credential (a key, a token or a password), which every model call of a run "
    "using this version would send to the provider: remove it."
)


def credential_errors(values: dict[str, Any], fields: Iterable[str]) -> Errors:
    """The fields whose text holds what a run's redaction would remove as a credential
    (`runs.redaction.holds_secret`). They go into every model request unredacted, as the
    version's own words, so a key pasted there reaches the provider on every call and
    everyone who reads the registry. The message names the field, never the value."""
    return {field: [CREDENTIAL_MESSAGE] for field in fields if holds_secret(values.get(field))}


def tool_version_errors(values: dict[str, Any]) -> Errors:
    """Field-by-field problems of a tool version's content, none if it may be published."""
    errors: Errors = {}
    checks = {
        "version": semver_errors(values.get("version", "")),
        "input_schema": input_schema_errors(values.get("input_schema")),
        "result_contract": _limit_errors(values.get("result_contract"), RESULT_CONTRACT_SCHEMA),
        "retry_policy": _limit_errors(values.get("retry_policy"), RETRY_POLICY_SCHEMA),
        "rate_limit": _limit_errors(values.get("rate_limit"), RATE_LIMIT_SCHEMA),
        "circuit_breaker": _limit_errors(values.get("circuit_breaker"), CIRCUIT_BREAKER_SCHEMA),
    }
    adapter_schema = ADAPTER_CONFIG_SCHEMAS.get(values.get("adapter_kind", ""))
    if adapter_schema is None:
        checks["adapter_kind"] = [f"Unknown adapter kind '{values.get('adapter_kind')}'."]
    else:
        checks["adapter_config"] = document_errors(values.get("adapter_config"), adapter_schema)
        if not checks["adapter_config"] and values.get("adapter_kind") == AdapterKind.PYTHON:
            checks["adapter_config"] = handler_errors(values["adapter_config"]["handler"])
        if not checks["adapter_config"] and values.get("adapter_kind") == AdapterKind.HTTP:
            checks["adapter_config"] = url_errors(values["adapter_config"]["url"])
    if not (values.get("description") or "").strip():
        checks["description"] = ["Say what the tool does, when not to use it, what it returns."]
    if values.get("risk") not in Risk.values:
        checks["risk"] = [f"Unknown risk '{values.get('risk')}'."]
    elif not checks.get("adapter_config") and values.get("adapter_kind") == AdapterKind.MCP:
        proposed = values["adapter_config"].get("proposed_risk")
        if proposed and not risk_at_least(values["risk"], proposed):
            checks["risk"] = [
                f"The server's annotations propose '{proposed}'; a reviewer may raise the "
                "risk, never lower it."
            ]
    for field, messages in checks.items():
        if messages:
            errors[field] = messages
    for field, messages in credential_errors(values, TOOL_MODEL_FIELDS).items():
        errors.setdefault(field, []).extend(messages)
    return errors


def skill_version_errors(values: dict[str, Any]) -> Errors:
    """Field-by-field problems of a skill version's content, none if it may be published."""
    checks = {
        "version": semver_errors(values.get("version", "")),
        "triggers": document_errors(values.get("triggers"), TRIGGERS_SCHEMA),
        "required_inputs": document_errors(values.get("required_inputs"), REQUIRED_INPUTS_SCHEMA),
        "rules": document_errors(values.get("rules"), SKILL_RULES_SCHEMA),
        "examples": document_errors(values.get("examples"), EXAMPLES_SCHEMA),
        "output_contract": document_errors(values.get("output_contract"), OUTPUT_CONTRACT_SCHEMA),
        "acceptance_rules": document_errors(
            values.get("acceptance_rules"), ACCEPTANCE_RULES_SCHEMA
        ),
    }
    if not (values.get("description") or "").strip():
        checks["description"] = ["Say which goals the skill serves and which it does not."]
    workflow = values.get("workflow") or ""
    if workflow and workflow not in WORKFLOWS:
        checks["workflow"] = [
            f"Unknown workflow '{workflow}'; defined: {', '.join(sorted(WORKFLOWS))}."
        ]
    for field in ("examples", "output_contract"):
        if not checks[field] and not is_hashable(values.get(field)):
            checks[field] = [
                "Holds a number outside the exactly representable range (integers within "
                "±2^53-1, finite floats); the version could not be hashed canonically."
            ]
    rules = values.get("rules")
    rule_ids = [
        rule.get("id")
        for rule in (rules if isinstance(rules, list) else [])
        if isinstance(rule, dict)
    ]
    duplicates = sorted({rule_id for rule_id in rule_ids if rule_ids.count(rule_id) > 1})
    if duplicates:
        checks["rules"].append(f"Rule ids must be unique: {', '.join(map(str, duplicates))}.")
    for field, messages in credential_errors(values, SKILL_MODEL_FIELDS).items():
        checks[field] = [*checks.get(field, []), *messages]
    return {field: messages for field, messages in checks.items() if messages}


def raise_if_errors(errors: Errors, message: str) -> None:
    if errors:
        raise ValidationFailed(message, details=errors)


def validate_policy_lists(policy: Any) -> None:
    errors = {
        "approval_required_risks": _unknown(policy.approval_required_risks, Risk.values),
        "approver_roles": _unknown(policy.approver_roles, Role.values),
        "human_queue_risks": _unknown(policy.human_queue_risks, Risk.values),
    }
    if policy.max_data_classification not in DATA_CLASSIFICATION_LEVELS:
        errors["max_data_classification"] = ["Unknown classification."]
    errors = {field: messages for field, messages in errors.items() if messages}
    if errors:
        raise ValidationError(errors)


def _unknown(values: Any, allowed: Iterable[str]) -> list[str]:
    if not isinstance(values, list):
        return ["Must be a list."]
    unknown = sorted(set(map(str, values)) - set(allowed))
    return [f"Unknown: {', '.join(unknown)}."] if unknown else []
