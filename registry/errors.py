"""Errors of the control plane, each with the stable code the API answers with."""

from config.errors import ApplicationError, NotFound, PermissionDenied, ValidationFailed

__all__ = [
    "ApplicationError",
    "DependencyUnavailable",
    "InvalidStatusTransition",
    "NotFound",
    "PermissionDenied",
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
