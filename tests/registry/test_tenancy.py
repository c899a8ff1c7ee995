import importlib
from decimal import Decimal
from types import SimpleNamespace

import pytest
from django.apps import apps
from django.contrib.auth.models import Group
from django.db import IntegrityError, transaction

from registry.errors import ValidationFailed
from registry.models import AgentConfig, ModelConfig, Policy, Skill, Tenant, Tool
from registry.selectors import definitions_visible
from registry.services.common import registry_object_save
from registry.services.tenancy import definition_grant, tenant_create
from tests.registry.factories import agent_form_data

GRANT_GROUPS_NAMED = importlib.import_module("registry.migrations.0013_grant_groups_named_by_slug")


@pytest.fixture
def platform_tool(db):
    return Tool.objects.create(tenant=None, name="web_fetch")


def test_a_tenant_given_a_deleted_tenants_slug_inherits_none_of_its_grants(
    platform_admin, platform_tool
):
    initech = tenant_create(actor=platform_admin, slug="initech", name="Initech")
    definition_grant(actor=platform_admin, definition=platform_tool, tenant=initech)
    initech.delete()

    with pytest.raises(ValidationFailed) as refused:
        tenant_create(actor=platform_admin, slug="initech", name="Initech again")

    assert "tenant:initech" in refused.value.details["slug"][0]
    assert "deleted tenant" in refused.value.details["slug"][0]
    assert not Tenant.objects.filter(slug="initech").exists()


def test_a_tenant_given_a_renamed_tenants_old_slug_is_refused_with_the_reason(
    platform_admin, platform_tool
):
    initech = tenant_create(actor=platform_admin, slug="initech", name="Initech")
    definition_grant(actor=platform_admin, definition=platform_tool, tenant=initech)
    Tenant.objects.filter(pk=initech.pk).update(slug="initrode")

    with pytest.raises(ValidationFailed) as refused:
        tenant_create(actor=platform_admin, slug="initech", name="Initech again")

    assert "tenant:initech" in refused.value.details["slug"][0]
    assert "initrode" in refused.value.details["slug"][0]
    initrode = Tenant.objects.get(slug="initrode")
    assert list(definitions_visible(model=Tool, tenant=initrode)) == [platform_tool]


def test_a_tenant_gets_a_grant_group_of_its_own(platform_admin, platform_tool):
    Group.objects.create(name="tenant:initech")

    with pytest.raises(ValidationFailed):
        tenant_create(actor=platform_admin, slug="initech", name="Initech")

    hooli = tenant_create(actor=platform_admin, slug="hooli", name="Hooli")
    assert hooli.grant_group.name == "tenant:hooli"
    assert list(definitions_visible(model=Tool, tenant=hooli)) == []


def test_a_tenant_with_a_taken_slug_is_refused_for_its_slug(platform_admin, acme):
    with pytest.raises(ValidationFailed) as refused:
        tenant_create(actor=platform_admin, slug="acme", name="Acme again")

    assert refused.value.details["slug"] == ["Tenant with this Slug already exists."]


def test_the_admin_refuses_a_deleted_tenants_slug_on_the_slug_field(
    client, platform_admin, platform_tool
):
    initech = tenant_create(actor=platform_admin, slug="initech", name="Initech")
    definition_grant(actor=platform_admin, definition=platform_tool, tenant=initech)
    initech.delete()
    client.force_login(platform_admin)

    response = client.post(
        "/admin/registry/tenant/add/", {"slug": "initech", "name": "Initech", "is_active": "on"}
    )

    assert response.status_code == 200
    assert "tenant:initech" in str(response.context["adminform"].form.errors["slug"])
    assert not Tenant.objects.filter(slug="initech").exists()


def test_a_renamed_tenants_grant_group_follows_and_frees_the_old_slug(
    platform_admin, platform_tool
):
    initech = tenant_create(actor=platform_admin, slug="initech", name="Initech")
    definition_grant(actor=platform_admin, definition=platform_tool, tenant=initech)
    initech.slug = "initrode"

    registry_object_save(instance=initech, actor=platform_admin)
    again = tenant_create(actor=platform_admin, slug="initech", name="Initech again")

    assert Group.objects.get(tenant__slug="initrode").name == "tenant:initrode"
    assert list(definitions_visible(model=Tool, tenant=initech)) == [platform_tool]
    assert again.grant_group.name == "tenant:initech"
    assert list(definitions_visible(model=Tool, tenant=again)) == []


