"""Business Actions: freeze a run's side effect, let a human decide it, re-validate on resume,
execute it exactly once under its idempotency key, and settle an unknown outcome by that key.

Lock order, everywhere: the run's row, then the action's. A side effect runs outside any
transaction: the action is `executing` and its ToolCall saved (committed) before the tool is
called, so a crash leaves a record that says "this may have happened" and nothing is sent
twice.
"""

import logging
from datetime import datetime, timedelta
from typing import Any, NoReturn

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.utils import timezone

from approvals import tasks
from approvals.choices import ACTION_TRANSITIONS, ActionStatus, Decision, HandoffStatus
from approvals.errors import (
    AlreadyDecided,
    ApprovalExpired,
    InvalidActionTransition,
    NotFound,
    PayloadHashMismatch,
    PermissionDenied,
    SelfApprovalForbidden,
)
from approvals.models import ApprovalDecision, BusinessAction, Handoff
from config.celery import task_send
from examples.models import DirectoryRecord
from examples.selectors import project_for_actor
from registry.canonical import canonical_hash
from registry.choices import Action, AdapterKind, VersionStatus
from registry.mcp.review import visible
from registry.models import AgentConfig, Policy, SkillVersion, Tenant, ToolVersion
from registry.selectors import (
    mcp_drift,
    user_can,
    user_roles,
    version_ids_withdrawn,
    versions_frozen,
)
from runs import events, tracing, writes
from runs.capability import workflow_changed
from runs.choices import ACTIVE_STATUSES, Channel, RunStatus
from runs.model_clients.base import ToolCall as RequestedCall
from runs.models import Run, TaskOccurrence, ToolCall
from runs.redaction import secrets_removed
from runs.services.occurrences import DEADLINE_PASSED
from runs.services.runs import (
    AGENT_CONFIG_INACTIVE,
    REQUESTER_NO_LONGER_AUTHORISED,
    WORKFLOW_CHANGED,
    cancel_request_take_in,
    run_cancel_locked,
    run_finish,
    run_transition,
)
from runs.tools import adapters, executor
from runs.tools.adapters import ToolFailed, ToolOutput
from runs.tools.envelope import ErrorCategory, business_done, strip_secrets
from runs.workflows import WORKFLOWS

logger = logging.getLogger(__name__)

USABLE_VERSION_STATUSES = frozenset({VersionStatus.PUBLISHED, VersionStatus.DEPRECATED})
SEND_NODE = "send"
# Seconds before an unknown outcome is first reconciled.
RECONCILE_AFTER = 5
# Reconciliations of an action before an outcome still unknown is left to a person: the first,
# then eight more after 30 s, 1, 2, 4, 8, 16, 32 and 60 minutes (about two hours in all).
RECONCILE_ATTEMPTS = 9
# An unknown action's next reconciliation overdue this long lost its message: the sweep sends
# it again (a late one that still comes makes no second attempt).
RECONCILE_LOST_AFTER = timedelta(minutes=2)


def _transition(action: BusinessAction, status: ActionStatus, *, reason: str = "") -> None:
    if status not in ACTION_TRANSITIONS[action.status]:
        raise InvalidActionTransition(
            f"A {action.status} action cannot become {status}.",
            details={"from": action.status, "to": status},
        )
    action.status = status
    action.status_reason = reason
    now = timezone.now()
    fields = ["status", "status_reason", "updated_at"]
    stamp = {
        ActionStatus.APPROVED: "decided_at",
        ActionStatus.REJECTED: "decided_at",
        ActionStatus.EXECUTING: "executed_at",
    }.get(status)
    if status in (ActionStatus.SUCCEEDED, ActionStatus.FAILED, ActionStatus.EXPIRED):
        stamp = "finished_at"
    if stamp:
        setattr(action, stamp, now)
        fields.append(stamp)
    if not action._state.adding:
        action.save(update_fields=fields)


def action_freeze(
    *,
    run: Run,
    kind: str,
    payload: dict[str, Any],
    tool_version: ToolVersion,
    skill_version: SkillVersion | None,
) -> BusinessAction:
    """Freeze the side effect a locked run proposes: canonical JSON (RFC 8785), its sha256,
    the key `run_id:kind:payload_hash`, the snapshot's approval policy and the expiry; the
    action waits for a human from here. It is written with the step that froze it, with its
    first historical record."""
    payload_hash = canonical_hash(payload)
    policy = run.capability["approval_policy"]
    action = BusinessAction(
        tenant=run.tenant,
        run=run,
        requester=run.actor,
        kind=kind,
        risk=tool_version.risk,
        payload=payload,
        payload_hash=payload_hash,
        idempotency_key=f"{run.pk}:{kind}:{payload_hash}",
        tool_version=tool_version,
        skill_version=skill_version,
        policy=policy,
        expires_at=timezone.now() + timedelta(seconds=policy["approval_ttl_seconds"]),
    )
    _transition(action, ActionStatus.FROZEN)
    _transition(action, ActionStatus.WAITING_APPROVAL)
    writes.add(run, [action])
    return action


def _locked(action_id: Any) -> tuple[Run, BusinessAction] | None:
    """The run, then the action, locked in that order."""
    run_id = BusinessAction.objects.filter(pk=action_id).values_list("run_id", flat=True).first()
    if run_id is None:
        return None
    run = (
        Run.objects.select_for_update(of=("self",)).select_related("tenant", "actor").get(pk=run_id)
    )
    action = BusinessAction.objects.select_for_update().get(pk=action_id)
    action.run = run
    return run, action


def _expire(run: Run, action: BusinessAction) -> None:
    tracing.span_add(
        run,
        "approval.wait",
        started_at=action.created_at,
        error=True,
        action_id=str(action.pk),
        decision="expired",
        payload_hash=action.payload_hash,
    )
    _transition(action, ActionStatus.EXPIRED, reason="APPROVAL_EXPIRED")
    if run.status != RunStatus.WAITING_APPROVAL:
        return
    events.approval_invalidated(run, action_id=str(action.pk), reasons=["APPROVAL_EXPIRED"])
    run_finish(
        run=run,
        status=RunStatus.CANCELLED,
        reason_code="APPROVAL_EXPIRED",
        output={"action_id": str(action.pk)},
    )


