from uuid import UUID

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import OperationalError, connection, transaction
from django.utils import timezone

from config.queries import PreparedQuery
from registry.choices import Action
from registry.selectors import user_can
from runs import events, tracing, writes
from runs.choices import ACTIVE_STATUSES, RUN_TRANSITIONS, TERMINAL_STATUSES, Channel, RunStatus
from runs.errors import InvalidRunTransition, PermissionDenied
from runs.models import CancelRequest, Run, Source
from runs.selectors import agent_active, requester_standing
from runs.services.occurrences import occurrence_follow_run

CANCELLED_BY_USER = "CANCELLED_BY_USER"
REQUESTER_NO_LONGER_AUTHORISED = "REQUESTER_NO_LONGER_AUTHORISED"
AGENT_CONFIG_INACTIVE = "AGENT_CONFIG_INACTIVE"
WORKFLOW_CHANGED = "WORKFLOW_CHANGED"
# PostgreSQL's SQLSTATE for a row lock not taken within lock_timeout.
LOCK_NOT_AVAILABLE = "55P03"
_RUN_SOURCES = PreparedQuery(
    lambda run_id: (
        Source.objects.filter(run_id=run_id)
        .order_by("fetched_at", "id")
        .values("reference", "origin")
    ),
    run_id=UUID,
)


def run_transition(*, run: Run, status: RunStatus, reason_code: str = "", save: bool = True) -> Run:
    """Move a locked run to `status`. The same status again is a no-op; a terminal status is
    never overwritten; reaching one writes `run.finished`. `save=False` leaves the save to a
    caller that saves the run at the end of its step (the loop). A scheduled task's
    occurrence follows its run in the same transaction."""
    if run.status == status:
        return run
    if status not in RUN_TRANSITIONS[run.status]:
        raise InvalidRunTransition(
            f"A {run.status} run cannot become {status}.",
            details={"from": run.status, "to": status},
        )
    run.status = status
    run.reason_code = reason_code
    update_fields = ["status", "reason_code", "last_event_seq", "updated_at"]
    if status in TERMINAL_STATUSES:
        run.finished_at = timezone.now()
        update_fields.append("finished_at")
        events.run_finished(run, status=status, reason_code=reason_code)
        tracing.run_span(run)
    if save:
        run.save(update_fields=update_fields)
    if run.channel == Channel.TASK:
        occurrence_follow_run(run=run)
    return run


