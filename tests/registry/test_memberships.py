"""Removing people from a tenant: its own admins do it in the admin, one at a time or a
selection at once, through the service platform admins go through too, or by giving a
membership to another person or tenant. The tenant keeps an admin, and a person left with no
role in it loses their API access to it at once."""

import threading

import pytest
from django.db import connection, transaction

from config.errors import ApplicationError, PermissionDenied, ValidationFailed
from registry.choices import Role
from registry.models import ApiToken, Membership
from registry.services.common import registry_object_save
from registry.services.tenancy import (
    api_token_issue,
    membership_add,
    membership_remove,
    user_save,
)
from tests.conftest import _member
from tests.locks import until, waiting_on_locks
from tests.registry.factories import PASSWORD, UserFactory
from tests.registry.test_admin import messages_of

MEMBERSHIPS = "/admin/registry/membership/"

LAST_ADMIN_OF_ACME = (
    "tina is the last admin of acme: a tenant keeps at least one. "
    "Make another member its admin first."
)


@pytest.fixture
def tenant_admin(acme):
    """tina: acme's only tenant admin, staff, not a platform admin."""
    return _member("tina", acme, Role.ADMIN, is_staff=True)


def membership_of(user, tenant) -> Membership:
    return Membership.objects.get(user=user, tenant=tenant)


def token_of(user, tenant) -> str:
    _, key = api_token_issue(username=user.username, password=PASSWORD, tenant_slug=tenant.slug)
    return key


def runs_with(client, key: str) -> int:
    return client.get("/api/v1/runs", HTTP_AUTHORIZATION=f"Token {key}").status_code


def delete_in_admin(client, membership: Membership):
    return client.post(f"{MEMBERSHIPS}{membership.pk}/delete/", {"post": "yes"}, follow=True)


def delete_selected(client, *memberships: Membership):
    return client.post(
        MEMBERSHIPS,
        {
            "action": "delete_selected",
            "post": "yes",
            "_selected_action": [membership.pk for membership in memberships],
        },
        follow=True,
    )


def test_a_tenant_admin_removes_a_member_whose_token_stops_at_once(
    client, tenant_admin, member, acme
):
    # given alice, a member of acme, using the API with a token for acme
    membership = membership_of(member, acme)
    key = token_of(member, acme)
    assert runs_with(client, key) == 200
    client.force_login(tenant_admin)

    # when acme's admin deletes her membership from its change page
    page = client.get(f"{MEMBERSHIPS}{membership.pk}/change/")
    response = delete_in_admin(client, membership)

    # then she is gone, the history says who removed her, and her token authenticates nothing
    assert f"{MEMBERSHIPS}{membership.pk}/delete/" in page.content.decode()
    assert response.status_code == 200
    assert not Membership.objects.filter(pk=membership.pk).exists()
    removal = Membership.history.filter(id=membership.pk).latest("history_date")
    assert (removal.history_type, removal.history_user, removal.history_change_reason) == (
        "-",
        tenant_admin,
        "removed in admin",
    )
    assert ApiToken.objects.get(user=member).revoked_at is not None
    client.logout()
    assert runs_with(client, key) == 401


def test_a_person_who_keeps_another_role_in_the_tenant_keeps_their_token(
    client, tenant_admin, member, acme
):
    # given alice, a member and an auditor of acme, with a token for acme
    membership_add(actor=tenant_admin, user=member, tenant=acme, role=Role.AUDITOR)
    auditing = Membership.objects.get(user=member, tenant=acme, role=Role.AUDITOR)
    key = token_of(member, acme)

    # when acme's admin removes her auditor role
    membership_remove(actor=tenant_admin, membership=auditing)

    # then she is still a member, and her token still answers
    assert list(Membership.objects.filter(user=member, tenant=acme).values_list("role")) == [
        (Role.MEMBER,)
    ]
    assert ApiToken.objects.get(user=member).revoked_at is None
    assert runs_with(client, key) == 200


