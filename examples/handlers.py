"""The running example's read tools over the example business data.

Both check, before anything is read, that the project exists in the caller's tenant and that
the actor holds the `view_project` grant on it; another tenant's project is refused exactly
like a missing one.
"""

import hashlib
import smtplib
import ssl
from datetime import date
from email.errors import MessageError
from typing import Any

from django.conf import settings
from django.core.mail import EmailMessage, get_connection
from django.core.mail.message import sanitize_address
from django.utils import timezone
from django.utils.module_loading import import_string

from config.queries import PreparedQuery
from examples.models import DirectoryRecord, MailDelivery, Project, ProjectUpdate
from examples.selectors import project_for_actor
from runs.tools.adapters import (
    SourceDraft,
    ToolContext,
    ToolFailed,
    ToolOutput,
    ToolRefused,
    one_line,
)
from runs.tools.envelope import ErrorCategory

# The reply to a login whose account must first log in once with another mechanism.
SMTP_PASSWORD_TRANSITION_NEEDED = 432

_UPDATES = PreparedQuery(
    lambda project_id, start, end: ProjectUpdate.objects.filter(
        project_id=project_id, occurred_on__range=(start, end)
    ).order_by("occurred_on", "id"),
    project_id=int,
    start=date,
    end=date,
)
_DIRECTORY = PreparedQuery(
    lambda project_id, role: DirectoryRecord.objects.filter(
        project_id=project_id, role=role, is_active=True
    ).order_by("record_id"),
    project_id=int,
    role=str,
)


def _project(context: ToolContext, arguments: dict[str, Any]) -> Project:
    """The authorised project; checked once per call, at gate 3, and reused by the handler."""
    project = context.resources.get("project")
    if project is not None and project.key == arguments["project_id"]:
        return project
    project = project_for_actor(
        actor=context.actor, tenant=context.tenant, key=arguments["project_id"]
    )
    if project is None:
        raise ToolRefused("No such project, or no access to it.")
    context.resources["project"] = project
    return project


class ProjectSearch:
    """project_search@2: the tasks, milestones and risks of a project over a date range."""

    def authorize(self, context: ToolContext, arguments: dict[str, Any]) -> None:
        _project(context, arguments)

    def __call__(self, context: ToolContext, arguments: dict[str, Any]) -> ToolOutput:
        project = _project(context, arguments)
        start, end = date.fromisoformat(arguments["from"]), date.fromisoformat(arguments["to"])
        updates = _UPDATES(project_id=project.pk, start=start, end=end)
        items: dict[str, list[dict[str, Any]]] = {"task": [], "milestone": [], "risk": []}
        sources = []
        for update in updates:
            reference = f"project:{project.key}/update:{update.pk}"
            items[update.kind].append(
                {
                    "title": update.title,
                    "status": update.status,
                    "detail": update.detail,
                    "date": update.occurred_on.isoformat(),
                    "source": reference,
                }
            )
            sources.append(
                SourceDraft(reference=reference, content=f"{update.title}: {update.detail}")
            )
        return ToolOutput(
            business_status="ok",
            raw={
                "project": project.key,
                "name": project.name,
                "from": start.isoformat(),
                "to": end.isoformat(),
                "tasks": items["task"],
                "milestones": items["milestone"],
                "risks": items["risk"],
            },
            normalized={"updates": len(updates), "risks": len(items["risk"])},
            sources=sources,
        )


class DirectoryLookup:
    """directory_lookup@1: the current directory records for a role in a project."""

    def authorize(self, context: ToolContext, arguments: dict[str, Any]) -> None:
        _project(context, arguments)

    def __call__(self, context: ToolContext, arguments: dict[str, Any]) -> ToolOutput:
        project = _project(context, arguments)
        records = _DIRECTORY(project_id=project.pk, role=arguments["role"])
        candidates = [
            {
                "record_id": record.record_id,
                "display_name": record.display_name,
                "corporate_email": record.corporate_email or None,
                "record_version": record.version,
            }
            for record in records
        ]
        return ToolOutput(
            business_status="ok",
            raw={"project": project.key, "role": arguments["role"], "candidates": candidates},
            normalized={"count": len(candidates)},
            sources=[
                SourceDraft(
                    reference=f"directory:{record['record_id']}@{record['record_version']}",
                    content=record["display_name"],
                    allowed_use="recipient_resolution",
                )
                for record in candidates
            ],
        )