def test_a_tenant_is_not_renamed_to_a_slug_whose_group_name_is_taken(platform_admin):
    Group.objects.create(name="tenant:initrode")
    initech = tenant_create(actor=platform_admin, slug="initech", name="Initech")
    initech.slug = "initrode"

    with pytest.raises(ValidationFailed) as refused:
        registry_object_save(instance=initech, actor=platform_admin)

    assert "tenant:initrode" in refused.value.details["slug"][0]
    assert Tenant.objects.get(pk=initech.pk).slug == "initech"
    assert Group.objects.get(tenant=initech).name == "tenant:initech"


def test_a_tenant_deleted_in_the_admin_leaves_its_slug_to_a_new_tenant(
    client, platform_admin, platform_tool
):
    initech = tenant_create(actor=platform_admin, slug="initech", name="Initech")
    definition_grant(actor=platform_admin, definition=platform_tool, tenant=initech)
    client.force_login(platform_admin)

    response = client.post(f"/admin/registry/tenant/{initech.pk}/delete/", {"post": "yes"})
    again = tenant_create(actor=platform_admin, slug="initech", name="Initech again")

    assert response.status_code == 302
    assert not Group.objects.filter(pk=initech.grant_group_id).exists()
    assert again.grant_group.name == "tenant:initech"
    assert list(definitions_visible(model=Tool, tenant=again)) == []


def test_tenants_deleted_from_the_admin_list_take_their_grant_groups_with_them(
    client, platform_admin, platform_tool, acme
):
    initech = tenant_create(actor=platform_admin, slug="initech", name="Initech")
    hooli = tenant_create(actor=platform_admin, slug="hooli", name="Hooli")
    definition_grant(actor=platform_admin, definition=platform_tool, tenant=initech)
    client.force_login(platform_admin)

    response = client.post(
        "/admin/registry/tenant/",
        {"action": "delete_selected", "_selected_action": [initech.pk, hooli.pk], "post": "yes"},
    )

    assert response.status_code == 302
    assert list(Tenant.objects.values_list("slug", flat=True)) == ["acme"]
    assert not Group.objects.filter(name__in=["tenant:initech", "tenant:hooli"]).exists()
    assert Group.objects.filter(pk=acme.grant_group_id).exists()
    assert tenant_create(actor=platform_admin, slug="hooli", name="Hooli").pk != hooli.pk


def test_the_migration_names_the_grant_groups_of_tenants_renamed_before_by_their_slugs(
    platform_admin, platform_tool, acme, globex
):
    # given tenants renamed as before their groups were renamed with them: initech to
    # initrode, acme and globex to each other's slug, hooli to a slug whose group name a
    # group made by hand holds
    initech = tenant_create(actor=platform_admin, slug="initech", name="Initech")
    hooli = tenant_create(actor=platform_admin, slug="hooli", name="Hooli")
    definition_grant(actor=platform_admin, definition=platform_tool, tenant=initech)
    by_hand = Group.objects.create(name="tenant:pied-piper")
    Tenant.objects.filter(pk=initech.pk).update(slug="initrode")
    Tenant.objects.filter(pk=acme.pk).update(slug="swapping")
    Tenant.objects.filter(pk=globex.pk).update(slug="acme")
    Tenant.objects.filter(pk=acme.pk).update(slug="globex")
    Tenant.objects.filter(pk=hooli.pk).update(slug="pied-piper")

    # when the migration runs
    GRANT_GROUPS_NAMED.grant_groups_named_by_slug(apps, None)

    # then each group is named by its tenant's slug, but for the one whose name is taken
    groups = dict(Tenant.objects.values_list("slug", "grant_group__name"))
    assert groups == {
        "acme": "tenant:acme",
        "globex": "tenant:globex",
        "initrode": "tenant:initrode",
        "pied-piper": "tenant:hooli",
    }
    assert Group.objects.get(tenant__slug="acme").pk == globex.grant_group_id
    assert Group.objects.get(pk=by_hand.pk).name == "tenant:pied-piper"
    initrode = Tenant.objects.get(slug="initrode")
    assert list(definitions_visible(model=Tool, tenant=initrode)) == [platform_tool]


@pytest.mark.parametrize("model", [Tool, Skill])
def test_a_grant_and_its_withdrawal_are_in_the_definitions_history(
    model, platform_admin, acme, globex
):
    definition = model.objects.create(tenant=None, name="triage")
    before = definition.history.count()

    # when a platform admin grants it to acme (twice), to globex, then withdraws acme's (twice)
    for tenant, granted in (
        (acme, True),
        (acme, True),
        (globex, True),
        (acme, False),
        (acme, False),
    ):
        definition_grant(
            actor=platform_admin, definition=definition, tenant=tenant, granted=granted
        )

    # then each change of who may use it is recorded once, with who made it; a repeat is none
    records = definition.history.order_by("history_date")[before:]
    assert [(r.history_user, r.history_change_reason) for r in records] == [
        (platform_admin, "granted to acme"),
        (platform_admin, "granted to globex"),
        (platform_admin, "withdrawn from acme"),
    ]
    assert not definitions_visible(model=model, tenant=acme).exists()
    assert list(definitions_visible(model=model, tenant=globex)) == [definition]


