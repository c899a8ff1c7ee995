"""Errors of evaluations and release gates, each with the stable code the API answers with."""

from config.errors import ApplicationError, NotFound, PermissionDenied, ValidationFailed

__all__ = [
    "InvalidEvalRunTransition",
    "NotFound",
    "PermissionDenied",
    "ReleaseGateFailed",
    "ValidationFailed",
]


class InvalidEvalRunTransition(ApplicationError):
    code = "INVALID_STATUS_TRANSITION"
    http_status = 409


class ReleaseGateFailed(ApplicationError):
    """A publish, rollback, rollout or model move the release gate refuses: `details` names
    each failing metric and value."""

    code = "RELEASE_GATE_FAILED"
    http_status = 409
