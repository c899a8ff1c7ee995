"""The one base of every domain error; the API renders each as the error body of DESIGN.md."""

from typing import Any


class ApplicationError(Exception):
    """A refusal the caller can act on: a stable code, an HTTP status and a readable message."""

    code: str = "APPLICATION_ERROR"
    http_status: int = 400

    def __init__(self, message: str, *, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details or {}


class ValidationFailed(ApplicationError):
    """Input that breaks a contract; `details` maps each field to its messages."""

    code = "VALIDATION_ERROR"
    http_status = 400


class NotFound(ApplicationError):
    """Absent, or invisible to this identity: the two are never told apart."""

    code = "NOT_FOUND"
    http_status = 404


class PermissionDenied(ApplicationError):
    code = "PERMISSION_DENIED"
    http_status = 403
