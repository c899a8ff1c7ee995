"""Auditor pages: read-only, login required, scoped to the tenants where the viewer may view
every run; a run of any other tenant is not found. What a page shows is redacted for the
viewer (runs.redaction)."""

import re
from importlib import import_module
from types import SimpleNamespace
from uuid import UUID

from django.conf import settings
from django.contrib import messages
from django.contrib.auth import get_user
from django.contrib.auth.decorators import login_required
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils.decorators import method_decorator
from django.views import View
from simple_history.utils import get_history_model_for_model

from registry.choices import Action
from registry.errors import NotFound
from registry.models import Skill, SkillVersion, Tool, ToolVersion
from registry.selectors import user_can, user_roles
from runs import audit, charts, dashboards, selectors
from runs.api.stream import event_stream, viewer_shape
from runs.choices import ACTIVE_STATUSES, EventType
from runs.forms import DashboardFilterForm, RunFilterForm, ignored_filters
from runs.models import MemoryItem, Run
from runs.services import memory

REGISTRY_HISTORY_ROWS = 200
# An event's seq, as the stream sends it: ASCII digits only (str.isdigit() also takes "²",
# which int() refuses), and no more of them than a stored seq has.
LAST_EVENT_ID = re.compile(r"[0-9]{1,10}")


def _audited_tenants(request: HttpRequest) -> dict[int, str]:
    tenants = selectors.tenants_audited(user=request.user)
    if not tenants:
        raise PermissionDenied("Only auditors and tenant admins read run histories.")
    return tenants


def _audited_run(user: AbstractBaseUser, run_id) -> tuple[Run, bool]:
    """The run, if `user` may view every run of its tenant, and whether they see it unmasked;
    anything else is not found. One read of their roles serves both."""
    run = Run.objects.select_related("tenant", "actor").filter(pk=run_id).first()
    if run is None:
        raise Http404("No such run.")
    roles = user_roles(user=user, tenant=run.tenant)
    if not user_can(user=user, action=Action.RUN_VIEW_ALL, tenant=run.tenant, roles=roles):
        raise Http404("No such run.")
    return run, selectors.viewer_cleared(user=user, run=run, roles=roles)


def _still_audited(request: HttpRequest, run_id, *, cleared: bool) -> bool:
    """Whether the request's session still signs its user in (not logged out or expired, the
    user active, their password unchanged), and they may still view the run as the stream
    shows it: a stream sent unmasked ends once its viewer's clearance does."""
    store = import_module(settings.SESSION_ENGINE).SessionStore(request.session.session_key)
    viewer = get_user(SimpleNamespace(session=store))
    if viewer.pk != request.user.pk:
        return False
    try:
        _run, still_cleared = _audited_run(viewer, run_id)
    except Http404:
        return False
    return still_cleared or not cleared


@method_decorator(login_required, name="dispatch")
class RunHistoryView(View):
    def get(self, request: HttpRequest) -> HttpResponse:
        tenants = _audited_tenants(request)
        form = RunFilterForm(request.GET, tenants=tenants.values())
        form.is_valid()
        filters = audit.HistoryFilters(**form.cleaned_data)
        runs = audit.history(
            selectors.runs_audited(tenant_ids=list(tenants)),
            filters,
            before=request.GET.get("before", ""),
        )
        page = runs[: audit.PAGE_SIZE]
        query = request.GET.copy()
        query.pop("before", None)
        return render(
            request,
            "runs/history.html",
            {
                "form": form,
                "ignored": ignored_filters(form),
                "tenants": sorted(tenants.values()),
                "runs": page,
                "next_cursor": audit.encode_cursor(page[-1]) if len(runs) > len(page) else "",
                "query": query.urlencode(),
            },
        )


@method_decorator(login_required, name="dispatch")
class RunDetailView(View):
    def get(self, request: HttpRequest, run_id) -> HttpResponse:
        run, cleared = _audited_run(request.user, run_id)
        record = audit.run_record(run, cleared=cleared)
        return render(
            request,
            "runs/detail.html",
            {
                "run": run,
                "record": record,
                "active": run.status in ACTIVE_STATUSES,
                "event_types": list(EventType.values),
                # The live progress follows on from the last event the timeline shows.
                "shown_seq": record["events"][-1]["seq"] if record["events"] else 0,
            },
        )


@method_decorator(login_required, name="dispatch")
class RunExportView(View):
    def get(self, request: HttpRequest, run_id) -> HttpResponse:
        run, cleared = _audited_run(request.user, run_id)
        record = audit.run_record(run, cleared=cleared)
        response = HttpResponse(audit.run_export(record), content_type="application/json")
        response["Content-Disposition"] = f'attachment; filename="run-{run.pk}.json"'
        return response


