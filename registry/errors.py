"""Errors of the control plane, each with the stable code the API answers with."""

from config.errors import ApplicationError, NotFound, PermissionDenied, ValidationFailed

__all__ = [
    "ApplicationError",
    "DependencyUnavailable",
    "InvalidStatusTransition",
    "McpServerUnavailable",
    "NotFound",
    "PermissionDenied",
    "ToolDefinitionChanged",
    "ValidationFailed",
    "VersionImmutable",
    "VersionNotGreater",
]


class InvalidStatusTransition(ApplicationError):
    code = "INVALID_STATUS_TRANSITION"
    http_status = 409


class VersionNotGreater(ApplicationError):
    code = "VERSION_NOT_GREATER"
    http_status = 409


class VersionImmutable(ApplicationError):
    """A published version is frozen: a change is a new version."""

    code = "VERSION_IMMUTABLE"
    http_status = 409


class DependencyUnavailable(ApplicationError):
    code = "DEPENDENCY_UNAVAILABLE"
    http_status = 409


class ToolDefinitionChanged(ApplicationError):
    """An MCP server no longer serves the definition a version was reviewed against."""

    code = "TOOL_DEFINITION_CHANGED"
    http_status = 409


class McpServerUnavailable(ApplicationError):
    code = "MCP_SERVER_UNAVAILABLE"
    http_status = 502
