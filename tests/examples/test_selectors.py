from django.contrib.auth.models import Group
from guardian.shortcuts import assign_perm

from examples.models import Project
from examples.selectors import project_for_actor
from tests.registry.factories import UserFactory


def test_a_project_is_visible_through_a_user_or_group_grant_in_its_tenant_only(
    acme, globex, member, platform_admin
):
    granted = Project.objects.create(tenant=acme, key="apollo", name="Apollo")
    through_group = Project.objects.create(tenant=acme, key="hermes", name="Hermes")
    atlas = Project.objects.create(tenant=acme, key="atlas", name="Atlas")
    foreign = Project.objects.create(tenant=globex, key="apollo", name="Globex Apollo")
    team = Group.objects.create(name="apollo-team")
    member.groups.add(team)
    assign_perm("examples.view_project", member, granted)
    assign_perm("examples.view_project", team, through_group)
    assign_perm("examples.view_project", member, foreign)
    assign_perm("examples.change_project", member, atlas)

    def visible(actor, tenant):
        return [
            key
            for key in ("apollo", "hermes", "atlas", "zephyr")
            if project_for_actor(actor=actor, tenant=tenant, key=key) is not None
        ]

    assert visible(member, acme) == ["apollo", "hermes"]
    found = project_for_actor(actor=member, tenant=acme, key="apollo")
    assert (found, found.tenant_id, found.name) == (granted, acme.pk, "Apollo")
    assert visible(UserFactory(), acme) == []
    assert visible(platform_admin, acme) == ["apollo", "hermes", "atlas"]
    assert project_for_actor(actor=member, tenant=globex, key="apollo") == foreign
    assert visible(member, globex) == ["apollo"]
