from django.contrib.auth.models import AbstractBaseUser
from django.db.models import CharField, Exists, OuterRef
from django.db.models.functions import Cast
from guardian.models import GroupObjectPermission, UserObjectPermission

from examples.models import Project
from registry.models import Tenant

VIEW = "view_project"


def project_for_actor(*, actor: AbstractBaseUser, tenant: Tenant, key: str) -> Project | None:
    """The tenant's project `key` if the actor holds the `view_project` grant on it
    (django-guardian, to the user or one of their groups; superusers see all of the tenant's),
    else None. One index lookup with the grant as EXISTS: this runs at gate 3 of every
    project tool call."""
    projects = Project.objects.filter(tenant=tenant, key=key).order_by()
    if actor.is_superuser:
        return projects.first()
    grant = {
        "permission__codename": VIEW,
        "permission__content_type__app_label": Project._meta.app_label,
        "object_pk": Cast(OuterRef("pk"), output_field=CharField()),
    }
    return projects.filter(
        Exists(UserObjectPermission.objects.filter(user=actor, **grant))
        | Exists(GroupObjectPermission.objects.filter(group__user=actor, **grant))
    ).first()
