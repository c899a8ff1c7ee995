"""Seeds the running example's business data (examples/project_data.py) into the database."""

from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.utils import timezone
from guardian.shortcuts import assign_perm

from examples.models import DirectoryRecord, Project, ProjectUpdate
from examples.project_data import PROJECTS, R_AND_D_LEAD
from registry.models import Tenant


def seed_examples() -> list[str]:
    """Create what is missing; returns what was created."""
    users = {user.username: user for user in get_user_model().objects.all()}
    created = []
    for tenant_slug, projects in PROJECTS.items():
        tenant = Tenant.objects.get(slug=tenant_slug)
        created += projects_load(tenant=tenant, projects=projects, users=users)
    return created


def projects_load(
    *, tenant: Tenant, projects: Iterable[Sequence[Any]], users: dict[str, AbstractBaseUser]
) -> list[str]:
    """Projects in the shape of `examples.project_data.PROJECTS` (updates dated by weekday of
    the current week; a lead may end with False when their record is inactive), those that
    do not exist yet; returns what was created."""
    created = []
    today = timezone.localdate()
    monday = today - timedelta(days=today.weekday())
    for key, name, viewers, updates, leads in projects:
        project, is_new = Project.objects.get_or_create(
            tenant=tenant, key=key, defaults={"name": name}
        )
        if not is_new:
            continue
        created.append(f"project {tenant.slug}/{key}")
        ProjectUpdate.objects.bulk_create(
            ProjectUpdate(
                project=project,
                kind=kind,
                title=title,
                status=status,
                detail=detail,
                occurred_on=monday + timedelta(days=day),
            )
            for kind, title, status, detail, day in updates
        )
        DirectoryRecord.objects.bulk_create(
            DirectoryRecord(
                project=project,
                record_id=record_id,
                role=R_AND_D_LEAD,
                display_name=display_name,
                corporate_email=email,
                version=version,
                is_active=bool(active[0]) if active else True,
            )
            for record_id, display_name, email, version, *active in leads
        )
        for username in viewers:
            assign_perm("examples.view_project", users[username], project)
    return created