def _cancel_taken_in(run: Run) -> bool:
    """Whatever stopped the locked run while something else held it is honoured before its
    action may go on: a cancel accepted meanwhile (it waits beside the run, `CancelRequest`),
    or a scheduled task's deadline that passed before its sweep came round. The run ends
    CANCELLED and a waiting or approved action is withdrawn (one executing is left to finish,
    and the run ends as asked once it settles). Returns whether the run was cancelled."""
    cancel_request_take_in(run)
    if run.status not in ACTIVE_STATUSES:
        return False
    if run.cancel_requested_at is not None:
        reason = run.cancel_reason
    elif _deadline_passed(run):
        reason = DEADLINE_PASSED
    else:
        return False
    run_cancel_locked(run, reason=reason)
    return run.status == RunStatus.CANCELLED


def _deadline_passed(run: Run) -> bool:
    """Whether the run is a scheduled task's whose occurrence's deadline has passed."""
    return (
        run.channel == Channel.TASK
        and TaskOccurrence.objects.filter(run_id=run.pk, deadline_at__lte=timezone.now()).exists()
    )


def _run_ended(run: Run, action: BusinessAction) -> bool:
    """A run that stopped waiting (cancelled, say) takes its waiting action with it."""
    if run.status == RunStatus.WAITING_APPROVAL:
        return False
    _transition(action, ActionStatus.INVALIDATED, reason="RUN_ENDED")
    return True


def action_withdraw(*, run: Run, reason: str) -> BusinessAction | None:
    """Withdraw the action of a locked run before it executes, because the run is ending
    (`reason`, e.g. DEADLINE_PASSED): a waiting action leaves the queue at once and an
    approved one is never resumed. An action already executing is left to finish. Returns
    the withdrawn action, if any."""
    action = (
        BusinessAction.objects.select_for_update()
        .filter(run=run, status__in=[ActionStatus.WAITING_APPROVAL, ActionStatus.APPROVED])
        .first()
    )
    if action is None:
        return None
    _transition(action, ActionStatus.INVALIDATED, reason=reason)
    events.approval_invalidated(run, action_id=str(action.pk), reasons=[reason])
    return action


def _may_decide(action: BusinessAction, approver: AbstractBaseUser) -> bool:
    """The approval queue (`selectors.actions_for_approver`) lists the same actions. Nobody
    decides in an evaluation sandbox."""
    if action.tenant.sandbox_of_id:
        return False
    roles = user_roles(user=approver, tenant=action.tenant)
    if not user_can(
        user=approver, action=Action.APPROVAL_DECIDE, tenant=action.tenant, roles=roles
    ):
        return False
    if approver.is_superuser:
        return True
    return bool(set(roles) & set(action.policy["approver_roles"]))


def _own_request_forbidden(action: BusinessAction, approver: AbstractBaseUser) -> bool:
    """The requester may not decide their own action unless its policy allows it."""
    return approver.pk == action.requester_id and not action.policy["allow_self_approval"]


def approval_may_decide(*, action: BusinessAction, approver: AbstractBaseUser) -> bool:
    """Whether `approval_decide` would let `approver` decide `action` (its role and the
    self-approval rule), for a page to offer the form only then."""
    return not _own_request_forbidden(action, approver) and _may_decide(action, approver)


def _refuse(
    person: AbstractBaseUser,
    *,
    tenant: Tenant,
    approver_roles: list[str],
    denied: str,
    not_found: NotFound,
) -> NoReturn:
    """Refuse a person who may not decide or handle something of `tenant`: one of the tenant
    learns that they lack an approver role; anyone else, that it does not exist."""
    if tenant.is_active and user_roles(user=person, tenant=tenant):
        raise PermissionDenied(denied, details={"approver_roles": approver_roles})
    raise not_found


def approval_decider_check(*, action: BusinessAction, approver: AbstractBaseUser) -> None:
    """Refuse someone who may not decide `action`: a person of its tenant learns that they
    lack the role (permission denied); anyone else does not learn that it exists (not
    found); its requester, unless the policy allows it, that they may not decide their own
    (self-approval forbidden). The API asks before it reads the decision; `approval_decide`
    asks again, with the action locked."""
    if not _may_decide(action, approver):
        _refuse(
            approver,
            tenant=action.tenant,
            approver_roles=action.policy["approver_roles"],
            denied="Only a person with an approver role of this action's policy may decide it.",
            not_found=NotFound("No such approval.", details={"id": str(action.pk)}),
        )
    if _own_request_forbidden(action, approver):
        raise SelfApprovalForbidden("You may not decide an action you requested.")


def approval_decide(
    *,
    action_id: Any,
    approver: AbstractBaseUser,
    decision: Decision | str,
    payload_hash: str,
    comment: str = "",
) -> ApprovalDecision:
    """Decide a waiting action. The approver holds an approver role of the policy in the
    action's tenant (another person of the tenant: permission denied; anyone else: not
    found); the requester may not decide their own unless the policy allows it; the decision
    binds the run, the payload hash the approver saw and the approver. One decision per
    action: the rows are locked, and the decision's one-to-one key refuses a second writer.
    An approval starts the resume task after commit. A credential pasted into the comment is
    removed before it is kept."""
    comment = secrets_removed(comment)
    refusal = None
    with transaction.atomic():
        locked = _locked(action_id)
        if locked is None:
            raise NotFound("No such approval.", details={"id": str(action_id)})
        run, action = locked
        approval_decider_check(action=action, approver=approver)
        if action.status == ActionStatus.EXPIRED:
            # The sweep got there first; the answer is the same as when it had not.
            raise ApprovalExpired(
                "This approval expired; the run ended without sending.",
                details={"expires_at": action.expires_at.isoformat()},
            )
        if action.status != ActionStatus.WAITING_APPROVAL and action.decided_at is None:
            # Withdrawn with its run (cancelled, say) before anyone decided it.
            raise AlreadyDecided(
                "The run ended before anyone decided this action; it will not run.",
                details={
                    "status": action.status,
                    "reason": action.status_reason,
                    "run_status": run.status,
                },
            )
        if action.status != ActionStatus.WAITING_APPROVAL:
            raise AlreadyDecided(
                "This action was already decided.", details={"status": action.status}
            )
        if payload_hash != action.payload_hash:
            raise PayloadHashMismatch(
                "The payload changed since you saw it; review it again.",
                details={"payload_hash": action.payload_hash},
            )
        # These refusals are raised after commit: the action's end is kept.
        if _cancel_taken_in(run):
            refusal = AlreadyDecided(
                "The run was cancelled; its action will not run.",
                details={"run_status": run.status, "reason_code": run.reason_code},
            )
        elif _run_ended(run, action):
            refusal = AlreadyDecided(
                "The run stopped waiting for this approval.", details={"run_status": run.status}
            )
        elif timezone.now() >= action.expires_at:
            _expire(run, action)
            refusal = ApprovalExpired(
                "This approval expired; the run ended without sending.",
                details={"expires_at": action.expires_at.isoformat()},
            )
        else:
            record = _decision_record(run, action, approver, decision, comment)
    if refusal is not None:
        raise refusal
    return record


