"""Errors of approvals and business actions, each with the stable code the API answers with."""

from config.errors import ApplicationError, NotFound, PermissionDenied

__all__ = [
    "ActionFrozen",
    "AlreadyDecided",
    "ApprovalExpired",
    "InvalidActionTransition",
    "NotFound",
    "PayloadHashMismatch",
    "PermissionDenied",
    "SelfApprovalForbidden",
]


class ActionFrozen(ApplicationError):
    code = "ACTION_FROZEN"
    http_status = 409


class InvalidActionTransition(ApplicationError):
    code = "INVALID_STATUS_TRANSITION"
    http_status = 409


class PayloadHashMismatch(ApplicationError):
    """The decision names another payload than the one waiting: the approver saw a stale one."""

    code = "PAYLOAD_HASH_MISMATCH"
    http_status = 409


class AlreadyDecided(ApplicationError):
    code = "ALREADY_DECIDED"
    http_status = 409


class ApprovalExpired(ApplicationError):
    code = "APPROVAL_EXPIRED"
    http_status = 409


class SelfApprovalForbidden(ApplicationError):
    code = "SELF_APPROVAL_FORBIDDEN"
    http_status = 403
