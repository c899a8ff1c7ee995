from django.contrib.auth.models import Group
from guardian.shortcuts import assign_perm

from examples.models import Project
from examples.selectors import projects_visible
from tests.registry.factories import UserFactory


def test_a_project_is_visible_through_a_user_or_group_grant_in_its_tenant_only(
    acme, globex, member, platform_admin
):
    granted = Project.objects.create(tenant=acme, key="apollo", name="Apollo")
    through_group = Project.objects.create(tenant=acme, key="hermes", name="Hermes")
    Project.objects.create(tenant=acme, key="atlas", name="Atlas")
    foreign = Project.objects.create(tenant=globex, key="apollo", name="Globex Apollo")
    team = Group.objects.create(name="apollo-team")
    member.groups.add(team)
    assign_perm("examples.view_project", member, granted)
    assign_perm("examples.view_project", team, through_group)
    assign_perm("examples.view_project", member, foreign)

    visible = projects_visible(actor=member, tenant=acme)

    assert sorted(visible.values_list("key", flat=True)) == ["apollo", "hermes"]
    assert not projects_visible(actor=UserFactory(), tenant=acme).exists()
    assert projects_visible(actor=platform_admin, tenant=acme).count() == 3
    assert list(projects_visible(actor=member, tenant=globex)) == [foreign]
