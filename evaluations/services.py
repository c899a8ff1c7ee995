"""Eval runs: a suite's cases through the real engine, in a sandbox tenant of the run's own.

The sandbox uses the registry of the tenant being evaluated, serves exactly the skill version
under test (published or not), holds each case's business data in turn, and never executes a
side effect (`runs.tools.executor`: tools that are not reads answer as a dry run). Nobody
approves in a sandbox: a case whose run reaches an approval is observed there.

Each case's result is written once (unique per eval run and case) as soon as it is known;
the message idempotency keys are derived from the eval run and the case, so a case resumed
after a worker restart continues its own runs instead of starting new ones.
"""

import hashlib
import logging
import time
import uuid
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.core.files.base import ContentFile
from django.db import DatabaseError, IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from config.celery import task_send
from config.errors import ApplicationError
from evaluations import tasks
from evaluations.choices import EVAL_RUN_ACTIVE, EVAL_RUN_TRANSITIONS, EvalRunStatus
from evaluations.errors import (
    InvalidEvalRunTransition,
    NotFound,
    PermissionDenied,
    ValidationFailed,
)
from evaluations.gates import (
    SUITE_CASE_FIELDS,
    skill_content_hash,
    suite_change_check,
    suite_changed,
    suite_content_hash,
    threshold_change_check,
)
from evaluations.metrics import Outcome, case_failures, metrics_compute
from evaluations.models import EvalCase, EvalCaseResult, EvalRun, EvalSuite, EvalThreshold
from evaluations.observe import observe
from examples.demo import projects_load
from examples.models import Project
from registry.choices import Role, VersionStatus
from registry.models import AgentConfig, ModelConfig, Policy, SkillVersion, Tenant
from registry.selectors import tenant_has_grant, user_may_publish
from registry.services.common import audited_delete, audited_save, full_clean_or_raise
from registry.services.tenancy import membership_add, tenant_create
from runs.choices import Channel, RunStatus
from runs.models import Attachment, Run, Session
from runs.services.attachments import attachment_display_name, attachment_store
from runs.services.ingress import message_ingest
from runs.tasks import run_execute_in_turn

logger = logging.getLogger(__name__)

SANDBOX_USER_PREFIX = "eval-"
# Tasks of an eval run that may raise in a row, no case's result kept between them, before it
# ends FAILED: a case that raises every time would otherwise have every sweep send it again.
EVAL_RUN_FAILURES_MAX = 3


def _transition(eval_run: EvalRun, status: EvalRunStatus, *, reason: str = "") -> None:
    if eval_run.status == status:
        return
    if status not in EVAL_RUN_TRANSITIONS[eval_run.status]:
        raise InvalidEvalRunTransition(
            f"An eval run {eval_run.status} cannot become {status}.",
            details={"from": eval_run.status, "to": status},
        )
    eval_run.status = status
    eval_run.status_reason = reason
    now = timezone.now()
    if status == EvalRunStatus.RUNNING:
        eval_run.started_at = now
    if status not in EVAL_RUN_ACTIVE:
        eval_run.finished_at = now
        eval_run.lease_expires_at = None
    eval_run.save(
        update_fields=[
            "status",
            "status_reason",
            "started_at",
            "finished_at",
            "lease_expires_at",
            "metrics",
            "cases_done",
        ]
    )


def eval_threshold_save(
    *, threshold: EvalThreshold, actor: AbstractBaseUser, reason: str = "saved"
) -> EvalThreshold:
    """Save a release gate's threshold. A change that weakens the gate (`threshold_change_check`)
    needs the standing of an override, or a publisher could lower the bar and then publish
    without one; its history record names the fields that weakened it."""
    full_clean_or_raise(threshold)
    with transaction.atomic():
        weakened = threshold_change_check(threshold=threshold, actor=actor)
        if weakened:
            reason = f"{reason}; weakens the release gate: {', '.join(weakened)}"
        audited_save(threshold, actor=actor, reason=reason)
    return threshold