def _decision_record(
    run: Run,
    action: BusinessAction,
    approver: AbstractBaseUser,
    decision: Decision | str,
    comment: str,
) -> ApprovalDecision:
    record = ApprovalDecision.objects.create(
        action=action,
        approver=approver,
        decision=decision,
        payload_hash=action.payload_hash,
        comment=comment,
    )
    tracing.span_add(
        run,
        "approval.wait",
        started_at=action.created_at,
        ended_at=record.created_at,
        error=decision != Decision.APPROVE,
        action_id=str(action.pk),
        decision=str(decision),
        approver=approver.get_username(),
        payload_hash=action.payload_hash,
    )
    if decision == Decision.APPROVE:
        _transition(action, ActionStatus.APPROVED)
        events.approval_granted(
            run,
            action_id=str(action.pk),
            approver=approver.get_username(),
            payload_hash=action.payload_hash,
        )
        run.save(update_fields=["last_event_seq", "updated_at"])
        transaction.on_commit(lambda: _resume_later(action.pk))
    else:
        _transition(action, ActionStatus.REJECTED, reason="REJECTED_BY_APPROVER")
        events.approval_rejected(
            run,
            action_id=str(action.pk),
            approver=approver.get_username(),
            payload_hash=action.payload_hash,
            comment=comment,
        )
        saying = f', saying "{visible(comment)}"' if comment else " without a comment"
        run_finish(
            run=run,
            status=RunStatus.CANCELLED,
            reason_code="APPROVAL_REJECTED",
            output={"action_id": str(action.pk), "comment": comment},
            why=f"Nothing was sent: {approver.get_username()} turned the draft down{saying}.",
        )
    return record


def _resume_later(action_id: Any) -> None:
    task_send(tasks.action_resume, action_id=str(action_id))


def _policy_changed(run: Run, policy: Policy) -> bool:
    """Whether the policy's terms differ from those in the run's snapshot, built as
    `runs.capability.capability_resolve` builds them: an approval given under other rules
    (which risks wait for whom, who may approve, for how long, how sensitive the data may
    be) does not hold under these."""
    current = {
        "approval_required_risks": sorted(policy.approval_required_risks),
        "human_queue_risks": sorted(policy.human_queue_risks),
        "approver_roles": sorted(policy.approver_roles),
        "allow_self_approval": policy.allow_self_approval,
        "approval_ttl_seconds": policy.approval_ttl_seconds,
    }
    approved_under = run.capability.get("approval_policy", {})
    data_scope = run.capability.get("data_scope", {})
    return (
        any(approved_under.get(name) != value for name, value in current.items())
        or data_scope.get("max_data_classification") != policy.max_data_classification
    )


def _send_deadline(action: BusinessAction) -> datetime:
    """When an approved action's send must have started: the action's expiry, or, for an
    approval given in its last minutes, `APPROVAL_RESUME_GRACE_SECONDS` after the decision.
    A resume later than that (workers down for hours) does not send what was approved then."""
    grace = timedelta(seconds=settings.APPROVAL_RESUME_GRACE_SECONDS)
    return max(action.expires_at, action.decision.created_at + grace)


def approved_send_deadline(action: BusinessAction) -> datetime | None:
    """`_send_deadline` of an approved action; None before an approval or after a rejection."""
    decision = getattr(action, "decision", None)
    if decision is None or decision.decision != Decision.APPROVE:
        return None
    return _send_deadline(action)


def _approval_stale(action: BusinessAction) -> bool:
    return timezone.now() >= _send_deadline(action)