def _message_id(idempotency_key: str) -> str:
    """A stable Message-ID derived from the key: a delivery can be found again by it."""
    digest = hashlib.sha256(idempotency_key.encode()).hexdigest()[:40]
    return f"<{digest}@{settings.MAIL_MESSAGE_ID_DOMAIN}>"


def _sent(delivery: MailDelivery) -> ToolOutput:
    return ToolOutput(
        business_status="ok",
        raw={"message_id": delivery.message_id, "to": delivery.recipients},
        normalized={"message_id": delivery.message_id},
    )


def _settled(delivery: MailDelivery) -> ToolOutput:
    """The outcome a recorded delivery had; raises while it is not known."""
    if delivery.status == MailDelivery.Status.SENT:
        return _sent(delivery)
    if delivery.status == MailDelivery.Status.FAILED:
        raise ToolFailed(
            f"The mail was not delivered: {delivery.error}",
            category=ErrorCategory.UPSTREAM_ERROR,
            retryable=False,
        )
    if delivery.status == MailDelivery.Status.DEFERRED:
        raise ToolFailed(
            "The mail server turned the mail away for now moments ago; the try that was "
            "turned away may still be recording it, or about to try again.",
            category=ErrorCategory.UNKNOWN,
            retryable=False,
            may_have_side_effect=True,
        )
    raise ToolFailed(
        "An earlier delivery with this key has no known outcome; it is not sent again.",
        category=ErrorCategory.UNKNOWN,
        retryable=False,
        may_have_side_effect=True,
    )


def _taken_over(delivery: MailDelivery) -> bool:
    """Whether this try takes over a delivery turned away for now (`deferred`): nothing was
    sent under the key, so it sends, as `sending` again; of two tries, one takes it. Otherwise
    `delivery` is read again, as it stands."""
    if delivery.status == MailDelivery.Status.DEFERRED:
        taken = MailDelivery.objects.filter(
            pk=delivery.pk, status=MailDelivery.Status.DEFERRED
        ).update(status=MailDelivery.Status.SENDING, error="", updated_at=timezone.now())
        delivery.refresh_from_db()
        return bool(taken)
    return False


def _deferred(delivery: MailDelivery, error: Exception, why: str) -> ToolFailed:
    """The failure of a try the mail server turned away for now (`why`), nothing sent: the
    delivery is `deferred`, so a later try under the key takes it over and cannot deliver
    it twice."""
    _delivery_fail(delivery, MailDelivery.Status.DEFERRED, error)
    return ToolFailed(
        f"The mail server {why}; nothing was sent.",
        category=ErrorCategory.UPSTREAM_ERROR,
        retryable=True,
    )


def _delivery_fail(delivery: MailDelivery, status: str, error: Exception) -> None:
    delivery.status = status
    delivery.error = f"{type(error).__name__}: {error}"[:255]
    delivery.save(update_fields=["status", "error", "updated_at"])