def eval_suite_save(
    *, suite: EvalSuite, actor: AbstractBaseUser, reason: str = "saved"
) -> EvalSuite:
    """Save a suite; another kind changes what the gates measured on it count."""
    full_clean_or_raise(suite)
    with transaction.atomic():
        if not suite._state.adding:
            saved = EvalSuite.objects.select_for_update().get(pk=suite.pk)
            if saved.kind != suite.kind:
                suite_change_check(suites=[saved], actor=actor)
                suite_changed(suites=[saved])
        audited_save(suite, actor=actor, reason=reason)
    return suite


def _case_locked(case: EvalCase) -> EvalCase:
    """The stored case, locked after the rows of the suites it is in and goes to, in the
    order of their primary keys: suite rows first, as an install (`suites_install`) and an
    eval run's start lock them, so that a save and an install of its suites wait for each
    other rather than deadlock."""
    while True:
        stored = EvalCase.objects.filter(pk=case.pk).values_list("suite_id", flat=True).first()
        suites = {case.suite_id, stored} - {None}
        list(
            EvalSuite.objects.select_for_update().filter(pk__in=suites).order_by("pk").values("pk")
        )
        saved = (
            EvalCase.objects.select_for_update(of=("self",)).select_related("suite").get(pk=case.pk)
        )
        # Moved meanwhile to a suite not locked here: lock that one too and read it again.
        if saved.suite_id in suites:
            return saved


def eval_case_save(*, case: EvalCase, actor: AbstractBaseUser, reason: str = "saved") -> EvalCase:
    """Save a case; a new one, or a change to what it is (`SUITE_CASE_FIELDS`, its suite),
    changes the suites the gates measured on them count. Its title is only a label."""
    full_clean_or_raise(case)
    with transaction.atomic():
        saved = None if case._state.adding else _case_locked(case)
        if saved is None:
            changed = [case.suite]
        elif saved.suite_id != case.suite_id:
            changed = [saved.suite, case.suite]
        elif any(getattr(saved, field) != getattr(case, field) for field in SUITE_CASE_FIELDS):
            changed = [case.suite]
        else:
            changed = []
        if changed:
            suite_change_check(suites=changed, actor=actor)
            suite_changed(suites=changed)
        audited_save(case, actor=actor, reason=reason)
    return case


def eval_case_delete(*, case: EvalCase, actor: AbstractBaseUser, reason: str = "deleted") -> None:
    """Delete a case no eval run has a result of: like a case added, it changes the suite
    the gates measured on it count, and an eval run under way no longer measures that suite.
    A case with a result is refused: the result is what a release gate counts. Its row held, a
    result written meanwhile is either counted here or refused at its commit, its case gone
    (`_case_record`), whatever the page that asked for the deletion found before. An eval run
    under way that was to run it no longer does, and counts one case fewer to run, or it would
    end short of its total."""
    with transaction.atomic():
        try:
            saved = _case_locked(case)
        except EvalCase.DoesNotExist as error:
            raise NotFound("No such eval case.") from error
        measured = EvalCaseResult.objects.filter(case=saved).count()
        if measured:
            runs = "eval run" if measured == 1 else "eval runs"
            raise ValidationFailed(
                f"{saved} is measured in {measured} {runs}, evidence a release gate may count: "
                "the case is kept."
            )
        suite_change_check(suites=[saved.suite], actor=actor)
        suite_changed(suites=[saved.suite])
        EvalRun.objects.filter(cases=saved, status__in=EVAL_RUN_ACTIVE).update(
            cases_total=F("cases_total") - 1
        )
        audited_delete(saved, actor=actor, reason=reason)