def _revalidation_problems(run: Run, action: BusinessAction) -> tuple[list[str], list[str]]:
    """What changed since the approval (seed 000, step 14), empty when nothing did; and the
    skill and tool versions (`name@version`) no longer usable, which an auditor looks for."""
    problems = []
    decision = action.decision
    approver = decision.approver
    if _approval_stale(action):
        problems.append("APPROVAL_STALE")
    if run.state.get("workflow") not in WORKFLOWS:
        # A deploy removed the procedure the draft was made under: its send node is gone.
        problems.append("WORKFLOW_NOT_AVAILABLE")
    elif workflow_changed(run.capability) is not None:
        # A deploy redefined it under the same version: its send node may not be the one the
        # draft was approved to go through.
        problems.append(WORKFLOW_CHANGED)
    policy = Policy.objects.filter(agent_configs__runs=run).first()
    if policy is None:
        problems.append("POLICY_REMOVED")
    else:
        if _policy_changed(run, policy):
            problems.append("POLICY_CHANGED")
        if approver.pk == action.requester_id and not policy.allow_self_approval:
            problems.append("SELF_APPROVAL_NOT_ALLOWED")
        # As `_may_decide` asks it, under the current policy: a role the policy names is
        # not enough once the approver may decide no approval in the tenant.
        roles = user_roles(user=approver, tenant=action.tenant)
        if not user_can(
            user=approver, action=Action.APPROVAL_DECIDE, tenant=action.tenant, roles=roles
        ) or not (approver.is_superuser or roles & set(policy.approver_roles)):
            problems.append("APPROVER_NO_LONGER_AUTHORISED")
    requester = get_user_model().objects.filter(pk=action.requester_id).first()
    if requester is None or not user_can(
        user=requester, action=Action.RUN_CREATE, tenant=action.tenant
    ):
        problems.append(REQUESTER_NO_LONGER_AUTHORISED)
    if not AgentConfig.objects.filter(pk=run.agent_config_id, is_active=True).exists():
        # An admin switched the run's agent off: nothing more is done under it, a send as
        # little as a step (`runs.loop._standing_withdrawn`).
        problems.append(AGENT_CONFIG_INACTIVE)
    if (
        canonical_hash(action.payload) != action.payload_hash
        or decision.payload_hash != action.payload_hash
    ):
        problems.append("PAYLOAD_HASH_CHANGED")
    project_key = run.state.get("inputs", {}).get("project_id")
    if (
        requester is not None
        and project_key
        and project_for_actor(actor=requester, tenant=action.tenant, key=project_key) is None
    ):
        # The draft holds the project's data: it goes out in the requester's name only while
        # they may still read the project.
        problems.append("PROJECT_ACCESS_DENIED")
    recipient = action.payload.get("recipient_snapshot") or {}
    record = DirectoryRecord.objects.filter(
        project__tenant=action.tenant,
        project__key=project_key,
        record_id=recipient.get("record_id"),
    ).first()
    if (
        record is None
        or not record.is_active
        or record.version != recipient.get("record_version")
        or record.corporate_email != recipient.get("corporate_email")
    ):
        problems.append("DIRECTORY_RECORD_CHANGED")
    versions = []
    if action.skill_version_id and (
        not SkillVersion.objects.filter(
            pk=action.skill_version_id, status__in=USABLE_VERSION_STATUSES
        ).exists()
        or version_ids_withdrawn(
            model=SkillVersion, ids=[action.skill_version_id], tenant=run.tenant
        )
    ):
        problems.append("SKILL_VERSION_NOT_AVAILABLE")
        versions.append(action.skill_version.qualified_name)
    pinned = {entry["id"] for entry in run.capability.get("tools", [])}
    usable = set(
        str(pk)
        for pk in ToolVersion.objects.filter(pk__in=pinned, status__in=USABLE_VERSION_STATUSES)
        .order_by()
        .values_list("pk", flat=True)
    )
    if gone := (pinned - usable) | version_ids_withdrawn(
        model=ToolVersion, ids=pinned, tenant=run.tenant
    ):
        problems.append("TOOL_VERSION_NOT_AVAILABLE")
        versions += sorted(
            version.qualified_name
            for version in ToolVersion.objects.filter(pk__in=gone).select_related("tool")
        )
    send_tool = versions_frozen(model=ToolVersion, ids=[action.tool_version_id])[
        str(action.tool_version_id)
    ]
    if mcp_drift([send_tool]):
        # The approver approved the contract of the send tool as reviewed: its MCP server
        # serves another one now, as the registry records it (as a new run's snapshot reads
        # it). A change not recorded yet is found by the send, which lists the server first.
        problems.append("TOOL_DEFINITION_CHANGED")
        if send_tool.qualified_name not in versions:
            versions.append(send_tool.qualified_name)
    return problems, versions


def _send_call(action: BusinessAction) -> RequestedCall:
    """The call comes from the frozen payload, never from a model turn. Its id makes the
    host's idempotency key `run_id:kind:payload_hash`, the action's."""
    payload = action.payload
    return RequestedCall(
        call_id=f"{action.kind}:{action.payload_hash}",
        name=action.kind,
        arguments={
            "to": [payload["recipient_snapshot"]["corporate_email"]],
            "subject": payload["subject"],
            "body": payload["body"],
            "approved_draft_hash": action.payload_hash,
        },
    )


def _send_node(run: Run):
    workflow = WORKFLOWS[run.state["workflow"]]
    return workflow.nodes[SEND_NODE]


def _action_summary(action: BusinessAction) -> dict[str, Any]:
    return {
        "id": str(action.pk),
        "kind": action.kind,
        "status": action.status,
        "external_id": action.external_id,
        "idempotency_key": action.idempotency_key,
    }


# What the user of a run whose approved action is under way is told to expect.
SENDING = "The approved message is being sent."
SETTLING = (
    "Whether the approved message was delivered is being checked with the mail system; "
    "it is never sent twice."
)


def _result_progress(run: Run, next_step: str) -> None:
    """A running run's result says so: no longer waiting for an approver."""
    run.result = {**run.result, "status": str(run.status), "next_step": next_step}


def _mark_unknown(run: Run, action: BusinessAction, failure: ToolFailed) -> None:
    _transition(action, ActionStatus.UNKNOWN, reason=failure.category)
    events.action_unknown(run, action_id=str(action.pk), category=failure.category)
    _result_progress(run, SETTLING)
    run.save(update_fields=["result", "last_event_seq", "updated_at"])


def _mark_reconciled(run: Run, action: BusinessAction) -> None:
    """Settled by the idempotency key, not by the call that started it."""
    action.reconciled_at = timezone.now()
    action.save(update_fields=["reconciled_at"])
    events.action_reconciled(
        run, action_id=str(action.pk), outcome=action.status, external_id=action.external_id
    )


def _succeed(
    run: Run,
    action: BusinessAction,
    output: ToolOutput,
    *,
    reconciled: bool,
    secrets: tuple[str | None, ...] = (),
) -> None:
    """The action succeeded: its outcome is kept as its call's record keeps it, without the
    credential the host gave the call (`secrets`), should the tool's answer echo it."""
    normalized = strip_secrets(output.normalized or {}, secrets=secrets)
    action.external_id = str(normalized.get("message_id", ""))[:255]
    action.outcome = {"raw": strip_secrets(output.raw, secrets=secrets)}
    action.save(update_fields=["external_id", "outcome", "updated_at"])
    _transition(action, ActionStatus.SUCCEEDED)
    if reconciled:
        _mark_reconciled(run, action)
    events.action_succeeded(run, action_id=str(action.pk), external_id=action.external_id)
    recipient = action.payload["recipient_snapshot"]
    run_finish(
        run=run,
        status=RunStatus.COMPLETED,
        reason_code="SENT",
        output={
            "recipient": {
                "display_name": recipient["display_name"],
                "corporate_email": recipient["corporate_email"],
            },
            "message_id": action.external_id,
        },
        actions=[_action_summary(action)],
    )


