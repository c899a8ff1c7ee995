from django.contrib.auth.models import AbstractBaseUser
from guardian.models import GroupObjectPermission, UserObjectPermission

from config.queries import PreparedQuery
from examples.models import Project
from registry.models import Tenant

VIEW = "view_project"
_GRANT = {
    "permission__codename": VIEW,
    "permission__content_type__app_label": Project._meta.app_label,
}
_PROJECT = PreparedQuery(
    lambda tenant_id, key: Project.objects.filter(tenant_id=tenant_id, key=key).order_by()[:1],
    tenant_id=int,
    key=str,
)


def _grant(model: type, holder: str) -> PreparedQuery:
    """Whether the user (`holder`: the user's path in `model`) holds the view grant."""
    return PreparedQuery(
        lambda user_id, object_pk: model.objects.filter(
            **{holder: user_id}, object_pk=object_pk, **_GRANT
        ).values_list("pk", flat=True)[:1],
        user_id=int,
        object_pk=str,
    )


_USER_GRANT = _grant(UserObjectPermission, "user")
_GROUP_GRANT = _grant(GroupObjectPermission, "group__user")


def project_for_actor(*, actor: AbstractBaseUser, tenant: Tenant, key: str) -> Project | None:
    """The tenant's project `key` if the actor holds the `view_project` grant on it
    (django-guardian, to the user or one of their groups; superusers see all of the tenant's),
    else None. Index lookups, cheap to plan: this runs at gate 3 of every project tool call."""
    project = _PROJECT.first(tenant_id=tenant.pk, key=key)
    if project is None or actor.is_superuser:
        return project
    grant = {"user_id": actor.pk, "object_pk": str(project.pk)}
    if _USER_GRANT(**grant) or _GROUP_GRANT(**grant):
        return project
    return None