def eval_run_start(
    *,
    actor: AbstractBaseUser,
    suite: EvalSuite,
    skill_version: SkillVersion,
    agent_config: AgentConfig,
    model_config: ModelConfig | None = None,
) -> tuple[EvalRun, bool]:
    """Queue a suite against one skill version with an agent's configuration (its model, or
    `model_config` to compare models). Only someone who may publish the skill may evaluate it.
    While an eval run of the same suite and version, as they are, with the same agent and
    model is queued or running, a start (a request sent again) gives that one. Returns the
    eval run and whether it is new."""
    tenant = agent_config.tenant
    skill = skill_version.skill
    if not user_may_publish(user=actor, definition=skill, tenant=tenant):
        raise PermissionDenied("Only a publisher of this skill may evaluate its versions.")
    problems = {}
    if not tenant_has_grant(tenant=tenant, definition=skill):
        problems["skill_version"] = [f"{tenant.slug} may not use {skill.name}."]
    if suite.tenant_id not in (None, tenant.pk):
        problems["suite"] = ["This suite belongs to another tenant."]
    elif suite.skill_name != skill.name:
        problems["suite"] = [f"This suite evaluates {suite.skill_name}, not {skill.name}."]
    if not agent_config.is_active:
        problems["agent_config"] = [f"{agent_config.name} is not active."]
    model_config = model_config or agent_config.model_config
    if model_config.tenant_id not in (None, tenant.pk):
        problems["model_config"] = ["This model configuration belongs to another tenant."]
    elif not model_config.is_active:
        problems["model_config"] = [f"{model_config.name} is not active."]
    if problems:
        raise ValidationFailed("The eval run cannot start.", details=problems)
    with transaction.atomic():
        # Starts of one version wait for each other here: one of two at once finds the other.
        # An edit of the draft (`skill_version_changed`) either comes before the hash or marks
        # the run.
        status = (
            SkillVersion.objects.select_for_update()
            .filter(pk=skill_version.pk)
            .values_list("status", flat=True)
            .get()
        )
        # A revoked version is never used again (`version_ids_withdrawn`): each case's run
        # would end SKILL_VERSION_NOT_AVAILABLE, measuring nothing of it.
        if status == VersionStatus.REVOKED:
            raise ValidationFailed(
                "The eval run cannot start.",
                details={"skill_version": [f"{skill_version} is revoked: no run may use it."]},
            )
        # A change to the suite (`suite_changed`) either comes before the hash or marks the run.
        list(EvalSuite.objects.select_for_update().filter(pk=suite.pk).values("pk"))
        measured = {
            "suite": suite,
            "skill_version": skill_version,
            "skill_content_hash": skill_content_hash(skill_version),
            "suite_content_hash": suite_content_hash(suite),
            "model_config": model_config,
            "agent_config": agent_config,
        }
        active = EvalRun.objects.filter(
            **measured,
            status__in=EVAL_RUN_ACTIVE,
            suite_changed=False,
            skill_version_changed=False,
        ).first()
        if active is not None:
            return active, False
        eval_run = EvalRun.objects.create(
            tenant=tenant,
            **measured,
            cases_total=suite.cases.count(),
            created_by=actor,
            # No worker taking it by then (its task lost, the broker down), the sweep sends
            # it again.
            lease_expires_at=timezone.now() + timedelta(seconds=settings.EVAL_CASE_LEASE_SECONDS),
        )
        eval_run.cases.set(suite.cases.all())
        transaction.on_commit(
            lambda: task_send(tasks.eval_run_advance, eval_run_id=str(eval_run.pk))
        )
    return eval_run, True


def eval_run_cancel(*, eval_run: EvalRun, actor: AbstractBaseUser) -> EvalRun:
    """Stop an eval run between cases; the results so far stay."""
    if not user_may_publish(
        user=actor, definition=eval_run.skill_version.skill, tenant=eval_run.tenant
    ):
        raise PermissionDenied("Only a publisher of this skill may cancel its eval runs.")
    with transaction.atomic():
        eval_run = EvalRun.objects.select_for_update().get(pk=eval_run.pk)
        _transition(eval_run, EvalRunStatus.CANCELLED, reason=f"cancelled by {actor}")
    return eval_run


def _lease(eval_run: EvalRun) -> None:
    eval_run.lease_expires_at = timezone.now() + timedelta(seconds=settings.EVAL_CASE_LEASE_SECONDS)
    eval_run.save(update_fields=["lease_expires_at"])


def eval_run_lease_through(*, eval_run_id: Any, seconds: float) -> None:
    """Hold an active eval run's lease through a wait of its task before it runs its case
    again, and a case's lease after it: the sweep sends an eval run whose lease lapsed again,
    which would run the case before the wait is over."""
    with transaction.atomic():
        eval_run = (
            EvalRun.objects.select_for_update()
            .filter(pk=eval_run_id, status__in=EVAL_RUN_ACTIVE)
            .first()
        )
        if eval_run is not None:
            eval_run.lease_expires_at = timezone.now() + timedelta(
                seconds=seconds + settings.EVAL_CASE_LEASE_SECONDS
            )
            eval_run.save(update_fields=["lease_expires_at"])