def _reply(text: bytes | str) -> str:
    """A mail server's reply text, as one line."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    return " ".join(text.split())


def _refusals(error: Exception) -> list[tuple[int, str]]:
    """The codes and replies with which a mail server refused the sender or each recipient
    (`<code> <text>: <address>`) or the message at DATA (`<code> <text>`); none for any other
    failure, where its answer is not known."""
    if isinstance(error, smtplib.SMTPDataError):
        return [(error.smtp_code, f"{error.smtp_code} {_reply(error.smtp_error)}")]
    if isinstance(error, smtplib.SMTPSenderRefused):
        refusals = {error.sender: (error.smtp_code, error.smtp_error)}
    elif isinstance(error, smtplib.SMTPRecipientsRefused):
        refusals = error.recipients
    else:
        return []
    return [
        (code, f"{code} {_reply(text)}: {address}") for address, (code, text) in refusals.items()
    ]


def _not_ready(error: OSError) -> str | None:
    """What the mail server said or did when a connection to it could not be opened for now,
    if it was for now: refused, timed out, closed before a command, or a 4xx reply (a `421`
    greeting, a `454` temporary authentication failure). None when a later try could not open
    it either: a 5xx reply (a login turned away), a `432` to the login (the account must make
    a password transition first, which an administrator arranges: RFC 4954), TLS that cannot
    be negotiated or a certificate that does not verify, an extension the server lacks."""
    if isinstance(error, ssl.SSLError):
        return None
    if isinstance(error, smtplib.SMTPResponseException):
        if error.smtp_code >= 500 or error.smtp_code == SMTP_PASSWORD_TRANSITION_NEEDED:
            return None
        return f"{error.smtp_code} {_reply(error.smtp_error)}"
    if isinstance(error, smtplib.SMTPException) and not isinstance(
        error, smtplib.SMTPServerDisconnected
    ):
        return None
    return f"{type(error).__name__}: {error}"


def _message(arguments: dict[str, Any], *, message_id: str) -> EmailMessage:
    """The mail, built in full as the SMTP backend will write it. Django builds it only inside
    `send_messages`, on an open connection, where a header with a line break (BadHeaderError)
    or an address it cannot encode raises ValueError; built here first, such a mail fails
    before the server is contacted, with nothing sent. So does a subject with any other line
    boundary Python's email package folds a header at (`one_line`): the mail delivered would
    not be the one approved."""
    if not one_line(arguments["subject"]):
        raise ValueError("The subject holds a line break.")
    message = EmailMessage(
        subject=arguments["subject"],
        body=arguments["body"],
        to=arguments["to"],
        headers={
            "Message-ID": message_id,
            "X-Approved-Draft-Hash": arguments["approved_draft_hash"],
        },
    )
    encoding = message.encoding or settings.DEFAULT_CHARSET
    for address in [message.from_email, *message.recipients()]:
        sanitize_address(address, encoding)
    message.message().as_bytes(linesep="\r\n")
    return message


class MailSend:
    """mail_send@1: delivers an approved mail through Django's email backend (SMTP under
    `EMAIL_*`), exactly once per idempotency key. The delivery record is written before the
    mail server is contacted; once a connection is open, a timeout or a dropped connection
    is `unknown` (the server may have accepted the mail), never retried; a message it
    rejects for good (5xx) failed, nothing sent. A server not ready when asked (refused, no
    greeting in time, a 4xx greeting or reply to the login) or a sender, recipients or
    message it turns away for now (4xx to MAIL FROM, RCPT TO or DATA) failed retryable:
    nothing was sent, and the record is `deferred`, so a try under the key may send it. The
    record stays, rather than going: a reconciliation asking about the key meanwhile (a
    duplicate resume while the worker records the failure) finds it, and does not send
    behind the failure."""

    def authorize(self, context: ToolContext, arguments: dict[str, Any]) -> None:
        """The host sends only a payload a human approved; it checked that before."""

    def __call__(self, context: ToolContext, arguments: dict[str, Any]) -> ToolOutput:
        delivery, created = MailDelivery.objects.get_or_create(
            idempotency_key=context.idempotency_key,
            defaults={
                "message_id": _message_id(context.idempotency_key),
                "recipients": arguments["to"],
                "subject": arguments["subject"][:255],
            },
        )
        if not created and not _taken_over(delivery):
            return _settled(delivery)
        try:
            message = _message(arguments, message_id=delivery.message_id)
        except (ValueError, MessageError) as error:
            _delivery_fail(delivery, MailDelivery.Status.FAILED, error)
            raise ToolFailed(
                "The mail cannot be written as it stands (a header with a line break, or an "
                "address that cannot be encoded); nothing was sent.",
                category=ErrorCategory.INVALID_ARGUMENT,
                retryable=False,
            ) from error
        connection = get_connection(fail_silently=False)
        try:
            connection.open()
        except OSError as error:
            if (answer := _not_ready(error)) is not None:
                # Nothing was sent on a connection that never opened.
                raise _deferred(
                    delivery, error, f"could not be reached for now ({answer})"
                ) from error
            _delivery_fail(delivery, MailDelivery.Status.FAILED, error)
            raise ToolFailed(
                "The mail server could not be reached; nothing was sent.",
                category=ErrorCategory.UPSTREAM_ERROR,
                retryable=False,
            ) from error
        try:
            connection.send_messages([message])
        except (OSError, smtplib.SMTPException) as error:
            replies = _refusals(error)
            refused = "; ".join(reply for _, reply in replies)
            if replies and all(400 <= code < 500 for code, _ in replies):
                # Turned away for now, the sender, the recipients or the message at DATA, an
                # answer that it took none.
                raise _deferred(
                    delivery, error, f"turned the mail away for now ({refused})"
                ) from error
            if isinstance(error, smtplib.SMTPRecipientsRefused | smtplib.SMTPSenderRefused):
                _delivery_fail(delivery, MailDelivery.Status.FAILED, error)
                raise ToolFailed(
                    f"The mail server refused the sender or the recipients ({refused}); "
                    "nothing was sent.",
                    category=ErrorCategory.INVALID_ARGUMENT,
                    retryable=False,
                ) from error
            if isinstance(error, smtplib.SMTPDataError) and error.smtp_code >= 500:
                # It answered the message itself with a permanent refusal: not taken, ever.
                _delivery_fail(delivery, MailDelivery.Status.FAILED, error)
                raise ToolFailed(
                    f"The mail server rejected the message ({refused}); nothing was sent.",
                    category=ErrorCategory.UPSTREAM_ERROR,
                    retryable=False,
                ) from error
            _delivery_fail(delivery, MailDelivery.Status.UNKNOWN, error)
            raise ToolFailed(
                "The mail server stopped answering during delivery; it may have accepted it.",
                category=ErrorCategory.TIMEOUT,
                retryable=False,
                may_have_side_effect=True,
            ) from error
        finally:
            connection.close()
        delivery.status = MailDelivery.Status.SENT
        delivery.save(update_fields=["status", "updated_at"])
        return _sent(delivery)

    def reconcile(self, context: ToolContext) -> ToolOutput:
        """Settle an interrupted delivery by its key: the record, then the mail server where
        `MAIL_DELIVERY_LOOKUP` names a way to ask it. A delivery the server says it never
        accepted, whose attempt is over, never happened: its record goes and the key is free
        to send (NOT_FOUND); so is one turned away for now (`deferred`) whose attempt is over,
        its worker gone before it recorded the failure. Still unknown, or turned away moments
        ago by a try that may still record its failure or try again → ToolFailed UNKNOWN."""
        delivery = MailDelivery.objects.filter(idempotency_key=context.idempotency_key).first()
        if delivery is not None and delivery.status in (
            MailDelivery.Status.SENDING,
            MailDelivery.Status.UNKNOWN,
        ):
            accepted = (
                import_string(settings.MAIL_DELIVERY_LOOKUP)(delivery.message_id)
                if settings.MAIL_DELIVERY_LOOKUP
                else None
            )
            if accepted is True:
                delivery.status = MailDelivery.Status.SENT
                delivery.save(update_fields=["status", "updated_at"])
            elif accepted is False and _attempt_over(delivery):
                delivery.delete()
                delivery = None
        if delivery is None or (
            delivery.status == MailDelivery.Status.DEFERRED and _attempt_over(delivery)
        ):
            raise ToolFailed(
                "No delivery with this key reached the mail server.",
                category=ErrorCategory.NOT_FOUND,
                retryable=False,
            )
        return _settled(delivery)


def _attempt_over(delivery: MailDelivery) -> bool:
    """Whether the attempt that wrote this record has ended: it recorded how (unknown), or it
    started (or was turned away) longer ago than an SMTP exchange can last (its worker died)."""
    if delivery.status == MailDelivery.Status.UNKNOWN:
        return True
    age = (timezone.now() - delivery.updated_at).total_seconds()
    return age > settings.MAIL_ATTEMPT_SECONDS


project_search = ProjectSearch()
directory_lookup = DirectoryLookup()
mail_send = MailSend()
