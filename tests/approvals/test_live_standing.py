"""What a run does when its tenant, its requester, its versions, its agent or its model config
change while it is between steps or waits for approval: nothing withdrawn is used again, and
nothing the snapshot did not pin is asked."""

import json

import pytest
from django.contrib.auth import get_user_model
from guardian.shortcuts import assign_perm

from approvals import services
from approvals.choices import ActionStatus, Decision
from approvals.errors import AlreadyDecided
from approvals.models import ApprovalDecision, BusinessAction
from approvals.selectors import actions_for_approver, pending
from examples.models import MailDelivery, Project
from registry.choices import Role
from registry.demo import DEMO_PASSWORD
from registry.models import Membership, ModelConfig, SkillVersion, Tenant, ToolVersion
from registry.models.skills import SKILL_CONTENT_FIELDS
from registry.services import skills, tools
from registry.services.common import registry_object_save
from registry.services.tenancy import definition_grant, membership_add
from runs.loop import Execution, run_advance_step, run_execute
from runs.models import Run, ToolCall
from runs.tasks import runs_sweep
from tests.approvals.conftest import approve, waiting_run
from tests.runs import conftest as runs_fixtures
from tests.runs.conftest import demo_run, event_types, events_of, read_apollo

model_server = runs_fixtures.model_server
fake_model = runs_fixtures.fake_model

TOOL_FIELDS = (
    "description",
    "when_not_to_use",
    "returns",
    "input_schema",
    "risk",
    "timeout_s",
    "data_classification",
    "is_idempotent",
    "approval_rule",
    "adapter_kind",
    "adapter_config",
    "retry_policy",
)


def platform_tool_pinned(demo, name: str) -> ToolVersion:
    """Tool `name` published platform-wide and granted to acme; weekly-summary 3.3.0 (acme),
    current, pins it in place of acme's own."""
    own = ToolVersion.objects.get(tool__tenant=demo.acme, tool__name=name)
    platform = tools.tool_version_publish(
        tool_version=tools.tool_version_create(
            actor=demo.admin,
            tenant=None,
            name=name,
            version="1.0.0",
            **{field: getattr(own, field) for field in TOOL_FIELDS},
        ),
        actor=demo.admin,
    )
    definition_grant(actor=demo.admin, definition=platform.tool, tenant=demo.acme)
    current = SkillVersion.objects.get(skill__tenant=demo.acme, status="published")
    pinned = [
        dependency.tool_version
        for dependency in current.tool_dependencies.select_related("tool_version__tool")
        if dependency.tool_version.tool.name != name
    ]
    skills.skill_version_publish(
        skill_version=skills.skill_version_create(
            actor=demo.admin,
            tenant=demo.acme,
            name=current.skill.name,
            version="3.3.0",
            tool_versions=[*pinned, platform],
            **{name: getattr(current, name) for name in SKILL_CONTENT_FIELDS},
        ),
        actor=demo.admin,
        override_reason=f"pins the platform's {name}",
    )
    return platform


def _nothing_sent(run: Run, smtp_server) -> Run:
    """The run, which sent nothing and ended because its approval no longer held."""
    assert smtp_server.messages == []
    assert not MailDelivery.objects.exists()
    assert not ToolCall.objects.filter(run=run, name="mail_send").exists()
    run = Run.objects.get(pk=run.pk)
    assert (run.status, run.reason_code) == ("FAILED_FINAL", "APPROVAL_INVALIDATED")
    return run


def test_a_grant_withdrawn_after_the_approval_stops_the_send(demo, bob, smtp_server):
    # given an approved run whose send tool is a platform-wide tool granted to acme
    platform = platform_tool_pinned(demo, "mail_send")
    run, action = waiting_run(demo)
    assert action.tool_version_id == platform.pk
    services.approval_decide(
        action_id=action.pk,
        approver=bob,
        decision=Decision.APPROVE,
        payload_hash=action.payload_hash,
    )

    # when the platform admin withdraws acme's use of that tool before the resume
    definition_grant(actor=demo.admin, definition=platform.tool, tenant=demo.acme, granted=False)
    services.action_execute(action_id=action.pk)

    # then nothing is sent: acme may no longer use the tool
    run = _nothing_sent(run, smtp_server)
    assert BusinessAction.objects.get(pk=action.pk).status == ActionStatus.INVALIDATED
    invalidated = events_of(run, "approval.invalidated")[0]
    assert invalidated["reasons"] == ["TOOL_VERSION_NOT_AVAILABLE"]
    assert invalidated["versions"] == [platform.qualified_name]
    assert run.result["output"]["versions"] == [platform.qualified_name]