def _sandbox(eval_run: EvalRun) -> Tenant:
    """The eval run's sandbox tenant, its user and its agent, created once."""
    if eval_run.sandbox_id:
        return eval_run.sandbox
    name = f"{SANDBOX_USER_PREFIX}{eval_run.pk.hex[:12]}"
    sandbox = tenant_create(actor=None, slug=name, name=f"Evaluation {eval_run.pk}")
    sandbox.sandbox_of = eval_run.tenant
    sandbox.sandbox_skill_version = eval_run.skill_version
    sandbox.save(update_fields=["sandbox_of", "sandbox_skill_version"])
    user = get_user_model().objects.create_user(username=name)
    membership_add(actor=None, user=user, tenant=sandbox, role=Role.MEMBER)
    source_policy = eval_run.agent_config.policy
    policy = Policy.objects.create(
        tenant=sandbox,
        name=source_policy.name,
        approval_required_risks=source_policy.approval_required_risks,
        human_queue_risks=source_policy.human_queue_risks,
        approver_roles=source_policy.approver_roles,
        allow_self_approval=False,
        approval_ttl_seconds=source_policy.approval_ttl_seconds,
        max_data_classification=source_policy.max_data_classification,
    )
    source_agent = eval_run.agent_config
    agent = AgentConfig.objects.create(
        tenant=sandbox,
        name=source_agent.name,
        model_config=eval_run.model_config,
        policy=policy,
        skill_assembly=source_agent.skill_assembly,
        skill_min_score=source_agent.skill_min_score,
        when_no_skill_matches=source_agent.when_no_skill_matches,
        max_steps=source_agent.max_steps,
        max_tool_calls=source_agent.max_tool_calls,
        max_seconds=source_agent.max_seconds,
        max_tokens=source_agent.max_tokens,
        max_cost=source_agent.max_cost,
    )
    agent.skills.add(eval_run.skill_version.skill)
    eval_run.sandbox = sandbox
    eval_run.save(update_fields=["sandbox"])
    return sandbox


def _sandbox_user(sandbox: Tenant) -> AbstractBaseUser:
    return get_user_model().objects.get(username=sandbox.slug)


def _fixture_load(sandbox: Tenant, case: EvalCase) -> None:
    """The case's business data, and nothing of another case's."""
    user = _sandbox_user(sandbox)
    Project.objects.filter(tenant=sandbox).delete()
    projects = [
        (
            project["key"],
            project.get("name", project["key"]),
            [user.username] if project.get("visible", True) else [],
            project.get("updates", []),
            project.get("leads", []),
        )
        for project in case.fixture.get("projects", [])
    ]
    projects_load(tenant=sandbox, projects=projects, users={user.username: user})
    sandbox.sandbox_settings = {
        "faults": case.fixture.get("faults", {}),
        "tool_descriptions": case.fixture.get("tool_descriptions", {}),
    }
    sandbox.save(update_fields=["sandbox_settings"])


def _metadata(case: EvalCase, index: int) -> dict[str, Any]:
    metadata = case.metadata
    if isinstance(metadata, list):
        return metadata[index] if index < len(metadata) else {}
    return metadata


def _attachment(
    sandbox: Tenant, user: AbstractBaseUser, spec: dict[str, str] | None
) -> Attachment | None:
    """The case's attachment, uploaded once: a resumed case sends the same message again."""
    if not spec:
        return None
    content = spec["text"].encode()
    existing = Attachment.objects.filter(
        tenant=sandbox,
        uploaded_by=user,
        original_name=attachment_display_name(spec["name"]),
        sha256=hashlib.sha256(content).hexdigest(),
    ).first()
    if existing is not None:
        return existing
    return attachment_store(
        actor=user,
        tenant=sandbox,
        upload=ContentFile(content, name=spec["name"]),
        declared_media_type="text/plain",
    )


