"""People deactivated or deleted on Django's user admin: a tenant keeps an active admin, as it
does when memberships are removed or changed, and a deactivated person's API tokens
authenticate nothing."""

import pytest
from django.contrib.auth import get_user_model

from registry.choices import Role
from registry.models import Membership
from registry.services.tenancy import membership_add
from tests.conftest import _member
from tests.registry.test_admin import messages_of
from tests.registry.test_memberships import runs_with, token_of

USERS = "/admin/auth/user/"


@pytest.fixture
def tenant_admin(acme):
    """tina: acme's only tenant admin."""
    return _member("tina", acme, Role.ADMIN, is_staff=True)


def user_form(user, **changes) -> dict:
    """What the user's change page posts, with `changes`; a box left unticked is not sent."""
    fields = {
        "username": user.username,
        "first_name": user.first_name,
        "last_name": user.last_name,
        "email": user.email,
        "is_active": user.is_active,
        "is_staff": user.is_staff,
        "is_superuser": user.is_superuser,
        "date_joined_0": user.date_joined.strftime("%Y-%m-%d"),
        "date_joined_1": user.date_joined.strftime("%H:%M:%S"),
        "last_login_0": "",
        "last_login_1": "",
        **changes,
    }
    return {name: "on" if value is True else value for name, value in fields.items() if value}


def deactivate_in_admin(client, user):
    return client.post(f"{USERS}{user.pk}/change/", user_form(user, is_active=False))


def delete_in_admin(client, user):
    return client.post(f"{USERS}{user.pk}/delete/", {"post": "yes"}, follow=True)


def delete_selected(client, *users):
    return client.post(
        USERS,
        {
            "action": "delete_selected",
            "post": "yes",
            "_selected_action": [user.pk for user in users],
        },
        follow=True,
    )


def is_active(user) -> bool:
    user.refresh_from_db()
    return user.is_active


LAST_ADMIN_OF_ACME = (
    "tina is the last admin of acme: a tenant keeps at least one. "
    "Make another member its admin first."
)


def test_the_last_admin_of_a_tenant_is_not_deactivated(client, platform_admin, tenant_admin, acme):
    # given tina, acme's only admin, with a token for acme
    key = token_of(tenant_admin, acme)
    client.force_login(platform_admin)

    # when a platform admin unticks her "active" box on her user page
    response = deactivate_in_admin(client, tenant_admin)

    # then the form is drawn again with the reason, and she is active, her token answering
    assert response.status_code == 200
    assert response.context["adminform"].form.non_field_errors() == [LAST_ADMIN_OF_ACME]
    assert is_active(tenant_admin)
    client.logout()
    assert runs_with(client, key) == 200


def test_an_admin_is_deactivated_once_the_tenant_has_another_and_her_token_ends(
    client, platform_admin, tenant_admin, acme
):
    # given a second admin of acme, and tina's token for acme
    _member("uma", acme, Role.ADMIN, is_staff=True)
    key = token_of(tenant_admin, acme)
    client.force_login(platform_admin)

    # when tina is deactivated
    response = deactivate_in_admin(client, tenant_admin)

    # then she is, and her token authenticates nothing
    assert response.status_code == 302
    assert not is_active(tenant_admin)
    client.logout()
    assert runs_with(client, key) == 401


def test_a_deactivated_member_s_token_authenticates_nothing(
    client, platform_admin, tenant_admin, member, acme
):
    # given alice, a member of acme, whose token answers
    key = token_of(member, acme)
    assert runs_with(client, key) == 200
    client.force_login(platform_admin)

    # when she is deactivated on her user page
    response = deactivate_in_admin(client, member)

    # then her token is refused as unauthenticated, and says so
    assert response.status_code == 302
    client.logout()
    refused = client.get("/api/v1/runs", HTTP_AUTHORIZATION=f"Token {key}")
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "AUTHENTICATION_REQUIRED"