def test_a_read_tool_whose_grant_is_withdrawn_mid_run_is_not_called(demo):
    # given a run accepted while acme may use the platform's directory_lookup
    platform = platform_tool_pinned(demo, "directory_lookup")
    run = demo_run(demo, project_id="apollo")
    assert str(platform.pk) in {entry["id"] for entry in run.capability["tools"]}

    # when the grant is withdrawn before the run's first step looks the recipient up
    definition_grant(actor=demo.admin, definition=platform.tool, tenant=demo.acme, granted=False)
    run_execute(run_id=str(run.pk))

    # then the lookup is refused, never executed
    call = ToolCall.objects.get(run=run, name="directory_lookup")
    assert (call.status, call.error_category) == ("rejected", "PERMISSION_DENIED")
    assert call.envelope["error"]["message"].endswith("was revoked or is no longer granted.")


def _remove_memberships(demo) -> None:
    Membership.objects.filter(user=demo.alice, tenant=demo.acme).delete()


def _deactivate_user(demo) -> None:
    get_user_model().objects.filter(pk=demo.alice.pk).update(is_active=False)


def _deactivate_tenant(demo) -> None:
    Tenant.objects.filter(pk=demo.acme.pk).update(is_active=False)


@pytest.mark.parametrize(
    "lose_access",
    [_remove_memberships, _deactivate_user, _deactivate_tenant],
    ids=["membership_removed", "user_deactivated", "tenant_deactivated"],
)
def test_a_requester_who_lost_the_tenant_mid_run_reads_nothing_more(demo, lose_access):
    # given alice's run, started: it resolved the recipient and the model asked for the
    # project
    run = demo_run(demo, project_id="apollo")
    execution = Execution()
    assert run_advance_step(run_id=str(run.pk), execution=execution)
    assert list(ToolCall.objects.filter(run=run).values_list("name", flat=True)) == [
        "directory_lookup"
    ]

    # when alice may no longer start runs in acme, before the run's next step
    lose_access(demo)
    run_execute(run_id=str(run.pk))

    # then the run reads no more of acme's data as her, and asks no one to approve anything
    run = Run.objects.get(pk=run.pk)
    assert (run.status, run.reason_code) == ("REFUSED", "REQUESTER_NO_LONGER_AUTHORISED")
    assert list(ToolCall.objects.filter(run=run).values_list("name", flat=True)) == [
        "directory_lookup"
    ]
    assert not BusinessAction.objects.filter(run=run).exists()
    assert events_of(run, "run.finished")


def test_a_skill_version_revoked_mid_run_is_not_used_again(demo):
    # given alice's run, started under weekly-summary's current version
    run = demo_run(demo, project_id="apollo")
    assert run_advance_step(run_id=str(run.pk), execution=Execution())

    # when that version is revoked before the next step
    skills.skill_version_revoke(
        skill_version=SkillVersion.objects.get(pk=run.capability["skills"][0]["id"]),
        actor=demo.admin,
        reason="Leaks data.",
    )
    run_execute(run_id=str(run.pk))

    # then the run drafts no more under it, and asks no one to approve its draft
    run = Run.objects.get(pk=run.pk)
    assert (run.status, run.reason_code) == ("FAILED_FINAL", "SKILL_VERSION_NOT_AVAILABLE")
    assert not ToolCall.objects.filter(run=run, name="project_search").exists()
    assert not BusinessAction.objects.filter(run=run).exists()