def _session_id(eval_run: EvalRun, case: EvalCase) -> uuid.UUID:
    return uuid.uuid5(eval_run.pk, case.key)


def _case_run(eval_run: EvalRun, case: EvalCase) -> Run:
    """The case's messages, in one session, each run driven to its pause or end in a slot of
    the tenant's concurrent runs (`run_execute_in_turn`, which raises RunWaitsItsTurn when
    none is free)."""
    sandbox = _sandbox(eval_run)
    _fixture_load(sandbox, case)
    user = _sandbox_user(sandbox)
    session, _ = Session.objects.get_or_create(
        id=_session_id(eval_run, case),
        defaults={
            "tenant": sandbox,
            "actor": user,
            "channel": Channel.API,
            "state": case.session_state,
        },
    )
    run = None
    attachment = _attachment(sandbox, user, case.fixture.get("attachment"))
    for index, text in enumerate(case.messages):
        parts = [{"type": "text", "text": text}]
        if attachment is not None and index == 0:
            parts.append({"type": "attachment_ref", "id": str(attachment.pk)})
        run = message_ingest(
            actor=user,
            tenant=sandbox,
            idempotency_key=f"eval:{eval_run.pk}:{case.key}:{index}",
            channel=Channel.API,
            parts=parts,
            metadata=_metadata(case, index),
            session_id=session.pk,
        ).run
        run_execute_in_turn(run_id=str(run.pk))
        # A case of many messages may outlast one lease; the sweep only sees its runs' steps.
        _lease(eval_run)
    return run


def _case_record(
    eval_run: EvalRun, case: EvalCase, run: Run | None, refusal: ApplicationError | None = None
) -> None:
    """The case's result: what its last run shows, or, for a case the platform refused to
    run (a message names an agent or a session the sandbox does not have), the refusal, with
    what the runs of its messages before the refused one did: an injection that succeeded
    there is the case's all the same."""
    if run is None:
        earlier = (
            Run.objects.filter(session_id=_session_id(eval_run, case))
            .order_by("created_at", "pk")
            .last()
        )
        observed = {**(observe(earlier) if earlier is not None else {}), "status": None}
    else:
        observed = observe(run)
    if refusal is not None:
        observed["refused"] = {"code": refusal.code, "message": str(refusal)}
    outcome = Outcome(
        kind=case.suite.kind, expected=case.expected, observed=observed, attack=case.attack
    )
    failures = case_failures(outcome)
    try:
        with transaction.atomic():
            EvalCaseResult.objects.create(
                eval_run=eval_run,
                case=case,
                run=run,
                passed=not failures,
                failures=failures,
                observed=observed,
            )
    except IntegrityError:
        return


def _outcomes(eval_run: EvalRun) -> list[Outcome]:
    return [
        Outcome(
            kind=result.case.suite.kind,
            expected=result.case.expected,
            observed=result.observed,
            attack=result.case.attack,
        )
        for result in eval_run.results.select_related("case__suite")
    ]


def eval_run_advance(*, eval_run_id: Any, seconds: float | None = None) -> bool:
    """Run the cases that have no result yet, one by one, for about `seconds` (all of them
    when None), then compute the metrics once every case has its result. Returns whether
    cases remain. Safe to call twice or after a crash: results are unique and each case's
    runs are idempotent. Raises RunWaitsItsTurn when a case's run waits for its tenant's turn:
    the case runs again, finding its runs, when it is called again."""
    started = time.monotonic()
    with transaction.atomic():
        eval_run = EvalRun.objects.select_for_update().filter(pk=eval_run_id).first()
        if eval_run is None or eval_run.status not in EVAL_RUN_ACTIVE:
            return False
        _transition(eval_run, EvalRunStatus.RUNNING)
        _lease(eval_run)
        _sandbox(eval_run)
    while True:
        done = eval_run.results.values("case_id")
        case = eval_run.cases.exclude(pk__in=done).order_by("key").first()
        if case is None:
            break
        if seconds is not None and time.monotonic() - started > seconds:
            return True
        try:
            run, refusal = _case_run(eval_run, case), None
        except ApplicationError as error:
            run, refusal = None, error
        _case_record(eval_run, case, run, refusal)
        with transaction.atomic():
            eval_run = EvalRun.objects.select_for_update().get(pk=eval_run.pk)
            # Counted also when a cancel came while the case ran: its result is kept.
            eval_run.cases_done = eval_run.results.count()
            if eval_run.status not in EVAL_RUN_ACTIVE:
                eval_run.save(update_fields=["cases_done"])
                return False
            eval_run.attempts = 0
            eval_run.save(update_fields=["cases_done", "attempts"])
            _lease(eval_run)
    with transaction.atomic():
        eval_run = EvalRun.objects.select_for_update().get(pk=eval_run.pk)
        if eval_run.status in EVAL_RUN_ACTIVE:
            eval_run.cases_done = eval_run.results.count()
            eval_run.metrics = metrics_compute(_outcomes(eval_run))
            _transition(eval_run, EvalRunStatus.COMPLETED)
    return False


