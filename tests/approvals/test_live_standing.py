"""What a run does when its tenant, its requester, its versions or its model config change
while it is between steps or waits for approval: nothing withdrawn is used again, and nothing
the snapshot did not pin is asked."""

import pytest
from django.contrib.auth import get_user_model

from approvals import services
from approvals.choices import ActionStatus, Decision
from approvals.models import BusinessAction
from examples.models import MailDelivery
from registry.models import Membership, ModelConfig, SkillVersion, Tenant, ToolVersion
from registry.models.skills import SKILL_CONTENT_FIELDS
from registry.services import skills, tools
from registry.services.common import registry_object_save
from registry.services.tenancy import definition_grant
from runs.loop import Execution, run_advance_step, run_execute
from runs.models import Run, ToolCall
from tests.approvals.conftest import waiting_run
from tests.runs import conftest as runs_fixtures
from tests.runs.conftest import demo_run, events_of, read_apollo

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
    assert smtp_server.messages == []
    assert not MailDelivery.objects.exists()
    assert not ToolCall.objects.filter(run=run, name="mail_send").exists()
    run = Run.objects.get(pk=run.pk)
    assert (run.status, run.reason_code) == ("FAILED_FINAL", "APPROVAL_INVALIDATED")
    assert BusinessAction.objects.get(pk=action.pk).status == ActionStatus.INVALIDATED
    assert events_of(run, "approval.invalidated")[0]["reasons"] == ["TOOL_VERSION_NOT_AVAILABLE"]


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
    # given alice's run, started: it resolved the recipient and is about to ask the model
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

    # when an admin points the same model config at another model before the first turn
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