def test_an_inactive_admin_does_not_keep_the_tenant_an_admin(
    client, platform_admin, tenant_admin, acme
):
    # given uma, an admin of acme who is deactivated already
    _member("uma", acme, Role.ADMIN, is_staff=True, is_active=False)
    client.force_login(platform_admin)

    # when tina, acme's only active admin, is deactivated
    response = deactivate_in_admin(client, tenant_admin)

    # then she is refused as its last admin
    assert response.context["adminform"].form.non_field_errors() == [LAST_ADMIN_OF_ACME]
    assert is_active(tenant_admin)


def test_an_inactive_last_admin_is_saved_again(client, platform_admin, acme):
    # given uma, acme's only admin, deactivated already (before a tenant kept one)
    uma = _member("uma", acme, Role.ADMIN, is_staff=True, is_active=False)
    client.force_login(platform_admin)

    # when her e-mail address is changed, she left inactive
    response = client.post(f"{USERS}{uma.pk}/change/", user_form(uma, email="uma@acme.example"))

    # then the change is saved: she leaves acme with no fewer active admins than it had
    assert response.status_code == 302
    uma.refresh_from_db()
    assert uma.email == "uma@acme.example"


def test_the_last_admin_of_a_tenant_is_not_deleted(client, platform_admin, tenant_admin, acme):
    client.force_login(platform_admin)

    response = delete_in_admin(client, tenant_admin)

    assert messages_of(response) == [("error", LAST_ADMIN_OF_ACME)]
    assert get_user_model().objects.filter(pk=tenant_admin.pk).exists()
    assert Membership.objects.filter(user=tenant_admin, tenant=acme).exists()


def test_a_bulk_delete_that_would_leave_tenants_without_an_admin_deletes_nobody(
    client, platform_admin, tenant_admin, member, acme, globex
):
    # given tina, the only admin of acme and of globex, and alice, a member of acme
    membership_add(actor=None, user=tenant_admin, tenant=globex, role=Role.ADMIN)
    client.force_login(platform_admin)

    # when a selection of alice and tina is deleted
    response = delete_selected(client, member, tenant_admin)

    # then nobody is, and the page names both tenants
    assert messages_of(response) == [
        (
            "error",
            "tina is the last admin of acme, globex: a tenant keeps at least one. "
            "Make another member its admin first.",
        )
    ]
    assert get_user_model().objects.filter(username__in=["alice", "tina"]).count() == 2
    assert Membership.objects.filter(tenant=acme).count() == 2


def test_a_tenant_s_admins_deleted_together_are_named_together(
    client, platform_admin, tenant_admin, acme
):
    # given acme's two admins, tina and uma
    uma = _member("uma", acme, Role.ADMIN, is_staff=True)
    client.force_login(platform_admin)

    # when a selection of both is deleted
    response = delete_selected(client, tenant_admin, uma)

    # then neither is, since acme would have no admin left
    assert messages_of(response) == [
        (
            "error",
            "tina and uma are the last admins of acme: a tenant keeps at least one. "
            "Make another member its admin first.",
        )
    ]
    assert Membership.objects.filter(tenant=acme, role=Role.ADMIN).count() == 2


def test_a_bulk_delete_removes_people_whose_tenants_keep_an_admin(
    client, platform_admin, tenant_admin, member, acme
):
    # given a second admin of acme, uma, and alice with a token for acme
    uma = _member("uma", acme, Role.ADMIN, is_staff=True)
    key = token_of(member, acme)
    client.force_login(platform_admin)

    # when a selection of alice and uma is deleted
    response = delete_selected(client, member, uma)

    # then both are gone with their memberships and tokens; tina is acme's admin
    assert messages_of(response) == [("success", "Successfully deleted 2 users.")]
    assert list(Membership.objects.filter(tenant=acme).values_list("user__username")) == [("tina",)]
    client.logout()
    assert runs_with(client, key) == 401
