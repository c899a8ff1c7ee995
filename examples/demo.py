"""The running example's business data: acme's projects with this week's tasks, milestones
and risks, their directory records, and who may see which project."""

from datetime import timedelta

from django.contrib.auth import get_user_model
from django.utils import timezone
from guardian.shortcuts import assign_perm

from examples.models import DirectoryRecord, Project, ProjectUpdate
from registry.models import Tenant

R_AND_D_LEAD = "研发负责人"

# key, name, viewers, updates (kind, title, status, detail, day of the week), leads
PROJECTS = {
    "acme": [
        (
            "apollo",
            "Project Apollo",
            ["alice", "bob", "carol"],
            [
                (
                    "task",
                    "API gateway migration",
                    "done",
                    "All services moved to the new gateway.",
                    0,
                ),
                ("task", "Load test plan", "in_progress", "Scenarios agreed; runs next week.", 1),
                ("milestone", "Beta release", "planned", "Feature freeze on Friday.", 4),
                ("risk", "Vendor SDK delay", "open", "The payments SDK slips by a week.", 2),
            ],
            [("dir-1001", "Li Wei", "li.wei@acme.example", 3)],
        ),
        (
            "hermes",
            "Project Hermes",
            ["alice"],
            [("task", "Search relevance tuning", "done", "", 1)],
            [
                ("dir-2001", "Zhang Min", "zhang.min@acme.example", 1),
                ("dir-2002", "Chen Jie", "chen.jie@acme.example", 2),
            ],
        ),
        (
            "zephyr",
            "Project Zephyr",
            ["alice"],
            [("task", "Firmware build", "in_progress", "", 0)],
            [("dir-3001", "Wang Fang", "", 1)],
        ),
        (
            "atlas",
            "Project Atlas",
            ["bob"],
            [("risk", "Budget review", "open", "Confidential.", 0)],
            [("dir-4001", "Zhao Lei", "zhao.lei@acme.example", 1)],
        ),
    ],
    "globex": [
        (
            "portal",
            "Globex Portal",
            ["erin"],
            [("task", "Login redesign", "done", "", 0)],
            [("dir-9001", "Hank Scorpio", "hank@globex.example", 1)],
        ),
    ],
}


def seed_examples() -> list[str]:
    """Create what is missing; returns what was created."""
    created = []
    users = {user.username: user for user in get_user_model().objects.all()}
    today = timezone.localdate()
    monday = today - timedelta(days=today.weekday())
    for tenant_slug, projects in PROJECTS.items():
        tenant = Tenant.objects.get(slug=tenant_slug)
        for key, name, viewers, updates, leads in projects:
            project, is_new = Project.objects.get_or_create(
                tenant=tenant, key=key, defaults={"name": name}
            )
            if not is_new:
                continue
            created.append(f"project {tenant_slug}/{key}")
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
                )
                for record_id, display_name, email, version in leads
            )
            for username in viewers:
                assign_perm("examples.view_project", users[username], project)
    return created