def test_a_tenant_admin_cannot_remove_a_membership_of_another_tenant(
    client, tenant_admin, globex_member, globex
):
    # given erin, a member of globex only, with a token for globex
    membership = membership_of(globex_member, globex)
    key = token_of(globex_member, globex)
    client.force_login(tenant_admin)

    # when acme's admin posts the deletion of erin's membership, and calls the service for it
    response = delete_in_admin(client, membership)
    with pytest.raises(PermissionDenied):
        membership_remove(actor=tenant_admin, membership=membership)

    # then it is not found for her, and erin keeps her membership and her token
    assert messages_of(response) == [
        (
            "warning",
            f"membership with ID “{membership.pk}” doesn’t exist. Perhaps it was deleted?",  # noqa: RUF001
        )
    ]
    assert Membership.objects.filter(pk=membership.pk).exists()
    client.logout()
    assert runs_with(client, key) == 200


def test_the_last_admin_of_a_tenant_is_not_removed(client, tenant_admin, acme):
    # given tina, acme's only admin, with a token for acme
    membership = membership_of(tenant_admin, acme)
    key = token_of(tenant_admin, acme)
    client.force_login(tenant_admin)

    # when she deletes her own admin membership
    response = delete_in_admin(client, membership)

    # then it stays, with her token, and the page says why
    assert response.status_code == 200
    assert messages_of(response) == [
        (
            "error",
            "tina is the last admin of acme: a tenant keeps at least one. "
            "Make another member its admin first.",
        )
    ]
    assert Membership.objects.filter(pk=membership.pk).exists()
    client.logout()
    assert runs_with(client, key) == 200


def test_an_admin_leaves_once_the_tenant_has_another(client, tenant_admin, acme):
    # given a second admin of acme
    _member("uma", acme, Role.ADMIN, is_staff=True)
    membership = membership_of(tenant_admin, acme)
    client.force_login(tenant_admin)

    # when tina deletes her own admin membership
    delete_in_admin(client, membership)

    # then she is no longer acme's admin
    assert not Membership.objects.filter(pk=membership.pk).exists()


def test_a_bulk_delete_removes_the_selected_members_of_the_admin_s_tenant_only(
    client, tenant_admin, member, auditor, globex_member, acme, globex
):
    # given alice and carol of acme, erin of globex, each with a token
    keys = [token_of(member, acme), token_of(auditor, acme)]
    erin = membership_of(globex_member, globex)
    client.force_login(tenant_admin)

    # when acme's admin deletes a selection naming all three
    response = delete_selected(
        client, membership_of(member, acme), membership_of(auditor, acme), erin
    )

    # then alice and carol are removed and their tokens end; erin, not in acme's list, stays
    assert messages_of(response) == [("success", "Successfully deleted 2 memberships.")]
    assert set(Membership.objects.filter(tenant=acme).values_list("user__username")) == {("tina",)}
    assert Membership.objects.filter(pk=erin.pk).exists()
    removals = Membership.history.filter(history_type="-")
    assert {record.history_user for record in removals} == {tenant_admin}
    client.logout()
    assert [runs_with(client, key) for key in keys] == [401, 401]


def test_a_bulk_delete_that_would_remove_the_last_admin_removes_nobody(
    client, tenant_admin, member, acme
):
    # given alice, a member of acme, with a token
    key = token_of(member, acme)
    client.force_login(tenant_admin)

    # when acme's only admin deletes a selection of alice and herself
    response = delete_selected(
        client, membership_of(member, acme), membership_of(tenant_admin, acme)
    )

    # then nobody is removed, alice's token still answers, and the page says why
    assert messages_of(response) == [
        (
            "error",
            "tina is the last admin of acme: a tenant keeps at least one. "
            "Make another member its admin first.",
        )
    ]
    assert Membership.objects.filter(tenant=acme).count() == 2
    assert not Membership.history.filter(history_type="-").exists()
    client.logout()
    assert runs_with(client, key) == 200