def _fail(
    run: Run,
    action: BusinessAction,
    failure: ToolFailed,
    *,
    reconciled: bool,
    run_status: RunStatus | None = None,
    secrets: tuple[str | None, ...] = (),
) -> None:
    """The action failed; the run ends ACTION_FAILED, FAILED_RETRYABLE when nothing was done
    and a later try may pass (a mail server's "try again later", a rate limit, an open
    circuit: the user may ask again later), FAILED_FINAL otherwise; or CANCELLED for the
    reason it was cancelled while its action had not been done. Its message is kept without
    the credential the host gave the call (`secrets`). A send that never reached its tool (a
    gate refused it, or a limit turned it away) was not executed: it keeps no `executed_at`,
    an auditor does not find it among the side effects, nor the run's result among the
    actions executed."""
    message = strip_secrets(str(failure), secrets=secrets)
    action.outcome = {"error": {"category": failure.category, "message": message}}
    if not failure.attempted:
        action.executed_at = None
    action.save(update_fields=["outcome", "executed_at", "updated_at"])
    _transition(action, ActionStatus.FAILED, reason=failure.category)
    if reconciled:
        _mark_reconciled(run, action)
    events.action_failed(run, action_id=str(action.pk), category=failure.category)
    if run_status is None:
        for_now = failure.retryable and not failure.may_have_side_effect
        run_status = RunStatus.FAILED_RETRYABLE if for_now else RunStatus.FAILED_FINAL
    run_finish(
        run=run,
        status=run_status,
        reason_code=run.cancel_reason if run_status == RunStatus.CANCELLED else "ACTION_FAILED",
        output={"error": action.outcome["error"]},
        actions=[_action_summary(action)] if action.executed_at else [],
    )


def action_execute(*, action_id: Any) -> None:
    """Resume an approved action: re-validate, record that it is executing, execute it once
    outside any transaction, record the outcome. Safe to call again at any point: an action
    already executing is settled by its key (`action_reconcile`), never executed again."""
    with transaction.atomic():
        locked = _locked(action_id)
        if locked is None:
            return
        run, action = locked
        if _cancel_taken_in(run):
            return
        if action.status in (ActionStatus.EXECUTING, ActionStatus.UNKNOWN):
            attempt = action.reconcile_attempts + 1
            transaction.on_commit(lambda: _reconcile_later(action.pk, attempt=attempt))
            return
        if action.status != ActionStatus.APPROVED:
            return
        if run.status != RunStatus.WAITING_APPROVAL:
            _transition(action, ActionStatus.INVALIDATED, reason="RUN_ENDED")
            return
        problems, versions = _revalidation_problems(run, action)
        if problems:
            _approval_invalidate(run, action, reasons=problems, versions=versions)
            return
        events.run_resumed(
            run,
            action_id=str(action.pk),
            checks=[
                "approval_age",
                "approver",
                "requester",
                "policy",
                "directory_record",
                "versions",
                "tool_definition",
                "hash",
            ],
        )
        run.state = {**run.state, "node": SEND_NODE, "phase": "action"}
        run_transition(run=run, status=RunStatus.RUNNING)
        _result_progress(run, SENDING)
        call = _send_call(action)
        admitted = executor.side_effect_admit(
            run=run, call=call, node=_send_node(run), step=run.steps
        )
        if not isinstance(admitted, executor.Admitted):
            _transition(action, ActionStatus.EXECUTING)
            # Retryable as the gate said: a check that did not answer in time may pass later.
            failure = ToolFailed(
                admitted.envelope.get("error", {}).get("message", "Refused."),
                category=admitted.error_category,
                retryable=admitted.envelope.get("retryable") is True,
                attempted=False,
            )
            _fail(run, action, failure, reconciled=False)
            run.save(update_fields=["state", "tool_call_count"])
            return
        _transition(action, ActionStatus.EXECUTING)
        events.action_executing(
            run, action_id=str(action.pk), idempotency_key=action.idempotency_key
        )
        run.save(
            update_fields=["state", "result", "tool_call_count", "last_event_seq", "updated_at"]
        )
    _run_and_record(action_id, admitted)


def _unconfirmed(output: ToolOutput) -> ToolFailed | None:
    """An answer that does not say the action was done, as a failure that may have done it:
    a business status that is not `business_done`. HTTP 200 with a business refusal is not
    success, and a send its system only queued or held may still go out: neither is taken
    for sent, nor for failed (the user could ask again and send it twice). The action stays
    unknown until its key settles it (`action_reconcile`)."""
    if business_done(output.business_status):
        return None
    return ToolFailed(
        "The tool answered without saying the action was done.",
        category=ErrorCategory.UPSTREAM_ERROR,
        retryable=False,
        may_have_side_effect=True,
    )


def _run_and_record(action_id: Any, admitted: executor.Admitted) -> None:
    """Execute an action's call outside any transaction, then record what came back. An
    action another delivery marked unknown meanwhile (its reconciliation could not tell
    while this call was in flight) is settled with the outcome in hand."""
    outcome, attempts, duration_ms = executor.side_effect_run(admitted)
    # The action's span ends with its call, before the outcome may finish the run.
    ended_at = timezone.now()
    with transaction.atomic():
        run, action = _locked(action_id)
        if action.status not in (ActionStatus.EXECUTING, ActionStatus.UNKNOWN):
            return
        admitted.record = ToolCall.objects.get(pk=admitted.record.pk)
        executor.side_effect_record(run, admitted, outcome, attempts, duration_ms)
        secrets = (admitted.context.credential,)
        if isinstance(outcome, ToolOutput):
            outcome = _unconfirmed(outcome) or outcome
        if isinstance(outcome, ToolOutput):
            _succeed(run, action, outcome, reconciled=False, secrets=secrets)
        elif outcome.may_have_side_effect:
            if action.status == ActionStatus.EXECUTING:
                _mark_unknown(run, action, outcome)
            else:
                # Unknown already: the reconciliation settles it; keep the event's number.
                run.save(update_fields=["last_event_seq", "updated_at"])
            _reconcile_schedule(action, after=RECONCILE_AFTER)
        else:
            _fail(run, action, outcome, reconciled=False, secrets=secrets)
        tracing.span_add(
            run,
            "action",
            started_at=admitted.record.started_at,
            ended_at=ended_at,
            error=action.status != ActionStatus.SUCCEEDED,
            action_id=str(action.pk),
            kind=action.kind,
            outcome=action.status,
            idempotency_key=action.idempotency_key,
            external_id=action.external_id,
            attempts=attempts,
        )


def _reconcile_later(action_id: Any, *, attempt: int, countdown: float | None = None) -> None:
    task_send(
        tasks.action_reconcile, countdown=countdown, action_id=str(action_id), attempt=attempt
    )


