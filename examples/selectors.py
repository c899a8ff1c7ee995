from django.contrib.auth.models import AbstractBaseUser
from django.db.models import CharField, Exists, OuterRef, QuerySet
from django.db.models.functions import Cast
from guardian.models import GroupObjectPermission, UserObjectPermission

from examples.models import Project
from registry.models import Tenant

VIEW = "view_project"


def projects_visible(*, actor: AbstractBaseUser, tenant: Tenant) -> QuerySet[Project]:
    """The tenant's projects the actor holds the `view_project` grant on (django-guardian,
    to the user or one of their groups), in one query; superusers see all of the tenant's."""
    projects = Project.objects.filter(tenant=tenant)
    if actor.is_superuser:
        return projects
    grant = {
        "permission__codename": VIEW,
        "permission__content_type__app_label": Project._meta.app_label,
        "object_pk": Cast(OuterRef("pk"), CharField()),
    }
    return projects.filter(
        Exists(UserObjectPermission.objects.filter(user=actor, **grant))
        | Exists(GroupObjectPermission.objects.filter(group__user=actor, **grant))
    )
