"""The registry's rows in two tenants, as the admin tests find them."""

from types import SimpleNamespace

import pytest

from registry.choices import ApprovalRule, Risk
from registry.models import AgentConfig, Membership, ModelConfig, Policy, RolloutFlag
from registry.services import skills, tools
from registry.services.common import registry_object_save
from registry.services.tenancy import api_token_issue
from tests.registry.factories import PASSWORD


@pytest.fixture
def world(
    platform_admin,
    publisher,
    member,
    globex_member,
    globex_publisher,
    acme,
    globex,
    make_tool_version,
    make_skill_version,
    settings,
):
    """One row or more of every registry model, in two tenants."""
    settings.TENANT_CREDENTIALS = {"acme": ["OPENAI_API_KEY"]}
    project_search_1 = tools.tool_version_publish(
        tool_version=make_tool_version(version="1.0.0"), actor=publisher
    )
    project_search_2 = make_tool_version(
        version="2.0.0", description="Reads a project's status and risks."
    )
    mail_send_1 = make_tool_version(
        name="mail_send",
        actor=globex_publisher,
        tenant=globex,
        description="Sends an approved e-mail.",
        risk=Risk.EXTERNAL_SIDE_EFFECT,
        approval_rule=ApprovalRule.WORKFLOW_SNAPSHOT_REQUIRED,
        adapter_config={"handler": "examples.handlers.mail_send"},
    )
    mail_send_1 = tools.tool_version_publish(tool_version=mail_send_1, actor=globex_publisher)
    weekly_summary_1 = make_skill_version(version="1.0.0", tool_versions=[project_search_1])
    weekly_summary_1 = skills.skill_version_publish(skill_version=weekly_summary_1, actor=publisher)
    weekly_summary_1_1 = make_skill_version(version="1.1.0", tool_versions=[project_search_1])

    def save(instance):
        return registry_object_save(instance=instance, actor=platform_admin)

    offline_planner = save(
        ModelConfig(name="offline-planner", provider="offline", model_name="offline-planner")
    )
    acme_gpt = save(
        ModelConfig(
            tenant=acme,
            name="acme-gpt",
            provider="openai_compatible",
            model_name="gpt-4o-mini",
            credential_ref="OPENAI_API_KEY",
        )
    )
    strict = save(Policy(tenant=acme, name="strict"))
    lenient = save(Policy(tenant=globex, name="lenient", allow_self_approval=True))
    weekly_reporter = save(
        AgentConfig(tenant=acme, name="weekly-reporter", model_config=acme_gpt, policy=strict)
    )
    weekly_reporter.skills.add(weekly_summary_1.skill)
    globex_helper = save(
        AgentConfig(
            tenant=globex, name="globex-helper", model_config=offline_planner, policy=lenient
        )
    )
    canary_flag = save(
        RolloutFlag(
            key="weekly-summary-canary",
            skill=weekly_summary_1.skill,
            skill_version=weekly_summary_1,
            percentage=10,
        )
    )
    paused_flag = save(
        RolloutFlag(
            key="weekly-summary-paused",
            skill=weekly_summary_1.skill,
            skill_version=weekly_summary_1,
            is_active=False,
        )
    )
    dave_token, _ = api_token_issue(username=publisher.username, password=PASSWORD)
    erin_token, _ = api_token_issue(username=globex_member.username, password=PASSWORD)
    memberships = {m.user.username: m for m in Membership.objects.select_related("user")}
    return SimpleNamespace(
        acme=acme,
        globex=globex,
        project_search=project_search_1.tool,
        mail_send=mail_send_1.tool,
        project_search_1=project_search_1,
        project_search_2=project_search_2,
        mail_send_1=mail_send_1,
        weekly_summary=weekly_summary_1.skill,
        weekly_summary_1=weekly_summary_1,
        weekly_summary_1_1=weekly_summary_1_1,
        offline_planner=offline_planner,
        acme_gpt=acme_gpt,
        strict=strict,
        lenient=lenient,
        weekly_reporter=weekly_reporter,
        globex_helper=globex_helper,
        canary_flag=canary_flag,
        paused_flag=paused_flag,
        dave_token=dave_token,
        erin_token=erin_token,
        alice_membership=memberships["alice"],
        dave_membership=memberships["dave"],
        erin_membership=memberships["erin"],
        gus_membership=memberships["gus"],
    )