def test_a_platform_admin_removes_through_the_same_rules(
    client, platform_admin, tenant_admin, member, acme
):
    # given alice with a token for acme, and tina, acme's only admin
    key = token_of(member, acme)
    client.force_login(platform_admin)

    # when a platform admin deletes alice's membership, then tina's
    delete_in_admin(client, membership_of(member, acme))
    refused = delete_in_admin(client, membership_of(tenant_admin, acme))

    # then alice is removed by them and her token ends; acme keeps its last admin
    removal = Membership.history.get(history_type="-")
    assert (removal.user_id, removal.history_user) == (member.pk, platform_admin)
    assert [level for level, _ in messages_of(refused)] == ["error"]
    assert Membership.objects.filter(user=tenant_admin, tenant=acme).exists()
    client.logout()
    assert runs_with(client, key) == 401


def test_the_service_refuses_the_last_admin_to_a_platform_admin_too(
    platform_admin, tenant_admin, acme
):
    membership = membership_of(tenant_admin, acme)

    with pytest.raises(ValidationFailed) as refused:
        membership_remove(actor=platform_admin, membership=membership)

    assert refused.value.message == (
        "tina is the last admin of acme: a tenant keeps at least one. "
        "Make another member its admin first."
    )
    assert Membership.objects.filter(pk=membership.pk).exists()


def test_the_last_admin_of_a_tenant_keeps_the_admin_role(client, tenant_admin, acme):
    # given tina, acme's only admin
    membership = membership_of(tenant_admin, acme)
    client.force_login(tenant_admin)

    # when she changes her own role to member on the membership's page
    response = client.post(
        f"{MEMBERSHIPS}{membership.pk}/change/",
        {"user": "tina", "tenant": acme.pk, "role": Role.MEMBER},
    )

    # then the form is drawn again with the reason, and she is still acme's admin
    assert response.status_code == 200
    assert response.context["adminform"].form.non_field_errors() == [
        "tina is the last admin of acme: a tenant keeps at least one. "
        "Make another member its admin first."
    ]
    membership.refresh_from_db()
    assert membership.role == Role.ADMIN


def test_an_admin_becomes_a_member_once_the_tenant_has_another(client, tenant_admin, acme):
    _member("uma", acme, Role.ADMIN, is_staff=True)
    membership = membership_of(tenant_admin, acme)
    client.force_login(tenant_admin)

    response = client.post(
        f"{MEMBERSHIPS}{membership.pk}/change/",
        {"user": "tina", "tenant": acme.pk, "role": Role.MEMBER},
    )

    assert response.status_code == 302
    membership.refresh_from_db()
    assert membership.role == Role.MEMBER


def change_in_admin(client, membership: Membership, *, user, tenant, role=Role.MEMBER):
    return client.post(
        f"{MEMBERSHIPS}{membership.pk}/change/",
        {"user": user, "tenant": tenant.pk, "role": role},
    )


def test_a_membership_given_to_another_person_ends_the_former_holder_s_token(
    client, tenant_admin, member, acme
):
    # given alice, a member of acme with a token for acme, and bob, in no tenant yet
    UserFactory(username="bob")
    membership = membership_of(member, acme)
    key = token_of(member, acme)
    client.force_login(tenant_admin)

    # when acme's admin gives alice's membership to bob on its change page
    response = change_in_admin(client, membership, user="bob", tenant=acme)

    # then bob is the member, and alice, with no role left in acme, has no access to it
    assert response.status_code == 302
    membership.refresh_from_db()
    assert membership.user.username == "bob"
    assert ApiToken.objects.get(user=member).revoked_at is not None
    client.logout()
    assert runs_with(client, key) == 401


def test_a_membership_moved_to_another_tenant_ends_the_token_for_the_old_one(
    client, platform_admin, member, acme, globex
):
    # given alice, a member of acme with a token for acme
    membership = membership_of(member, acme)
    key = token_of(member, acme)
    client.force_login(platform_admin)

    # when a platform admin moves her membership to globex
    response = change_in_admin(client, membership, user=member.pk, tenant=globex)

    # then she is a member of globex only, and her token for acme authenticates nothing
    assert response.status_code == 302
    assert list(Membership.objects.filter(user=member).values_list("tenant__slug")) == [("globex",)]
    client.logout()
    assert runs_with(client, key) == 401
    assert runs_with(client, token_of(member, globex)) == 200


