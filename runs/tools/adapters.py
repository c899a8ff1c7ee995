"""How a tool version is executed: a Python handler in this process, or an HTTP service.

The host builds the `ToolContext` (identity, tenant, idempotency key, short-lived credential);
the model never supplies any of it. A handler refuses with `ToolRefused` (gate 3, nothing was
done) and fails with `ToolFailed` (it ran, and may or may not have had an effect).
"""

import importlib
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
from django.contrib.auth.models import AbstractBaseUser

from registry.choices import AdapterKind
from registry.models import Tenant, ToolVersion
from runs.tools.envelope import ErrorCategory


@dataclass(frozen=True)
class ToolContext:
    run_id: str
    call_id: str
    tenant: Tenant
    actor: AbstractBaseUser
    idempotency_key: str
    credential: str | None = None
    resources: dict[str, Any] = field(default_factory=dict, compare=False)
    """What gate 3 authorised for this call (e.g. the project), for the handler to reuse."""


@dataclass(frozen=True)
class SourceDraft:
    reference: str
    content: str
    allowed_use: str = "summarize"


@dataclass
class ToolOutput:
    business_status: str
    raw: Any
    normalized: dict[str, Any] = field(default_factory=dict)
    sources: list[SourceDraft] = field(default_factory=list)


class ToolRefused(Exception):
    """Gate 3: the call is not authorised for this actor, tenant or resource."""

    def __init__(self, message: str, *, category: ErrorCategory = ErrorCategory.PERMISSION_DENIED):
        super().__init__(message)
        self.category = category


class ToolFailed(Exception):
    def __init__(
        self,
        message: str,
        *,
        category: ErrorCategory,
        retryable: bool,
        may_have_side_effect: bool = False,
        raw: Any = None,
    ) -> None:
        super().__init__(message)
        self.category = category
        self.retryable = retryable
        self.may_have_side_effect = may_have_side_effect
        self.raw = raw


class Handler(Protocol):
    def authorize(self, context: ToolContext, arguments: dict[str, Any]) -> None: ...

    def __call__(self, context: ToolContext, arguments: dict[str, Any]) -> ToolOutput: ...


def python_handler(tool_version: ToolVersion) -> Handler:
    module_path, _, name = tool_version.adapter_config["handler"].rpartition(".")
    try:
        return getattr(importlib.import_module(module_path), name)
    except (ImportError, AttributeError) as error:
        raise ToolFailed(
            f"The handler of {tool_version.qualified_name} is not installed.",
            category=ErrorCategory.UNKNOWN,
            retryable=False,
        ) from error


_HTTP_CATEGORIES = {
    400: ErrorCategory.INVALID_ARGUMENT,
    401: ErrorCategory.PERMISSION_DENIED,
    403: ErrorCategory.PERMISSION_DENIED,
    404: ErrorCategory.NOT_FOUND,
    422: ErrorCategory.INVALID_ARGUMENT,
    429: ErrorCategory.RATE_LIMITED,
}


def http_call(
    tool_version: ToolVersion, context: ToolContext, arguments: dict[str, Any]
) -> ToolOutput:
    """POST the arguments as JSON; the host adds identity, idempotency key and credential."""
    headers = {"Idempotency-Key": context.idempotency_key}
    if context.credential:
        headers["Authorization"] = f"Bearer {context.credential}"
    body = {
        "arguments": arguments,
        "context": {
            "tenant": context.tenant.slug,
            "actor": context.actor.get_username(),
            "run_id": context.run_id,
            "call_id": context.call_id,
        },
    }
    try:
        response = httpx.post(
            tool_version.adapter_config["url"],
            json=body,
            headers=headers,
            timeout=tool_version.timeout_s,
        )
    except httpx.TimeoutException as error:
        raise ToolFailed(
            "The service did not answer in time.",
            category=ErrorCategory.TIMEOUT,
            retryable=True,
            may_have_side_effect=True,
        ) from error
    except httpx.HTTPError as error:
        raise ToolFailed(
            "The service could not be reached.",
            category=ErrorCategory.UPSTREAM_ERROR,
            retryable=True,
        ) from error
    try:
        payload = response.json()
    except ValueError:
        payload = {"text": response.text[:4000]}
    if response.status_code >= 400:
        raise ToolFailed(
            f"The service answered {response.status_code}.",
            category=_HTTP_CATEGORIES.get(response.status_code, ErrorCategory.UPSTREAM_ERROR),
            retryable=response.status_code == 429 or response.status_code >= 500,
            may_have_side_effect=response.status_code >= 500,
            raw=payload,
        )
    if not isinstance(payload, dict):
        payload = {"data": payload}
    return ToolOutput(
        business_status=str(payload.get("business_status", "ok")),
        raw=payload.get("data", payload),
        normalized=payload.get("normalized") or {},
        sources=[
            SourceDraft(reference=str(item.get("reference")), content=str(item.get("content", "")))
            for item in payload.get("sources") or []
            if isinstance(item, dict) and item.get("reference")
        ],
    )


def authorize(tool_version: ToolVersion, context: ToolContext, arguments: dict[str, Any]) -> None:
    """Gate 3 for Python handlers; an HTTP service authorises the identity the host sends."""
    if tool_version.adapter_kind == AdapterKind.PYTHON:
        python_handler(tool_version).authorize(context, arguments)


def reconcile(tool_version: ToolVersion, context: ToolContext) -> ToolOutput:
    """The outcome of an earlier call with `context.idempotency_key`, from the tool itself.
    Raises ToolFailed: NOT_FOUND when the tool has no record of the key (it never started),
    UNKNOWN (may_have_side_effect) when the outcome is still not known."""
    handler = (
        python_handler(tool_version) if tool_version.adapter_kind == AdapterKind.PYTHON else None
    )
    if handler is None or not hasattr(handler, "reconcile"):
        raise ToolFailed(
            f"{tool_version.qualified_name} cannot be asked about an earlier call.",
            category=ErrorCategory.UNKNOWN,
            retryable=False,
            may_have_side_effect=True,
        )
    return handler.reconcile(context)


def execute(
    tool_version: ToolVersion, context: ToolContext, arguments: dict[str, Any]
) -> ToolOutput:
    if tool_version.adapter_kind == AdapterKind.PYTHON:
        return python_handler(tool_version)(context, arguments)
    if tool_version.adapter_kind == AdapterKind.HTTP:
        return http_call(tool_version, context, arguments)
    raise ToolFailed(
        f"{tool_version.adapter_kind} tools are not executable here yet.",
        category=ErrorCategory.UNKNOWN,
        retryable=False,
    )
