"""Errors of the data plane, each with the stable code the API answers with."""

from config.errors import ApplicationError, NotFound, PermissionDenied, ValidationFailed

__all__ = [
    "EventLogIsAppendOnly",
    "IdempotencyKeyRequired",
    "IdempotencyKeyReused",
    "InvalidRunTransition",
    "NotFound",
    "PermissionDenied",
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


class InvalidRunTransition(ApplicationError):
    code = "INVALID_STATUS_TRANSITION"
    http_status = 409