NEXT_STEPS = {
    RunStatus.COMPLETED: "Nothing more to do.",
    RunStatus.NEEDS_CLARIFICATION: "Answer the question in the result and send a new message "
    "in the same session.",
    RunStatus.REFUSED: "Ask a tenant admin for access, or change the request.",
    RunStatus.PARTIAL: "Review what was read; nothing was sent or changed.",
    RunStatus.FAILED_RETRYABLE: "Send the message again later with a new Idempotency-Key.",
    RunStatus.FAILED_FINAL: "Report the reason code to a platform admin.",
    RunStatus.BUDGET_EXHAUSTED: "Narrow the request, or ask for a larger budget.",
    RunStatus.CANCELLED: "Nothing more to do.",
}
# Where the reason says more than the status.
REASON_NEXT_STEPS = {
    (RunStatus.FAILED_RETRYABLE, "ACTION_FAILED"): "Nothing was sent. Send the message again "
    "later with a new Idempotency-Key; its new draft needs a new approval.",
    (RunStatus.CANCELLED, "APPROVAL_EXPIRED"): "Nothing was sent: no approver decided in "
    "time. Send the message again with a new Idempotency-Key; its new draft needs a new "
    "approval.",
    (RunStatus.CANCELLED, "APPROVAL_REJECTED"): "Change the request as needed and send the "
    "message again with a new Idempotency-Key; its new draft needs a new approval.",
    (RunStatus.FAILED_FINAL, "APPROVAL_INVALIDATED"): "Send the message again with a new "
    "Idempotency-Key; its new draft is made with what holds now and needs a new approval.",
    (RunStatus.REFUSED, "DECLINED_BY_PERSON"): "Change the request as needed and send it "
    "again in a new message.",
    (RunStatus.FAILED_FINAL, AGENT_CONFIG_INACTIVE): "An admin switched the agent off; nothing "
    "more is done under it. Send the message again with a new Idempotency-Key to an agent that "
    "is on (metadata.agent names it; without it, the tenant's default), or ask a tenant admin "
    "to switch the agent back on.",
    (RunStatus.FAILED_FINAL, WORKFLOW_CHANGED): "The platform's workflow for this request "
    "was redefined under the same version since the run started; nothing more is done under "
    "it. Send the message again with a new Idempotency-Key: its new run follows the workflow "
    "as it is now.",
    (RunStatus.FAILED_FINAL, "NO_EVIDENCE"): "Nothing was drafted: nothing the run read could "
    "back a report (the project has no updates for that week, or they were not read). Ask "
    "about another week or project; if it does have updates that week, report the reason "
    "code to a platform admin.",
}
# A scheduled task's run: no message in its session changes the task it runs for, and it
# has no message to send again; its next occurrence is its next try.
TASK_NEXT_STEPS = {
    RunStatus.NEEDS_CLARIFICATION: "Answer the question by changing the task; its next "
    "occurrence runs with the change.",
    RunStatus.FAILED_RETRYABLE: "The task's next occurrence tries again.",
    (RunStatus.FAILED_RETRYABLE, "ACTION_FAILED"): "Nothing was sent. The task's next "
    "occurrence tries again; its new draft needs a new approval.",
    (RunStatus.CANCELLED, "APPROVAL_EXPIRED"): "Nothing was sent: no approver decided in "
    "time. The task's next occurrence tries again; its new draft needs a new approval.",
    (RunStatus.CANCELLED, "APPROVAL_REJECTED"): "Change the task as needed; its next "
    "occurrence drafts again, and its new draft needs a new approval.",
    (RunStatus.FAILED_FINAL, "APPROVAL_INVALIDATED"): "The task's next occurrence drafts "
    "again with what holds then; its new draft needs a new approval.",
    (RunStatus.REFUSED, "DECLINED_BY_PERSON"): "Change the task as needed; its next "
    "occurrence asks again.",
    (RunStatus.FAILED_FINAL, WORKFLOW_CHANGED): "The platform's workflow for this task was "
    "redefined under the same version since the run started; nothing more is done under it. "
    "The task's next occurrence follows the workflow as it is now.",
    (RunStatus.FAILED_FINAL, AGENT_CONFIG_INACTIVE): "An admin switched the task's agent off; "
    "nothing more is done under it. Change the task's agent to one that is on, or ask a tenant "
    "admin to switch it back on: until then each occurrence is refused and pauses the task.",
}


def _next_step(run: Run, status: RunStatus, reason_code: str) -> str:
    """The most specific next step: a scheduled task's own first, then the reason's, then
    the status's."""
    tables = [TASK_NEXT_STEPS] if run.channel == Channel.TASK else []
    for table in [*tables, REASON_NEXT_STEPS, NEXT_STEPS]:
        for key in ((status, reason_code), status):
            if key in table:
                return table[key]
    return ""


def run_finish(
    *,
    run: Run,
    status: RunStatus,
    reason_code: str,
    output: dict | None = None,
    question: str = "",
    actions: list[dict] | None = None,
    why: str = "",
    save: bool = True,
) -> Run:
    """End a locked run with the structured result every run ends with: status, reason code,
    actions executed, displayable sources, the output and the next step for the user. `why`
    comes first in the next step where the reason code does not say it all (who turned a
    draft down and with what comment, what changed since an approval)."""
    run.result = {
        "status": str(status),
        "reason_code": reason_code,
        "actions": actions or [],
        "sources": [
            *_RUN_SOURCES(run_id=run.pk),
            *(
                {"reference": source.reference, "origin": source.origin}
                for source in writes.pending(run, Source)
            ),
        ],
        "output": output or {},
        "question": question,
        "next_step": " ".join(filter(None, [why, _next_step(run, status, reason_code)])),
        "model": run.capability.get("model", {}),
    }
    if save:
        run.save(update_fields=["result", "updated_at"])
    return run_transition(run=run, status=status, reason_code=reason_code, save=save)