def _reconcile_schedule(action: BusinessAction, *, after: float) -> None:
    """Write, with the step that leaves the action unknown, when its next reconciliation is
    due, and send that attempt after commit, numbered: what is written outlives a message
    lost on its way (`actions_reconcile_overdue` sends it again), and the number makes a
    second delivery of it do nothing. With no attempts left none is due: the action stays
    unknown for a person, and the log says so."""
    if action.reconcile_attempts >= RECONCILE_ATTEMPTS:
        action.reconcile_due_at = None
        logger.warning(
            "action %s: its outcome is still unknown after %d reconciliations; a person must "
            "settle it (Business actions, status unknown)",
            action.pk,
            action.reconcile_attempts,
        )
    else:
        action.reconcile_due_at = timezone.now() + timedelta(seconds=after)
        attempt = action.reconcile_attempts + 1
        transaction.on_commit(lambda: _reconcile_later(action.pk, attempt=attempt, countdown=after))
    action.save(update_fields=["reconcile_due_at", "updated_at"])


def _reconcile_backoff(attempts: int) -> float:
    """Seconds from the `attempts`-th reconciliation that left an outcome unknown to the next."""
    return min(3600, 30 * 2 ** (attempts - 1))


def action_reconcile(*, action_id: Any, attempt: int | None = None) -> str:
    """Settle an action whose outcome is not known (`unknown`, or `executing` after a crash)
    by its idempotency key. A tool with no record of the key (it never started, or its
    system says it never arrived) did nothing: the call runs now. A tool that knows the
    outcome settles it. Otherwise it stays unknown, for the next attempt when it is due or,
    after `RECONCILE_ATTEMPTS`, a person; it is never executed twice.

    `attempt` is the number of the attempt a task was sent to make. Its count is kept with
    its outcome, under the action's lock: a second delivery of the same attempt (the
    broker's, or the sweep's for a message it took for lost) waits for the first and then
    does nothing, so two deliveries never both ask the tool or make the call. An attempt that
    fails (the database dropped) is not counted, and stays due. Returns the action's
    status."""
    with transaction.atomic():
        locked = _locked(action_id)
        if locked is None:
            return ""
        run, action = locked
        _cancel_taken_in(run)
        if action.status not in (ActionStatus.EXECUTING, ActionStatus.UNKNOWN):
            return action.status
        if attempt is not None and action.reconcile_attempts >= attempt:
            return action.status
        action.reconcile_attempts += 1
        action.reconcile_due_at = None
        action.save(update_fields=["reconcile_attempts", "reconcile_due_at", "updated_at"])
        call = _send_call(action)
        tool_version = versions_frozen(model=ToolVersion, ids=[action.tool_version_id])[
            str(action.tool_version_id)
        ]
        # The question about the key and the send it may lead to end within the task's time.
        context = executor.host_context(
            run=run,
            call_id=call.call_id,
            tool_version=tool_version,
            deadline=executor.tries_deadline(),
        )
        secrets = (context.credential,)
        try:
            output = adapters.reconcile(tool_version, context)
            if (unconfirmed := _unconfirmed(output)) is not None:
                raise unconfirmed
        except ToolFailed as failure:
            held_back = _not_started_now(run, action)
            if failure.category == ErrorCategory.NOT_FOUND and held_back is not None:
                message, run_status = held_back
                settled = ToolFailed(
                    message,
                    category=ErrorCategory.PERMISSION_DENIED,
                    retryable=False,
                    attempted=False,
                )
                _record_settled(run, call, tool_version, context, settled)
                _fail(run, action, settled, reconciled=True, run_status=run_status)
                return action.status
            if failure.category == ErrorCategory.NOT_FOUND:
                if action.status == ActionStatus.UNKNOWN:
                    _transition(action, ActionStatus.EXECUTING)
                record = ToolCall.objects.get(run=run, call_id=call.call_id)
            elif failure.may_have_side_effect:
                if action.status == ActionStatus.EXECUTING:
                    _mark_unknown(run, action, failure)
                _reconcile_schedule(action, after=_reconcile_backoff(action.reconcile_attempts))
                return action.status
            else:
                _record_settled(run, call, tool_version, context, failure)
                _fail(run, action, failure, reconciled=True, secrets=secrets)
                return action.status
        else:
            _record_settled(run, call, tool_version, context, output)
            _succeed(run, action, output, reconciled=True, secrets=secrets)
            return action.status
    _run_and_record(
        action_id,
        executor.Admitted(
            record=record, tool_version=tool_version, context=context, arguments=call.arguments
        ),
    )
    return BusinessAction.objects.get(pk=action_id).status


def _not_started_now(run: Run, action: BusinessAction) -> tuple[str, RunStatus] | None:
    """Why a send that never started is not started now, if it is not, and how its run then
    ends: the user cancelled since, or the approval no longer holds for doing it now (the same
    checks as a resume: a send started now is a new execution)."""
    if run.cancel_requested_at:
        return "The send never started, and the run was cancelled.", RunStatus.CANCELLED
    problems, versions = _revalidation_problems(run, action)
    if problems:
        return (
            f"The send never started, and its approval no longer holds "
            f"({', '.join([*problems, *versions])}).",
            RunStatus.FAILED_FINAL,
        )
    return None


def _record_settled(
    run: Run,
    call: RequestedCall,
    tool_version: ToolVersion,
    context: adapters.ToolContext,
    outcome: ToolOutput | ToolFailed,
) -> None:
    """The call's record, when the worker that made the call died before writing it: the
    outcome settled by the key is its result. A call recorded already keeps its record."""
    record = ToolCall.objects.get(run=run, call_id=call.call_id)
    if record.status != ToolCall.Status.REQUESTED:
        return
    admitted = executor.Admitted(
        record=record, tool_version=tool_version, context=context, arguments=call.arguments
    )
    executor.side_effect_record(
        run, admitted, outcome, max(record.attempts, 1), record.duration_ms or 0
    )


def actions_expire() -> int:
    """End the waiting actions whose approval expired, but for those of runs cancelled
    meanwhile, which end as cancelled; returns how many expired."""
    expired = 0
    due = BusinessAction.objects.filter(
        status=ActionStatus.WAITING_APPROVAL, expires_at__lte=timezone.now()
    ).values_list("pk", flat=True)[:500]
    for action_id in list(due):
        with transaction.atomic():
            locked = _locked(action_id)
            if locked is None or locked[1].status != ActionStatus.WAITING_APPROVAL:
                continue
            # A cancel accepted before the sweep came round stands over the expiry.
            if not _cancel_taken_in(locked[0]):
                _expire(*locked)
                expired += 1
    orphaned = BusinessAction.objects.filter(status=ActionStatus.WAITING_APPROVAL).exclude(
        run__status=RunStatus.WAITING_APPROVAL
    )
    for action_id in list(orphaned.values_list("pk", flat=True)[:500]):
        with transaction.atomic():
            locked = _locked(action_id)
            if locked and locked[1].status == ActionStatus.WAITING_APPROVAL:
                _run_ended(*locked)
    return expired