@pytest.fixture
def acme_skills(acme, globex, platform_admin):
    """acme's own skill, a platform skill granted to acme, one granted to globex only, and
    globex's own."""
    own = Skill.objects.create(tenant=acme, name="weekly-summary")
    granted = Skill.objects.create(tenant=None, name="triage")
    ungranted = Skill.objects.create(tenant=None, name="escalate")
    foreign = Skill.objects.create(tenant=globex, name="weekly-summary")
    definition_grant(actor=platform_admin, definition=granted, tenant=acme)
    definition_grant(actor=platform_admin, definition=ungranted, tenant=globex)
    return SimpleNamespace(own=own, granted=granted, ungranted=ungranted, foreign=foreign)


def _offered_skills(response) -> set[str]:
    field = response.context["adminform"].form.fields["skills"]
    return {label for _, label in field.widget.choices}


def test_an_agents_page_offers_the_skills_its_tenant_may_use(
    client, acme, platform_admin, acme_skills
):
    policy = Policy.objects.create(tenant=acme, name="default")
    model = ModelConfig.objects.create(name="offline", provider="offline", model_name="planner")
    agent = AgentConfig.objects.create(
        tenant=acme, name="reporter", model_config=model, policy=policy
    )
    withdrawn = Skill.objects.create(tenant=None, name="archive")
    definition_grant(actor=platform_admin, definition=withdrawn, tenant=acme)
    agent.skills.add(withdrawn)
    definition_grant(actor=platform_admin, definition=withdrawn, tenant=acme, granted=False)
    client.force_login(platform_admin)

    response = client.get(f"/admin/registry/agentconfig/{agent.pk}/change/")

    assert response.status_code == 200
    assert _offered_skills(response) == {
        "acme/core/weekly-summary",
        "platform/core/triage",
        "platform/core/archive",
    }


def test_an_agent_form_drawn_again_offers_the_skills_of_the_tenant_chosen(
    client, acme, platform_admin, acme_skills
):
    policy = Policy.objects.create(tenant=acme, name="default")
    model = ModelConfig.objects.create(name="offline", provider="offline", model_name="planner")
    client.force_login(platform_admin)

    response = client.post(
        "/admin/registry/agentconfig/add/",
        agent_form_data(
            tenant=acme.pk,
            model_config=model.pk,
            policy=policy.pk,
            skills=[acme_skills.own.pk, acme_skills.ungranted.pk],
        ),
    )

    assert response.status_code == 200
    assert response.context["adminform"].form.errors["skills"] == [
        "platform/core/escalate is not granted to acme."
    ]
    assert _offered_skills(response) == {
        "acme/core/weekly-summary",
        "platform/core/triage",
        "platform/core/escalate",
    }
    assert not AgentConfig.objects.exists()


def test_the_admin_refuses_a_negative_daily_cost_quota_on_its_field(client, platform_admin, acme):
    client.force_login(platform_admin)

    response = client.post(
        f"/admin/registry/tenant/{acme.pk}/change/",
        {"slug": "acme", "name": acme.name, "is_active": "on", "daily_cost_quota": "-1"},
    )

    assert response.status_code == 200
    assert response.context["adminform"].form.errors["daily_cost_quota"] == [
        "Ensure this value is greater than or equal to 0."
    ]
    acme.refresh_from_db()
    assert acme.daily_cost_quota is None


def test_the_service_refuses_a_negative_daily_cost_quota(platform_admin, acme):
    acme.daily_cost_quota = Decimal("-0.0001")

    with pytest.raises(ValidationFailed) as refused:
        registry_object_save(instance=acme, actor=platform_admin)

    assert refused.value.details == {
        "daily_cost_quota": ["Ensure this value is greater than or equal to 0."]
    }
    assert Tenant.objects.get(pk=acme.pk).daily_cost_quota is None


def test_the_database_refuses_a_negative_daily_cost_quota(acme):
    with pytest.raises(IntegrityError), transaction.atomic():
        Tenant.objects.filter(pk=acme.pk).update(daily_cost_quota=Decimal("-5"))
