"""The one base of every domain error; the API renders each as the error body of DESIGN.md."""

from typing import Any

from django.core.exceptions import NON_FIELD_ERRORS


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


def detail_text(value: Any) -> str:
    """An error's details (messages, lists of them, fields of them) as readable text."""
    if isinstance(value, dict):
        return ", ".join(
            detail_text(item) if key == NON_FIELD_ERRORS else f"{key} {detail_text(item)}"
            for key, item in value.items()
        )
    if isinstance(value, list):
        return " ".join(map(detail_text, value))
    return str(value)


def error_text(error: ApplicationError) -> str:
    """A domain refusal as one readable sentence, its details included. Messages about the
    whole object (Django's NON_FIELD_ERRORS, "__all__") are said without that key, which
    names no field a reader knows."""
    details = "; ".join(
        detail_text(value) if field == NON_FIELD_ERRORS else f"{field}: {detail_text(value)}"
        for field, value in error.details.items()
        if field not in {"from", "to"}
    )
    return f"{error.message} {details}".strip()