def test_a_model_config_edited_mid_run_is_not_asked_in_the_snapshots_name(demo, fake_model):
    # given a run whose snapshot pinned fake-gpt, started (recipient resolved, no turn yet)
    fake = fake_model()
    fake.reply(read_apollo())
    run = demo_run(demo, project_id="apollo")
    assert run.capability["model"]["model"] == "fake-gpt"
    assert run_advance_step(run_id=str(run.pk), execution=Execution())

    # when, before the first turn, the agent moves to the offline planner and an admin points
    # the model config it left, which nothing uses now, at another model
    demo.agent.model_config = ModelConfig.objects.get(name="offline-planner")
    registry_object_save(instance=demo.agent, actor=demo.admin, reason="offline again")
    config = ModelConfig.objects.get(pk=run.capability["model"]["id"])
    config.model_name = "fake-gpt-next"
    registry_object_save(instance=config, actor=demo.admin, reason="upgrade")
    run_execute(run_id=str(run.pk))

    # then the run asks neither model under the other's name: it ends, saying why
    run = Run.objects.get(pk=run.pk)
    assert (run.status, run.reason_code) == ("FAILED_FINAL", "MODEL_CONFIG_CHANGED")
    assert run.result["output"]["now"] == {
        "provider": "openai_compatible",
        "model": "fake-gpt-next",
    }
    assert fake.requests == []
    assert not events_of(run, "model.requested")


def test_a_model_config_switched_off_mid_run_is_not_asked_again(demo, fake_model):
    # given a run whose snapshot pinned fake-gpt, started (recipient resolved, no turn yet)
    fake = fake_model()
    fake.reply(read_apollo())
    run = demo_run(demo, project_id="apollo")
    assert run_advance_step(run_id=str(run.pk), execution=Execution())

    # when an admin switches that model config off before the first turn
    config = ModelConfig.objects.get(pk=run.capability["model"]["id"])
    config.is_active = False
    registry_object_save(instance=config, actor=demo.admin, reason="provider withdrawn")
    run_execute(run_id=str(run.pk))

    # then the run ends without asking it, saying why
    run = Run.objects.get(pk=run.pk)
    assert (run.status, run.reason_code) == ("FAILED_FINAL", "MODEL_CONFIG_INACTIVE")
    assert run.result["output"] == {"model_config": config.name}
    assert fake.requests == []
    assert not events_of(run, "model.requested")


def _switch_agent_off(demo) -> None:
    demo.agent.is_active = False
    registry_object_save(instance=demo.agent, actor=demo.admin, reason="retired")


AGENT_OFF_NEXT_STEP = (
    "An admin switched the agent off; nothing more is done under it. Send the message again "
    "with a new Idempotency-Key to an agent that is on (metadata.agent names it; without it, "
    "the tenant's default), or ask a tenant admin to switch the agent back on."
)


def test_an_agent_switched_off_mid_run_asks_its_model_nothing_more(demo):
    # given alice's run, started: it resolved the recipient and the model asked for the
    # project
    run = demo_run(demo, project_id="apollo")
    assert run_advance_step(run_id=str(run.pk), execution=Execution())
    events_before = event_types(run)

    # when an admin switches the run's agent off before its next step
    _switch_agent_off(demo)
    run_execute(run_id=str(run.pk))

    # then the run ends at that step, saying why and what to do, and asks no model
    run = Run.objects.get(pk=run.pk)
    assert (run.status, run.reason_code) == ("FAILED_FINAL", "AGENT_CONFIG_INACTIVE")
    assert (run.result["status"], run.result["reason_code"], run.result["actions"]) == (
        "FAILED_FINAL",
        "AGENT_CONFIG_INACTIVE",
        [],
    )
    assert run.result["next_step"] == AGENT_OFF_NEXT_STEP
    assert event_types(run) == [*events_before, "run.finished"]
    assert events_of(run, "run.finished") == [
        {"status": "FAILED_FINAL", "reason_code": "AGENT_CONFIG_INACTIVE"}
    ]
    assert list(ToolCall.objects.filter(run=run).values_list("name", flat=True)) == [
        "directory_lookup"
    ]
    assert not BusinessAction.objects.filter(run=run).exists()


def test_an_agent_switched_off_between_steps_of_one_execution_calls_no_more_tools(demo):
    # given alice's run past its first model turn in one execution, its tool calls next
    run = demo_run(demo, project_id="apollo")
    execution = Execution()
    assert run_advance_step(run_id=str(run.pk), execution=execution)
    assert Run.objects.get(pk=run.pk).state["phase"] == "tools"
    calls_before = list(ToolCall.objects.filter(run=run).values_list("name", flat=True))
    events_before = event_types(run)

    # when an admin switches the agent off before the execution's next step
    _switch_agent_off(demo)
    assert not run_advance_step(run_id=str(run.pk), execution=execution)

    # then that step ends the run and calls none of the turn's tools
    run = Run.objects.get(pk=run.pk)
    assert (run.status, run.reason_code) == ("FAILED_FINAL", "AGENT_CONFIG_INACTIVE")
    assert list(ToolCall.objects.filter(run=run).values_list("name", flat=True)) == calls_before
    assert event_types(run) == [*events_before, "run.finished"]
    assert not BusinessAction.objects.filter(run=run).exists()