# What changed, said to the run's user, by the reason an approval no longer holds
# (`_revalidation_problems`).
INVALIDATION_REASONS = {
    "APPROVAL_STALE": "the send could not start before the approval ran out",
    "POLICY_REMOVED": "the approval policy was removed",
    "POLICY_CHANGED": "the approval policy changed",
    "SELF_APPROVAL_NOT_ALLOWED": "the policy no longer lets requesters approve their own",
    "APPROVER_NO_LONGER_AUTHORISED": "the approver may no longer approve it",
    REQUESTER_NO_LONGER_AUTHORISED: "its requester may no longer start runs in the tenant",
    AGENT_CONFIG_INACTIVE: "an admin switched its agent off",
    "PAYLOAD_HASH_CHANGED": "the draft is no longer the one approved",
    "PROJECT_ACCESS_DENIED": "its requester may no longer read the project",
    "DIRECTORY_RECORD_CHANGED": "the recipient's directory record changed",
    "SKILL_VERSION_NOT_AVAILABLE": "a skill or tool version it used may no longer be used",
    "TOOL_VERSION_NOT_AVAILABLE": "a skill or tool version it used may no longer be used",
    "TOOL_DEFINITION_CHANGED": "the send tool's server no longer offers the definition "
    "that was reviewed",
    "WORKFLOW_NOT_AVAILABLE": "its workflow is no longer defined on this platform",
    WORKFLOW_CHANGED: "its workflow was redefined on this platform under the same version",
}


def _invalidation_why(action: BusinessAction, reasons: list[str], versions: list[str]) -> str:
    """What changed, for the run's user: each reason once, in words, with the versions."""
    changes = "; ".join(dict.fromkeys(INVALIDATION_REASONS.get(r, r) for r in reasons))
    if versions:
        changes += f" ({', '.join(versions)})"
    if action.decided_at is None:
        return f"Nothing was sent: the draft could no longer be approved, because {changes}."
    return (
        f"Nothing was sent: the approval no longer held when the send was due, because {changes}."
    )


def _approval_invalidate(
    run: Run, action: BusinessAction, *, reasons: list[str], versions: list[str]
) -> None:
    """The action will not be sent, for `reasons` (the first is its reason), naming the
    `versions` they concern; its run ends FAILED_FINAL APPROVAL_INVALIDATED, saying what
    changed."""
    _transition(action, ActionStatus.INVALIDATED, reason=reasons[0])
    events.approval_invalidated(run, action_id=str(action.pk), reasons=reasons, versions=versions)
    run_finish(
        run=run,
        status=RunStatus.FAILED_FINAL,
        reason_code="APPROVAL_INVALIDATED",
        output={"reasons": reasons} | ({"versions": versions} if versions else {}),
        why=_invalidation_why(action, reasons, versions),
    )


def actions_invalidate_drifted() -> int:
    """Invalidate the waiting actions whose send tool's MCP server no longer serves the
    definition that was reviewed, as the registry records it (`mcp_drift`): an approver would
    approve a contract no longer offered, which the resume would refuse. Returns how many."""
    waiting = BusinessAction.objects.filter(status=ActionStatus.WAITING_APPROVAL)
    version_ids = waiting.filter(tool_version__adapter_kind=AdapterKind.MCP).values_list(
        "tool_version_id", flat=True
    )
    send_tools = versions_frozen(
        model=ToolVersion, ids={str(version_id) for version_id in version_ids.distinct()}
    )
    drifted = mcp_drift(send_tools.values())
    invalidated = 0
    for action_id, version_id in waiting.filter(tool_version_id__in=list(drifted)).values_list(
        "pk", "tool_version_id"
    ):
        send_tool = send_tools[str(version_id)]
        with transaction.atomic():
            locked = _locked(action_id)
            if locked is None or locked[1].status != ActionStatus.WAITING_APPROVAL:
                continue
            run, action = locked
            # A cancel accepted before the sweep came round stands over the drift. Read again
            # with the action locked: a server that serves the reviewed definition again, and
            # a call that recorded it, undo the drift.
            if _cancel_taken_in(run) or _run_ended(run, action) or not mcp_drift([send_tool]):
                continue
            _approval_invalidate(
                run,
                action,
                reasons=["TOOL_DEFINITION_CHANGED"],
                versions=[send_tool.qualified_name],
            )
            invalidated += 1
    return invalidated


# An approved or executing action untouched this long lost its task.
STALLED_AFTER = timedelta(minutes=5)


def actions_resume_stalled() -> int:
    """Send the resume task again for approved or executing actions idle past
    `STALLED_AFTER` (a lost task, a dead worker); returns how many were sent. One the broker
    did not take stays stalled, for the next sweep."""
    stalled = BusinessAction.objects.filter(
        status__in=[ActionStatus.APPROVED, ActionStatus.EXECUTING],
        updated_at__lt=timezone.now() - STALLED_AFTER,
    ).values_list("pk", flat=True)[:500]
    return sum(task_send(tasks.action_resume, action_id=str(action_id)) for action_id in stalled)


def actions_reconcile_overdue() -> int:
    """Send again the reconciliation of unknown actions whose next attempt is overdue by
    `RECONCILE_LOST_AFTER` and that have attempts left: its message was lost (the broker was
    unreachable when it was sent, a worker died holding it, Redis restarted empty). A message
    that was only late makes no second attempt: both carry the attempt's number. Returns how
    many were sent; one the broker did not take stays due, for the next sweep."""
    overdue = (
        BusinessAction.objects.filter(
            status=ActionStatus.UNKNOWN,
            reconcile_due_at__lt=timezone.now() - RECONCILE_LOST_AFTER,
            reconcile_attempts__lt=RECONCILE_ATTEMPTS,
        )
        .order_by("reconcile_due_at")
        .values_list("pk", "reconcile_attempts")[:500]
    )
    return sum(
        task_send(tasks.action_reconcile, action_id=str(action_id), attempt=attempts + 1)
        for action_id, attempts in overdue
    )


