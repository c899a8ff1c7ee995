from django.contrib.auth.models import AbstractBaseUser
from guardian.models import GroupObjectPermission, UserObjectPermission

from examples.models import Project
from registry.models import Tenant

VIEW = "view_project"


def project_for_actor(*, actor: AbstractBaseUser, tenant: Tenant, key: str) -> Project | None:
    """The tenant's project `key` if the actor holds the `view_project` grant on it
    (django-guardian, to the user or one of their groups; superusers see all of the tenant's),
    else None. Index lookups, cheap to plan: this runs at gate 3 of every project tool call."""
    project = Project.objects.filter(tenant=tenant, key=key).order_by().first()
    if project is None or actor.is_superuser:
        return project
    grant = {
        "permission__codename": VIEW,
        "permission__content_type__app_label": Project._meta.app_label,
        "object_pk": str(project.pk),
    }
    if UserObjectPermission.objects.filter(user=actor, **grant).exists():
        return project
    if GroupObjectPermission.objects.filter(group__user=actor, **grant).exists():
        return project
    return None
