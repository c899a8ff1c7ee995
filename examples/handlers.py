"""The running example's read tools over the example business data.

Both check, before anything is read, that the project exists in the caller's tenant and that
the actor holds the `view_project` grant on it; another tenant's project is refused exactly
like a missing one.
"""

from datetime import date
from typing import Any

from examples.models import DirectoryRecord, Project, ProjectUpdate
from examples.selectors import project_for_actor
from runs.tools.adapters import SourceDraft, ToolContext, ToolOutput, ToolRefused


def _project(context: ToolContext, arguments: dict[str, Any]) -> Project:
    """The authorised project; checked once per call, at gate 3, and reused by the handler."""
    project = context.resources.get("project")
    if project is not None and project.key == arguments["project_id"]:
        return project
    project = project_for_actor(
        actor=context.actor, tenant=context.tenant, key=arguments["project_id"]
    )
    if project is None:
        raise ToolRefused("No such project, or no access to it.")
    context.resources["project"] = project
    return project


class ProjectSearch:
    """project_search@2: the tasks, milestones and risks of a project over a date range."""

    def authorize(self, context: ToolContext, arguments: dict[str, Any]) -> None:
        _project(context, arguments)

    def __call__(self, context: ToolContext, arguments: dict[str, Any]) -> ToolOutput:
        project = _project(context, arguments)
        start, end = date.fromisoformat(arguments["from"]), date.fromisoformat(arguments["to"])
        updates = list(
            ProjectUpdate.objects.filter(project=project, occurred_on__range=(start, end))
        )
        items: dict[str, list[dict[str, Any]]] = {"task": [], "milestone": [], "risk": []}
        sources = []
        for update in updates:
            reference = f"project:{project.key}/update:{update.pk}"
            items[update.kind].append(
                {
                    "title": update.title,
                    "status": update.status,
                    "detail": update.detail,
                    "date": update.occurred_on.isoformat(),
                    "source": reference,
                }
            )
            sources.append(
                SourceDraft(reference=reference, content=f"{update.title}: {update.detail}")
            )
        return ToolOutput(
            business_status="ok",
            raw={
                "project": project.key,
                "name": project.name,
                "from": start.isoformat(),
                "to": end.isoformat(),
                "tasks": items["task"],
                "milestones": items["milestone"],
                "risks": items["risk"],
            },
            normalized={"updates": len(updates), "risks": len(items["risk"])},
            sources=sources,
        )


class DirectoryLookup:
    """directory_lookup@1: the current directory records for a role in a project."""

    def authorize(self, context: ToolContext, arguments: dict[str, Any]) -> None:
        _project(context, arguments)

    def __call__(self, context: ToolContext, arguments: dict[str, Any]) -> ToolOutput:
        project = _project(context, arguments)
        records = DirectoryRecord.objects.filter(
            project=project, role=arguments["role"], is_active=True
        )
        candidates = [
            {
                "record_id": record.record_id,
                "display_name": record.display_name,
                "corporate_email": record.corporate_email or None,
                "record_version": record.version,
            }
            for record in records
        ]
        return ToolOutput(
            business_status="ok",
            raw={"project": project.key, "role": arguments["role"], "candidates": candidates},
            normalized={"count": len(candidates)},
            sources=[
                SourceDraft(
                    reference=f"directory:{record['record_id']}@{record['record_version']}",
                    content=record["display_name"],
                    allowed_use="recipient_resolution",
                )
                for record in candidates
            ],
        )


project_search = ProjectSearch()
directory_lookup = DirectoryLookup()