@method_decorator(login_required, name="dispatch")
class RunStreamView(View):
    """The run page follows this while the run is active: its events, redacted, after
    `?after=` (the last one the page shows) or, when the browser reconnects, after its
    Last-Event-ID."""

    def get(self, request: HttpRequest, run_id) -> HttpResponse:
        run, cleared = _audited_run(request.user, run_id)
        after = request.headers.get("Last-Event-ID") or request.GET.get("after", "")
        return event_stream(
            request,
            run,
            int(after) if LAST_EVENT_ID.fullmatch(after) else 0,
            shape=viewer_shape(run, cleared=cleared),
            allowed=lambda: _still_audited(request, run.pk, cleared=cleared),
        )


@method_decorator(login_required, name="dispatch")
class RegistryHistoryView(View):
    """Who created, published, deprecated or revoked which tool and skill version, when and
    why: the registry's own history rows for the auditor's tenants and the platform."""

    def get(self, request: HttpRequest) -> HttpResponse:
        tenants = list(_audited_tenants(request).values())
        rows = []
        for model, definitions, parent in (
            (ToolVersion, Tool, "tool"),
            (SkillVersion, Skill, "skill"),
        ):
            history = get_history_model_for_model(model)
            owned = history.objects.filter(**{f"{parent}__tenant__slug__in": tenants})
            # The records of a version outlive a draft definition deleted after it, whose
            # owner is then unknown: platform records are those of a definition still there.
            platform = history.objects.filter(
                **{f"{parent}__in": definitions.objects.filter(tenant__isnull=True)}
            )
            for row in (
                (owned | platform)
                .select_related(parent, "history_user")
                .order_by("-history_date")[:REGISTRY_HISTORY_ROWS]
            ):
                definition = getattr(row, parent)
                rows.append(
                    {
                        "at": row.history_date,
                        "kind": parent,
                        "name": f"{definition.name}@{row.version}",
                        "status": row.status,
                        "change": row.get_history_type_display(),
                        "reason": row.history_change_reason or "",
                        "user": row.history_user.get_username() if row.history_user else "system",
                    }
                )
        rows.sort(key=lambda row: row["at"], reverse=True)
        return render(request, "runs/registry_history.html", {"rows": rows[:REGISTRY_HISTORY_ROWS]})


@method_decorator(login_required, name="dispatch")
class DashboardView(View):
    """Per tenant and per skill version: statuses per day, latency per stage, approvals,
    tool error categories, cost per day."""

    def get(self, request: HttpRequest) -> HttpResponse:
        tenants = _audited_tenants(request)
        form = DashboardFilterForm(request.GET, tenants=tenants.values())
        form.is_valid()
        values = form.cleaned_data
        runs = selectors.runs_audited(tenant_ids=list(tenants))
        if values.get("tenant"):
            runs = runs.filter(tenant__slug=values["tenant"])
        days = values.get("days") or 14
        skills = dashboards.skills_seen(runs, days=days)
        if values.get("skill"):
            runs = selectors.runs_of_skill(runs, values["skill"])
            skills = sorted({*skills, values["skill"]})
        figures = dashboards.dashboard(runs, days=days)
        return render(
            request,
            "runs/dashboard.html",
            {
                "form": form,
                "ignored": ignored_filters(form),
                "tenants": sorted(tenants.values()),
                "skills": skills,
                "figures": figures,
                "status_chart": charts.stacked_columns(figures.days, figures.statuses),
                "cost_chart": charts.bars(
                    [(day.isoformat(), cost) for day, cost in sorted(figures.cost.items())]
                ),
                "latency_chart": charts.bars(
                    [(row["name"], row["p95"]) for row in figures.stages], unit=" ms"
                ),
                "error_chart": charts.bars(figures.tool_errors),
            },
        )


@method_decorator(login_required, name="dispatch")
class MemoryListView(View):
    """What the platform keeps about the signed-in user, in every tenant; each can be deleted."""

    def get(self, request: HttpRequest) -> HttpResponse:
        items = (
            MemoryItem.objects.filter(user=request.user)
            .select_related("tenant")
            .order_by("tenant__slug", "kind", "key")
        )
        return render(request, "runs/memories.html", {"items": items})

    def post(self, request: HttpRequest) -> HttpResponse:
        try:
            item_id = UUID(request.POST.get("item", ""))
        except ValueError as error:
            raise Http404("No such memory.") from error
        item = MemoryItem.objects.filter(user=request.user, pk=item_id).first()
        if item is None:
            raise Http404("No such memory.")
        try:
            memory.memory_delete(tenant=item.tenant, user=request.user, item_id=item.pk)
        except NotFound as error:
            # Deleted meanwhile, by the same form posted twice or from another tab.
            raise Http404("No such memory.") from error
        messages.success(request, f"Forgotten: {item.key}.")
        return redirect("memories")