# --- the human queue: requests the route leaves to people ---------------------------------

HANDOFF_OUTCOMES = {
    HandoffStatus.HANDLED: (RunStatus.COMPLETED, "HANDLED_BY_PERSON"),
    HandoffStatus.DECLINED: (RunStatus.REFUSED, "DECLINED_BY_PERSON"),
}


def handoff_open(*, run: Run, risks: list[str], request: str) -> Handoff:
    """Leave a run's request to people; the step that calls this makes the run wait."""
    handoff = Handoff.objects.create(
        tenant_id=run.tenant_id,
        run=run,
        requester_id=run.actor_id,
        skill=run.skill,
        risks=risks,
        request=request,
    )
    events.handoff_requested(run, handoff_id=str(handoff.pk), risks=risks)
    return handoff


def handoff_withdraw(*, run: Run, reason: str) -> Handoff | None:
    """Withdraw the open handoff of a locked run that ends before anyone handled it
    (`reason`, the run's reason code, e.g. CANCELLED_BY_USER): it leaves the human queue and
    nobody may act on it any more. Returns the withdrawn handoff, if any."""
    handoff = Handoff.objects.select_for_update().filter(run=run, status=HandoffStatus.OPEN).first()
    if handoff is None:
        return None
    handoff.status = HandoffStatus.WITHDRAWN
    handoff.status_reason = reason
    handoff.resolved_at = timezone.now()
    handoff._change_reason = reason
    handoff.save(update_fields=["status", "status_reason", "resolved_at"])
    events.handoff_resolved(
        run,
        handoff_id=str(handoff.pk),
        outcome=HandoffStatus.WITHDRAWN,
        resolved_by=None,
        note="",
        reason=reason,
    )
    return handoff


def may_handle(handoff: Handoff, person: AbstractBaseUser) -> bool:
    """People with an approver role of the run's policy in the handoff's tenant, which is no
    evaluation sandbox."""
    if handoff.tenant.sandbox_of_id:
        return False
    if not user_can(user=person, action=Action.APPROVAL_DECIDE, tenant=handoff.tenant):
        return False
    if person.is_superuser:
        return True
    approver_roles = handoff.run.capability.get("approval_policy", {}).get("approver_roles", [])
    return bool(set(user_roles(user=person, tenant=handoff.tenant)) & set(approver_roles))


def handoff_may_handle(*, handoff: Handoff, person: AbstractBaseUser) -> bool:
    """Whether `handoff_resolve` would let `person` handle `handoff` (their role, and not
    their own request), for a page to offer the form only then."""
    return person.pk != handoff.requester_id and may_handle(handoff, person)


def handoff_handler_check(*, handoff: Handoff, person: AbstractBaseUser) -> None:
    """Refuse someone who may not handle `handoff`: a person of its tenant learns that they
    lack the role (permission denied); anyone else does not learn that it exists; its
    requester, that they may not handle their own request (self-approval forbidden)."""
    if not may_handle(handoff, person):
        _refuse(
            person,
            tenant=handoff.tenant,
            approver_roles=handoff.run.capability.get("approval_policy", {}).get(
                "approver_roles", []
            ),
            denied="Only a person with an approver role of the run's policy may handle it.",
            not_found=NotFound("No such handoff.", details={"id": str(handoff.pk)}),
        )
    if person.pk == handoff.requester_id:
        raise SelfApprovalForbidden("You may not handle a request you made.")


def handoff_resolve(
    *, handoff_id: Any, person: AbstractBaseUser, outcome: HandoffStatus | str, note: str
) -> Handoff:
    """Handle or decline an open handoff, once. Who may not handle it (the requester among
    them) is refused as `handoff_handler_check` says. The run ends with the note (a
    credential pasted into it removed): COMPLETED (HANDLED_BY_PERSON) or REFUSED
    (DECLINED_BY_PERSON); its next step says who handled or declined it, quoting the note."""
    status, reason_code = HANDOFF_OUTCOMES[HandoffStatus(outcome)]
    note = secrets_removed(note)
    with transaction.atomic():
        found = Handoff.objects.select_related("tenant", "run").filter(pk=handoff_id).first()
        if found is None:
            raise NotFound("No such handoff.", details={"id": str(handoff_id)})
        handoff_handler_check(handoff=found, person=person)
        run = Run.objects.select_for_update().get(pk=found.run_id)
        handoff = Handoff.objects.select_for_update().get(pk=found.pk)
        # Raised after commit: the cancel is kept.
        cancelled = _cancel_taken_in(run)
        if not cancelled:
            _handoff_resolve_locked(run, handoff, person, outcome, note, status, reason_code)
    if cancelled:
        raise AlreadyDecided(
            "The run was cancelled; this request is closed.", details={"run_status": run.status}
        )
    return handoff


def _handoff_resolve_locked(
    run: Run,
    handoff: Handoff,
    person: AbstractBaseUser,
    outcome: HandoffStatus | str,
    note: str,
    status: RunStatus,
    reason_code: str,
) -> None:
    if handoff.status == HandoffStatus.WITHDRAWN:
        raise AlreadyDecided(
            "The run ended before anyone handled this request; it is closed.",
            details={
                "status": handoff.status,
                "reason": handoff.status_reason,
                "run_status": run.status,
            },
        )
    if handoff.status != HandoffStatus.OPEN or run.status != RunStatus.WAITING_APPROVAL:
        raise AlreadyDecided(
            "This request was already handled, or its run ended.",
            details={"status": handoff.status, "run_status": run.status},
        )
    handoff.status = outcome
    handoff.resolved_by = person
    handoff.note = note
    handoff.resolved_at = timezone.now()
    handoff.save(update_fields=["status", "resolved_by", "note", "resolved_at"])
    events.handoff_resolved(
        run,
        handoff_id=str(handoff.pk),
        outcome=outcome,
        resolved_by=person.get_username(),
        note=note,
        reason=reason_code,
    )
    if status == RunStatus.COMPLETED:
        run_transition(run=run, status=RunStatus.RUNNING, save=False)
    who = person.get_username()
    if status == RunStatus.REFUSED:
        why = f'Nothing was done: {who} declined the request, saying "{visible(note)}".'
    else:
        why = f'{who} handled the request, saying "{visible(note)}".'
    run_finish(
        run=run,
        status=status,
        reason_code=reason_code,
        output={"handoff_id": str(handoff.pk), "note": note},
        why=why,
    )