def _change_role(demo) -> None:
    Membership.objects.filter(user=demo.alice, tenant=demo.acme).update(role=Role.AUDITOR)


def test_an_agent_switched_off_while_its_run_waits_sends_nothing_once_approved(
    demo, bob, smtp_server
):
    # given alice's run waiting for bob's approval
    run, action = waiting_run(demo)

    # when an admin switches the run's agent off, and bob approves the draft afterwards
    _switch_agent_off(demo)
    approve(action, bob)
    services.action_execute(action_id=action.pk)

    # then nothing is sent under the agent, and the run says why
    run = _nothing_sent(run, smtp_server)
    action = BusinessAction.objects.get(pk=action.pk)
    assert (action.status, action.status_reason) == (
        ActionStatus.INVALIDATED,
        "AGENT_CONFIG_INACTIVE",
    )
    assert events_of(run, "approval.invalidated")[0]["reasons"] == ["AGENT_CONFIG_INACTIVE"]
    assert "an admin switched its agent off" in json.dumps(run.result)


def _left_the_queue(run, action, approver, *, reason: str, events_before: list) -> BusinessAction:
    """The run's action, checked withdrawn for `reason`: no longer in the approver's queue,
    and the run's log grown by its invalidation and the run's end alone."""
    action = BusinessAction.objects.get(pk=action.pk)
    assert (action.status, action.status_reason) == (ActionStatus.INVALIDATED, reason)
    assert list(pending(actions_for_approver(user=approver))) == []
    assert event_types(run) == [*events_before, "approval.invalidated", "run.finished"]
    return action


@pytest.mark.parametrize(
    "lose_access",
    [_remove_memberships, _change_role, _deactivate_user],
    ids=["membership_removed", "role_changed", "user_deactivated"],
)
def test_a_requester_who_lost_the_tenant_while_waiting_leaves_the_queue_at_the_sweep(
    demo, bob, smtp_server, lose_access
):
    # given alice's run waiting for bob's approval
    run, action = waiting_run(demo)
    assert list(pending(actions_for_approver(user=bob))) == [action]
    events_before = event_types(run)

    # when alice may no longer start runs in acme, and the sweep comes round
    lose_access(demo)
    runs_sweep()

    # then the run ends refused, as a running one would, and its action leaves bob's queue
    run = Run.objects.get(pk=run.pk)
    assert (run.status, run.reason_code) == ("REFUSED", "REQUESTER_NO_LONGER_AUTHORISED")
    assert (run.result["status"], run.result["reason_code"], run.result["actions"]) == (
        "REFUSED",
        "REQUESTER_NO_LONGER_AUTHORISED",
        [],
    )
    assert run.result["next_step"] == "Ask a tenant admin for access, or change the request."
    action = _left_the_queue(
        run, action, bob, reason="REQUESTER_NO_LONGER_AUTHORISED", events_before=events_before
    )
    assert events_of(run, "approval.invalidated") == [
        {"action_id": str(action.pk), "reasons": ["REQUESTER_NO_LONGER_AUTHORISED"]}
    ]
    assert events_of(run, "run.finished") == [
        {"status": "REFUSED", "reason_code": "REQUESTER_NO_LONGER_AUTHORISED"}
    ]

    # and bob deciding it afterwards is told the run ended first; nothing is sent
    with pytest.raises(AlreadyDecided, match="The run ended before anyone decided"):
        services.approval_decide(
            action_id=action.pk,
            approver=bob,
            decision=Decision.APPROVE,
            payload_hash=action.payload_hash,
        )
    assert not ApprovalDecision.objects.exists()
    assert smtp_server.messages == []