def run_cancel(*, run: Run, actor: AbstractBaseUser) -> Run:
    """Cancel a run that has not finished. A queued or waiting run ends at once; a running one
    is marked and stops at its next step boundary. While a step holds the run (a model call
    may take long), the request is kept beside it and the call returns after a short wait
    (RUN_CANCEL_LOCK_WAIT_MS, PostgreSQL): the step's boundary takes it in
    (`cancel_request_take_in`). The run records `actor` as who cancelled it, unless someone
    asked first."""
    if run.actor_id != actor.pk and not user_can(
        user=actor, action=Action.TENANT_ADMIN, tenant=run.tenant
    ):
        raise PermissionDenied("Only the requester or a tenant admin may cancel this run.")
    with transaction.atomic():
        locked = _run_unless_stepping(run.pk)
        if locked is None:
            if run.status == RunStatus.CANCELLED:
                return run
            if run.status not in ACTIVE_STATUSES:
                raise InvalidRunTransition(
                    f"The run already finished {run.status}.", details={"status": run.status}
                )
            request, _ = CancelRequest.objects.get_or_create(
                run_id=run.pk, defaults={"reason": CANCELLED_BY_USER, "requested_by": actor}
            )
            if run.cancel_requested_at is None:
                run.cancel_requested_at, run.cancel_reason = request.requested_at, request.reason
                run.cancelled_by = request.requested_by
            return run
        if locked.status == RunStatus.CANCELLED:
            return locked
        return run_cancel_locked(locked, reason=CANCELLED_BY_USER, by=actor)


def _run_unless_stepping(run_id: UUID) -> Run | None:
    """The run, locked, or None while another transaction holds it for longer than
    RUN_CANCEL_LOCK_WAIT_MS (a step in flight; 0 or less: not at all). On PostgreSQL; the
    embedded SQLite default has one writer at a time and waits for it."""
    if connection.vendor != "postgresql":
        return Run.objects.select_for_update().get(pk=run_id)
    wait_ms = settings.RUN_CANCEL_LOCK_WAIT_MS
    try:
        with transaction.atomic():
            if wait_ms <= 0:
                return Run.objects.select_for_update(nowait=True).get(pk=run_id)
            with connection.cursor() as cursor:
                cursor.execute("SELECT current_setting('lock_timeout')")
                (previous,) = cursor.fetchone()
                cursor.execute("SELECT set_config('lock_timeout', %s, true)", [f"{wait_ms}ms"])
                run = Run.objects.select_for_update().get(pk=run_id)
                cursor.execute("SELECT set_config('lock_timeout', %s, true)", [previous])
            return run
    except OperationalError as error:
        if getattr(error.__cause__, "sqlstate", None) == LOCK_NOT_AVAILABLE:
            return None
        raise


def run_cancel_locked(run: Run, *, reason: str, by: AbstractBaseUser | None = None) -> Run:
    """Cancel a locked run for `reason`, asked by the user `by` (None: the platform stops it);
    a finished one cannot be. A cancel asked for first stands, with its reason and who asked:
    one already on the run, or one kept beside it while a step held it, taken in here. What a
    waiting run waits for (an action to approve, a request left to people) is withdrawn with
    it, for that reason."""
    if run.status not in ACTIVE_STATUSES:
        raise InvalidRunTransition(
            f"The run already finished {run.status}.", details={"status": run.status}
        )
    cancel_request_take_in(run)
    if run.cancel_requested_at is not None:
        reason = run.cancel_reason
    if run.status == RunStatus.WAITING_APPROVAL:
        _waiting_withdraw(run, reason=reason)
    return run_stop(run=run, reason_code=reason, by=by)


