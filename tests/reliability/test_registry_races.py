"""Concurrent lifecycle commands on PostgreSQL: the parent row lock decides, never Python."""

import threading
from collections.abc import Callable

import pytest
from django.db import close_old_connections

from config.errors import ApplicationError, ValidationFailed
from registry.choices import Role, VersionStatus
from registry.models import Membership, Tool, ToolVersion
from registry.services import tools
from registry.services.tenancy import membership_remove, user_save
from tests.conftest import _member

pytestmark = pytest.mark.django_db(transaction=True)


def _race(*calls: Callable[[], object]) -> list[object]:
    """Start every call at the same instant, each on its own connection; return outcomes."""
    barrier = threading.Barrier(len(calls))
    outcomes: list[object] = [None] * len(calls)

    def run(index: int, call: Callable[[], object]) -> None:
        barrier.wait()
        try:
            outcomes[index] = call()
        except ApplicationError as error:
            outcomes[index] = error
        finally:
            close_old_connections()

    threads = [threading.Thread(target=run, args=pair) for pair in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return outcomes


def test_two_publishes_of_one_draft_publish_it_once(make_tool_version, publisher):
    draft = make_tool_version()

    _race(
        lambda: tools.tool_version_publish(tool_version=draft, actor=publisher),
        lambda: tools.tool_version_publish(tool_version=draft, actor=publisher),
    )

    assert ToolVersion.objects.get(pk=draft.pk).status == VersionStatus.PUBLISHED
    assert draft.history.filter(history_change_reason="published").count() == 1


def test_racing_publishes_never_leave_a_lower_version_current(make_tool_version, publisher):
    higher = make_tool_version(version="2.0.0")
    lower = make_tool_version(version="1.5.0")

    outcomes = _race(
        lambda: tools.tool_version_publish(tool_version=lower, actor=publisher),
        lambda: tools.tool_version_publish(tool_version=higher, actor=publisher),
    )

    tool = Tool.objects.get(pk=higher.tool_id)
    assert tool.current_version_id == higher.pk
    published = set(
        ToolVersion.objects.filter(status=VersionStatus.PUBLISHED).values_list("version", flat=True)
    )
    # Whichever commits first, 2.0.0 ends current; 1.5.0 is published only if it went first.
    assert published in ({"2.0.0"}, {"1.5.0", "2.0.0"})
    assert sum(isinstance(outcome, ApplicationError) for outcome in outcomes) == (
        2 - len(published)
    )


def test_revoke_racing_rollback_never_leaves_a_revoked_version_current(
    make_tool_version, publisher
):
    first = tools.tool_version_publish(
        tool_version=make_tool_version(version="1.0.0"), actor=publisher
    )
    tools.tool_version_publish(tool_version=make_tool_version(version="2.0.0"), actor=publisher)

    _race(
        lambda: tools.tool_rollback(tool_version=first, actor=publisher),
        lambda: tools.tool_version_revoke(tool_version=first, actor=publisher),
    )

    tool = Tool.objects.select_related("current_version").get(pk=first.tool_id)
    assert ToolVersion.objects.get(pk=first.pk).status == VersionStatus.REVOKED
    assert tool.current_version.version == "2.0.0"


def _deactivated(user):
    user = type(user).objects.get(pk=user.pk)
    user.is_active = False
    return user


def test_a_tenant_s_two_admins_deactivated_at_once_leave_it_one(acme):
    tina = _member("tina", acme, Role.ADMIN, is_staff=True)
    uma = _member("uma", acme, Role.ADMIN, is_staff=True)

    outcomes = _race(
        lambda: user_save(user=_deactivated(tina)),
        lambda: user_save(user=_deactivated(uma)),
    )

    assert sorted(type(outcome).__name__ for outcome in outcomes) == [
        "NoneType",
        ValidationFailed.__name__,
    ]
    assert Membership.objects.filter(tenant=acme, user__is_active=True).count() == 1


def test_an_admin_deactivated_while_the_other_is_removed_leaves_the_tenant_one(
    acme, platform_admin
):
    tina = _member("tina", acme, Role.ADMIN, is_staff=True)
    uma = _member("uma", acme, Role.ADMIN, is_staff=True)
    uma_admin = Membership.objects.get(user=uma, tenant=acme)

    outcomes = _race(
        lambda: user_save(user=_deactivated(tina)),
        lambda: membership_remove(actor=platform_admin, membership=uma_admin),
    )

    assert sorted(type(outcome).__name__ for outcome in outcomes) == [
        "NoneType",
        ValidationFailed.__name__,
    ]
    assert Membership.objects.filter(tenant=acme, user__is_active=True).count() == 1