def test_a_run_waiting_under_an_agent_switched_off_leaves_the_queue_at_the_sweep(demo, bob):
    # given alice's run waiting for bob's approval
    run, action = waiting_run(demo)
    events_before = event_types(run)

    # when an admin switches the run's agent off, and the sweep comes round
    _switch_agent_off(demo)
    runs_sweep()

    # then the run ends as a running one would at its next step, and its action leaves the
    # queue
    run = Run.objects.get(pk=run.pk)
    assert (run.status, run.reason_code) == ("FAILED_FINAL", "AGENT_CONFIG_INACTIVE")
    assert run.result["next_step"] == AGENT_OFF_NEXT_STEP
    _left_the_queue(run, action, bob, reason="AGENT_CONFIG_INACTIVE", events_before=events_before)


def test_a_run_waiting_in_a_deactivated_tenant_ends_at_the_sweep(demo):
    # given alice's run waiting for approval
    run, action = waiting_run(demo)

    # when acme is deactivated, and the sweep comes round
    _deactivate_tenant(demo)
    runs_sweep()

    # then the run ends refused and its action is withdrawn
    run = Run.objects.get(pk=run.pk)
    assert (run.status, run.reason_code) == ("REFUSED", "REQUESTER_NO_LONGER_AUTHORISED")
    assert BusinessAction.objects.get(pk=action.pk).status == ActionStatus.INVALIDATED
    assert event_types(run)[-2:] == ["approval.invalidated", "run.finished"]


def test_the_sweep_ends_only_the_runs_whose_requester_lost_the_tenant(demo, bob):
    # given three runs waiting for bob: alice's, frank's (a member of acme too) and the
    # platform admin's
    frank = get_user_model().objects.create_user(username="frank", password=DEMO_PASSWORD)
    membership_add(actor=None, user=frank, tenant=demo.acme, role=Role.MEMBER)
    assign_perm("examples.view_project", frank, Project.objects.get(tenant=demo.acme, key="apollo"))
    alice_run, alice_action = waiting_run(demo)
    kept = [demo_run(demo, actor=frank, project_id="apollo")]
    kept.append(demo_run(demo, actor=demo.admin, project_id="apollo"))
    for run in kept:
        run_execute(run_id=str(run.pk))
    kept_actions = {action.pk for action in BusinessAction.objects.filter(run__in=kept)}
    events_before = {run.pk: event_types(run) for run in kept}

    # when alice is no longer a member of acme, frank's role changes to one that may still
    # start runs and the admin's membership is removed (a platform admin may start runs in
    # any tenant), and the sweep comes round
    _remove_memberships(demo)
    Membership.objects.filter(user=frank, tenant=demo.acme).update(role=Role.SERVICE)
    Membership.objects.filter(user=demo.admin, tenant=demo.acme).delete()
    runs_sweep()

    # then alice's run ends; frank's and the admin's still wait for bob, nothing written
    alice_run = Run.objects.get(pk=alice_run.pk)
    assert (alice_run.status, alice_run.reason_code) == (
        "REFUSED",
        "REQUESTER_NO_LONGER_AUTHORISED",
    )
    assert BusinessAction.objects.get(pk=alice_action.pk).status == ActionStatus.INVALIDATED
    assert list(
        Run.objects.filter(pk__in=[run.pk for run in kept]).values_list("status", flat=True)
    ) == ["WAITING_APPROVAL", "WAITING_APPROVAL"]
    assert {queued.pk for queued in pending(actions_for_approver(user=bob))} == kept_actions
    assert len(kept_actions) == 2
    assert {run.pk: event_types(run) for run in kept} == events_before


def test_a_second_sweep_changes_nothing_more(demo):
    # given alice's waiting run, ended by a sweep after her membership was removed
    run, action = waiting_run(demo)
    _remove_memberships(demo)
    runs_sweep()
    run = Run.objects.get(pk=run.pk)
    events_before = event_types(run)
    action_history = BusinessAction.history.filter(id=action.pk).count()

    # when the sweep comes round again
    runs_sweep()

    # then the run, its action and its events are as the first sweep left them
    assert Run.objects.get(pk=run.pk).updated_at == run.updated_at
    assert event_types(run) == events_before
    assert BusinessAction.history.filter(id=action.pk).count() == action_history
    assert BusinessAction.objects.get(pk=action.pk).status == ActionStatus.INVALIDATED
