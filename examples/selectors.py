from django.contrib.auth.models import AbstractBaseUser
from django.db import DEFAULT_DB_ALIAS
from django.db.models import BooleanField, CharField, Exists, ExpressionWrapper, OuterRef
from django.db.models.functions import Cast
from guardian.models import GroupObjectPermission, UserObjectPermission

from config.queries import PreparedQuery
from examples.models import Project
from registry.models import Tenant

VIEW = "view_project"
_GRANT = {
    "permission__codename": VIEW,
    "permission__content_type__app_label": Project._meta.app_label,
}


def _granted(model: type, holder: str, user_id: int) -> Exists:
    """Whether the user (`holder`: the user's path in `model`) holds the view grant on the
    outer project."""
    return Exists(
        model.objects.filter(
            **{holder: user_id}, object_pk=Cast(OuterRef("pk"), CharField()), **_GRANT
        )
    )


_PROJECT_COLUMNS = tuple(field.attname for field in Project._meta.concrete_fields)
_PROJECT = PreparedQuery(
    lambda tenant_id, key, user_id: (
        Project.objects.filter(tenant_id=tenant_id, key=key)
        .annotate(
            granted=ExpressionWrapper(
                _granted(UserObjectPermission, "user", user_id)
                | _granted(GroupObjectPermission, "group__user", user_id),
                output_field=BooleanField(),
            )
        )
        .order_by()
        .values_list(*_PROJECT_COLUMNS, "granted")[:1]
    ),
    tenant_id=int,
    key=str,
    user_id=int,
)


def project_for_actor(*, actor: AbstractBaseUser, tenant: Tenant, key: str) -> Project | None:
    """The tenant's project `key` if the actor holds the `view_project` grant on it
    (django-guardian, to the user or one of their groups; superusers see all of the tenant's),
    else None. One statement of index lookups, cheap to plan: this runs at gate 3 of every
    project tool call."""
    found = _PROJECT.first(tenant_id=tenant.pk, key=key, user_id=actor.pk)
    if found is None:
        return None
    *columns, granted = found
    if not (granted or actor.is_superuser):
        return None
    return Project.from_db(DEFAULT_DB_ALIAS, _PROJECT_COLUMNS, columns)