def test_a_person_who_keeps_another_role_keeps_their_token_when_one_is_given_away(
    client, tenant_admin, member, acme
):
    # given alice, a member and an auditor of acme, with a token for acme
    UserFactory(username="bob")
    membership_add(actor=tenant_admin, user=member, tenant=acme, role=Role.AUDITOR)
    auditing = Membership.objects.get(user=member, tenant=acme, role=Role.AUDITOR)
    key = token_of(member, acme)
    client.force_login(tenant_admin)

    # when acme's admin gives her auditor role to bob
    response = change_in_admin(client, auditing, user="bob", tenant=acme, role=Role.AUDITOR)

    # then she is still a member, and her token still answers
    assert response.status_code == 302
    assert list(Membership.objects.filter(user=member, tenant=acme).values_list("role")) == [
        (Role.MEMBER,)
    ]
    assert ApiToken.objects.get(user=member).revoked_at is None
    client.logout()
    assert runs_with(client, key) == 200


def test_a_change_of_role_only_keeps_the_member_s_token(client, tenant_admin, member, acme):
    membership = membership_of(member, acme)
    key = token_of(member, acme)
    client.force_login(tenant_admin)

    response = change_in_admin(client, membership, user="alice", tenant=acme, role=Role.AUDITOR)

    assert response.status_code == 302
    assert ApiToken.objects.get(user=member).revoked_at is None
    client.logout()
    assert runs_with(client, key) == 200


def test_a_refused_move_keeps_the_former_holder_s_token(client, tenant_admin, member, acme):
    # given bob, a member of acme already, and alice with a token for acme
    _member("bob", acme, Role.MEMBER)
    membership = membership_of(member, acme)
    key = token_of(member, acme)
    client.force_login(tenant_admin)

    # when acme's admin gives alice's membership to bob, who holds that role already
    response = change_in_admin(client, membership, user="bob", tenant=acme)

    # then the form says why, and alice keeps her membership and her token
    assert response.status_code == 200
    assert response.context["adminform"].form.errors
    assert membership_of(member, acme).pk == membership.pk
    assert ApiToken.objects.get(user=member).revoked_at is None
    client.logout()
    assert runs_with(client, key) == 200


@pytest.mark.parametrize(
    ("user", "tenant", "role", "saved"),
    [
        pytest.param("tina", "acme", Role.ADMIN, True, id="unchanged"),
        pytest.param("tina", "acme", Role.MEMBER, False, id="role-changed"),
        pytest.param("uma", "acme", Role.ADMIN, True, id="handed-over"),
        pytest.param("ivy", "acme", Role.ADMIN, False, id="handed-over-to-an-inactive-person"),
        pytest.param("uma", "acme", Role.MEMBER, False, id="handed-over-as-member"),
        pytest.param("tina", "globex", Role.ADMIN, False, id="moved"),
        pytest.param("uma", "globex", Role.ADMIN, False, id="handed-over-and-moved"),
        pytest.param("tina", "globex", Role.MEMBER, False, id="moved-as-member"),
    ],
)
def test_the_last_admin_s_membership_changes_only_when_the_tenant_keeps_an_active_admin(
    client, platform_admin, tenant_admin, acme, globex, user, tenant, role, saved
):
    # given tina, acme's only admin; uma, an active auditor of acme; ivy, a deactivated member
    people = {
        "tina": tenant_admin,
        "uma": _member("uma", acme, Role.AUDITOR, is_staff=True),
        "ivy": _member("ivy", acme, Role.MEMBER, is_active=False),
    }
    tenants = {"acme": acme, "globex": globex}
    membership = membership_of(tenant_admin, acme)
    client.force_login(platform_admin)

    # when a platform admin changes tina's admin membership on its page
    response = change_in_admin(
        client, membership, user=people[user].pk, tenant=tenants[tenant], role=role
    )

    # then it is saved when acme still has an active admin after the save, and is refused
    # with the reason otherwise, tina keeping it
    membership.refresh_from_db()
    if saved:
        assert response.status_code == 302
        assert (membership.user, membership.tenant, membership.role) == (
            people[user],
            tenants[tenant],
            role,
        )
    else:
        assert response.status_code == 200
        assert response.context["adminform"].form.non_field_errors() == [LAST_ADMIN_OF_ACME]
        assert (membership.user, membership.tenant, membership.role) == (
            tenant_admin,
            acme,
            Role.ADMIN,
        )