def _waiting_withdraw(run: Run, *, reason: str) -> None:
    """Withdraw what a locked waiting run waits for, as it ends for `reason`: its action
    leaves the approval queue and its request left to people the human queue."""
    # approvals builds on runs: imported here, where a run leaves the approval queue and
    # the human queue.
    from approvals.services import action_withdraw, handoff_withdraw

    action_withdraw(run=run, reason=reason)
    handoff_withdraw(run=run, reason=reason)


def cancel_request_take_in(run: Run) -> None:
    """Move the cancel request kept beside a locked run onto it, as `run_stop` records one."""
    request = CancelRequest.objects.filter(run_id=run.pk).select_related("requested_by").first()
    if request is None:
        return
    request.delete()
    if run.cancel_requested_at is None:
        run.cancel_requested_at, run.cancel_reason = request.requested_at, request.reason
        run.cancelled_by = request.requested_by
        run.save(
            update_fields=["cancel_requested_at", "cancel_reason", "cancelled_by", "updated_at"]
        )


def cancel_requests_take_in() -> int:
    """The sweep's part: cancel the runs whose cancel request no step took in, because they
    paused (waiting for approval) or no step came; runs a step holds now are left to it, and
    a request beside a run that finished meanwhile is dropped. Returns how many requests
    were taken in."""
    with transaction.atomic():
        runs = list(
            Run.objects.select_for_update(skip_locked=True, of=("self",)).filter(
                cancel_request__isnull=False
            )[:500]
        )
        for run in runs:
            if run.status not in ACTIVE_STATUSES:
                CancelRequest.objects.filter(run_id=run.pk).delete()
                continue
            run_cancel_locked(run, reason=CANCELLED_BY_USER)
    return len(runs)


def waiting_runs_end_without_standing() -> int:
    """The sweep's part: end the runs waiting for people (an action to approve, a request
    left to people) whose standing was withdrawn, as a running one ends at its next step:
    REFUSED (REQUESTER_NO_LONGER_AUTHORISED) when their requester may no longer start runs in
    their tenant (membership removed, a role that may not, user or tenant deactivated), else
    FAILED_FINAL (AGENT_CONFIG_INACTIVE) when an admin switched their agent off. Nothing of
    theirs could go out any more, so approvers stop seeing it: what each waited for is
    withdrawn as a cancelled run's is. Runs someone holds now (an approval being decided) are
    left to the next sweep, and runs with a cancel request beside them to
    `cancel_requests_take_in`, which ends them as their user asked. Returns how many runs
    ended."""
    ended = 0
    for withdrawn, status, reason_code in (
        (~requester_standing(), RunStatus.REFUSED, REQUESTER_NO_LONGER_AUTHORISED),
        (~agent_active(), RunStatus.FAILED_FINAL, AGENT_CONFIG_INACTIVE),
    ):
        with transaction.atomic():
            runs = list(
                Run.objects.select_for_update(skip_locked=True, of=("self",)).filter(
                    withdrawn, status=RunStatus.WAITING_APPROVAL, cancel_request__isnull=True
                )[:500]
            )
            for run in runs:
                _waiting_withdraw(run, reason=reason_code)
                run_finish(run=run, status=status, reason_code=reason_code)
        ended += len(runs)
    return ended


def run_stop(*, run: Run, reason_code: str, by: AbstractBaseUser | None = None) -> Run:
    """End a locked run that has not finished, for `reason_code`, asked by the user `by` (None:
    the platform): a queued or waiting run ends CANCELLED at once; a running one is marked and
    the loop ends it at its next step boundary with the reason, and who asked, of the first
    request."""
    if run.cancel_requested_at is None:
        run.cancel_requested_at = timezone.now()
        run.cancel_reason = reason_code
        run.cancelled_by = by
        run.save(
            update_fields=["cancel_requested_at", "cancel_reason", "cancelled_by", "updated_at"]
        )
    if run.status != RunStatus.RUNNING:
        run_finish(run=run, status=RunStatus.CANCELLED, reason_code=run.cancel_reason)
    return run
