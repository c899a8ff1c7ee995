"""Errors of the data plane, each with the stable code the API answers with."""

from config.errors import ApplicationError, NotFound, PermissionDenied, ValidationFailed

__all__ = [
    "EventLogIsAppendOnly",
    "IdempotencyKeyRequired",
    "IdempotencyKeyReused",
    "InvalidOccurrenceTransition",
    "InvalidRunTransition",
    "NotFound",
    "PayloadTooLarge",
    "PermissionDenied",
    "UnsupportedMediaType",
    "ValidationFailed",
]


class EventLogIsAppendOnly(ApplicationError):
    code = "EVENT_LOG_APPEND_ONLY"
    http_status = 409


class IdempotencyKeyRequired(ApplicationError):
    code = "IDEMPOTENCY_KEY_REQUIRED"
    http_status = 400


class IdempotencyKeyReused(ApplicationError):
    code = "IDEMPOTENCY_KEY_REUSED"
    http_status = 409


class InvalidOccurrenceTransition(ApplicationError):
    code = "INVALID_STATUS_TRANSITION"
    http_status = 409


class InvalidRunTransition(ApplicationError):
    code = "INVALID_STATUS_TRANSITION"
    http_status = 409


class PayloadTooLarge(ApplicationError):
    code = "PAYLOAD_TOO_LARGE"
    http_status = 413


class UnsupportedMediaType(ApplicationError):
    """A media type not allowed, or one the content does not show (a spoofed type)."""

    code = "UNSUPPORTED_MEDIA_TYPE"
    http_status = 415