def test_the_last_admin_hands_their_admin_role_over_and_loses_their_token(
    client, tenant_admin, acme
):
    # given tina, acme's only admin, with a token for acme, and uma, a member of acme
    uma = _member("uma", acme, Role.MEMBER, is_staff=True)
    membership = membership_of(tenant_admin, acme)
    key = token_of(tenant_admin, acme)
    client.force_login(tenant_admin)

    # when tina gives her admin membership to uma on its change page
    response = change_in_admin(client, membership, user="uma", tenant=acme, role=Role.ADMIN)

    # then uma is acme's admin, and tina, with no role left in acme, has no access to it
    assert response.status_code == 302
    assert list(
        Membership.objects.filter(tenant=acme, role=Role.ADMIN).values_list("user__username")
    ) == [("uma",)]
    assert not Membership.objects.filter(user=tenant_admin).exists()
    assert ApiToken.objects.get(user=tenant_admin).revoked_at is not None
    client.logout()
    assert runs_with(client, key) == 401
    assert runs_with(client, token_of(uma, acme)) == 200


@pytest.mark.django_db(transaction=True)
def test_a_person_deactivated_while_given_the_last_admin_role_leaves_the_tenant_an_admin(
    platform_admin, acme
):
    # given tina, acme's only admin, with a token for acme; uma, an auditor of acme; and a
    # transaction holding tina's token, which giving her role away revokes before it commits
    tenant_admin = _member("tina", acme, Role.ADMIN, is_staff=True)
    uma = _member("uma", acme, Role.AUDITOR, is_staff=True)
    token_of(tenant_admin, acme)
    handover = membership_of(tenant_admin, acme)
    handover.user = uma
    deactivated = type(uma).objects.get(pk=uma.pk)
    deactivated.is_active = False
    held, released = threading.Event(), threading.Event()
    outcomes: dict[str, object] = {}

    def hold() -> None:
        with transaction.atomic():
            list(ApiToken.objects.select_for_update().filter(user=tenant_admin))
            held.set()
            released.wait(timeout=20)

    def run(name: str, work) -> None:
        try:
            outcomes[name] = work()
        except ApplicationError as error:
            outcomes[name] = error
        finally:
            connection.close()

    holding = threading.Thread(target=run, args=("hold", hold))
    holding.start()
    assert held.wait(timeout=20)

    # when tina's admin membership is given to uma, and uma is deactivated while that change
    # waits to commit
    handing_over = threading.Thread(
        target=run,
        args=("handover", lambda: registry_object_save(instance=handover, actor=platform_admin)),
    )
    handing_over.start()
    until(lambda: waiting_on_locks() == 1)
    deactivating = threading.Thread(
        target=run, args=("deactivation", lambda: user_save(user=deactivated))
    )
    deactivating.start()
    until(lambda: not deactivating.is_alive() or waiting_on_locks() == 2)
    released.set()
    for thread in (holding, handing_over, deactivating):
        thread.join(timeout=30)

    # then uma became acme's admin, and her deactivation, which came second, was refused
    assert isinstance(outcomes["handover"], Membership)
    assert isinstance(outcomes["deactivation"], ValidationFailed)
    assert outcomes["deactivation"].message == (
        "uma is the last admin of acme: a tenant keeps at least one. "
        "Make another member its admin first."
    )
    assert list(
        Membership.objects.filter(tenant=acme, role=Role.ADMIN).values_list(
            "user__username", "user__is_active"
        )
    ) == [("uma", True)]