def eval_run_advance_failed(*, eval_run_id: Any, error: BaseException) -> None:
    """Count a task of an active eval run that raised; at EVAL_RUN_FAILURES_MAX in a row it
    ends FAILED, naming the case it was running and the error."""
    try:
        with transaction.atomic():
            eval_run = (
                EvalRun.objects.select_for_update()
                .filter(pk=eval_run_id, status__in=EVAL_RUN_ACTIVE)
                .first()
            )
            if eval_run is None:
                return
            eval_run.attempts += 1
            eval_run.save(update_fields=["attempts"])
            if eval_run.attempts < EVAL_RUN_FAILURES_MAX:
                return
            case = (
                eval_run.cases.exclude(pk__in=eval_run.results.values("case_id"))
                .order_by("key")
                .first()
            )
            where = f"case {case.key}" if case is not None else "computing the metrics"
            _transition(
                eval_run,
                EvalRunStatus.FAILED,
                reason=f"{where} raised {type(error).__name__} {eval_run.attempts} times in a row",
            )
    except DatabaseError:
        logger.warning("eval run %s: its failed task could not be counted", eval_run_id)


def _case_in_flight(sandbox_id: int) -> bool:
    """Whether a run of the sandbox is taking a step: the step holds its row (PostgreSQL ends
    a dead worker's transaction and its locks), so its worker is alive, however long the
    case has taken (`runs.tasks.runs_sweep` reads a run's the same way)."""
    stepping = Run.objects.filter(
        tenant_id=sandbox_id, status__in=[RunStatus.QUEUED, RunStatus.RUNNING]
    )
    with transaction.atomic():
        free = list(stepping.select_for_update(skip_locked=True).values_list("pk", flat=True))
        return stepping.exclude(pk__in=free).exists()


def eval_runs_leases_renew(eval_run_ids: list[str]) -> None:
    """Renew the lease of the eval runs the sweep sent again: a queue backed up longer than a
    lease would otherwise get another copy of each one's task at every sweep. Once the new
    lease lapses too (the task was lost again, or its worker died), the sweep sends it again.
    One a worker holds, or whose case renewed its lease past this one, keeps its lease."""
    until = timezone.now() + timedelta(seconds=settings.EVAL_CASE_LEASE_SECONDS)
    with transaction.atomic():
        renewed = (
            EvalRun.objects.select_for_update(skip_locked=True)
            .filter(pk__in=eval_run_ids, status__in=EVAL_RUN_ACTIVE, lease_expires_at__lt=until)
            .values_list("pk", flat=True)
        )
        EvalRun.objects.filter(pk__in=list(renewed)).update(lease_expires_at=until)


def eval_runs_stale() -> list[str]:
    """Queued or running eval runs whose lease lapsed (their task was lost, or their worker
    died): to be advanced again. One whose case is still running on a live worker (a case
    may outlast the lease) is not: a second task would run the same case beside it, each
    loading the case's business data into the one sandbox over the other's."""
    lapsed = EvalRun.objects.filter(
        status__in=EVAL_RUN_ACTIVE, lease_expires_at__lt=timezone.now()
    ).values_list("pk", "sandbox_id")[:100]
    return [
        str(pk)
        for pk, sandbox_id in lapsed
        if sandbox_id is None or not _case_in_flight(sandbox_id)
    ]
