"""Scheduled tasks in the admin: created, changed, paused and resumed through
`runs.services.schedules`, with their occurrences shown as read-only evidence. Tenant admins
see their tenants' tasks; platform admins see all."""

import json
from typing import Any

from django import forms
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html

from registry.admin.base import EvidenceAdmin, RegistryAdmin
from registry.choices import Action
from registry.models import AgentConfig
from runs.models import ScheduledTask, TaskOccurrence
from runs.services.schedules import (
    VERSIONED_FIELDS,
    schedule_next_run,
    scheduled_task_errors,
    scheduled_task_pause,
    scheduled_task_resume,
    scheduled_task_save,
    scheduled_task_version,
)

# Occurrences shown on a task's page, newest first; the occurrence list has them all.
OCCURRENCES_SHOWN = 20


def run_link(occurrence: TaskOccurrence) -> str:
    if occurrence.run_id is None:
        return "—"
    return format_html(
        '<a href="{}">{}</a>', reverse("runs:detail", args=[occurrence.run_id]), occurrence.run_id
    )


class ScheduledTaskForm(forms.ModelForm):
    """Shows what `scheduled_task_save` would refuse next to the field it concerns.

    Carries whether the task fired when the page was drawn: a save from a page drawn before
    the task was paused (by the scheduler, whose start of it was refused, or by another admin)
    or resumed is refused, rather than switching it back as the page showed it. A change
    posted without it (a script, a page drawn before the form carried it) is refused as from
    such a page: it cannot show that it would not undo a pause.

    Carries as well the version of the fields it edits the page was drawn at
    (`scheduled_task_version`): a save from a page drawn before another save changed any of
    them is refused, naming them, rather than writing back what the page showed. A change
    posted without it is refused alike."""

    is_enabled_when_opened = forms.NullBooleanField(widget=forms.HiddenInput, required=False)
    version_when_opened = forms.CharField(widget=forms.HiddenInput, required=False)

    class Meta:
        model = ScheduledTask
        fields = ("tenant", *VERSIONED_FIELDS, "is_enabled")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["is_enabled_when_opened"].initial = self.instance.is_enabled
        if not self.instance._state.adding:
            version = json.dumps(scheduled_task_version(self.instance))
            self.fields["version_when_opened"].initial = version

    def clean_version_when_opened(self) -> dict[str, str] | None:
        try:
            version = json.loads(self.cleaned_data["version_when_opened"])
        except ValueError:
            return None
        if isinstance(version, dict) and all(
            isinstance(digest, str) for digest in version.values()
        ):
            return version
        return None

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean()
        if self.instance._state.adding:
            return cleaned
        if cleaned.get("is_enabled_when_opened") is None:
            self.add_error(
                "is_enabled",
                "This save does not say whether the task was paused when its page was opened, "
                "so it could undo a pause made since: reload the page, then save again.",
            )
        if cleaned.get("version_when_opened") is None:
            self.add_error(
                None,
                "This save does not say which version of the task its page was opened at, so "
                "it could undo a change made since: reload the page, then save again.",
            )
        return cleaned

    def _post_clean(self) -> None:
        super()._post_clean()
        for field, messages in scheduled_task_errors(self.instance).items():
            if field not in self.errors:
                self.add_error(field, messages)


class LatestOccurrencesFormSet(forms.BaseInlineFormSet):
    def get_queryset(self) -> QuerySet[TaskOccurrence]:
        # Read once: the formset asks for its queryset again for each form.
        if not hasattr(self, "_latest"):
            self._latest = super().get_queryset().select_related("task")[:OCCURRENCES_SHOWN]
        return self._latest


class TaskOccurrenceInline(admin.TabularInline):
    model = TaskOccurrence
    formset = LatestOccurrencesFormSet
    fk_name = "task"
    verbose_name_plural = f"latest {OCCURRENCES_SHOWN} occurrences"
    fields = (
        "slot",
        "status",
        "detail",
        "attempts",
        "lease_expires_at",
        "deadline_at",
        "run_page",
        "owner_notified_at",
    )
    readonly_fields = fields
    ordering = ("-slot",)
    extra = 0
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.display(description="run")
    def run_page(self, obj: TaskOccurrence) -> str:
        return run_link(obj)


@admin.register(ScheduledTask)
class ScheduledTaskAdmin(RegistryAdmin):
    required_action = Action.TENANT_ADMIN
    form = ScheduledTaskForm
    list_display = ("name", "tenant", "owner", "schedule", "is_enabled", "next_run")
    list_filter = ("is_enabled", "tenant")
    search_fields = ("name", "goal", "project_id", "owner__username")
    list_select_related = (
        "tenant",
        "owner",
        "periodic_task__interval",
        "periodic_task__crontab",
    )
    readonly_fields = ("next_run", "periodic_task", "occurrences", "created_at", "updated_at")
    inlines = (TaskOccurrenceInline,)
    actions = ("pause", "resume")

    @admin.display(description="schedule")
    def schedule(self, obj: ScheduledTask) -> str:
        return obj.schedule_text

    @admin.display(description="next run (UTC)")
    def next_run(self, obj: ScheduledTask) -> str:
        moment = schedule_next_run(obj) if obj.pk else None
        return f"{moment:%Y-%m-%d %H:%M:%S}" if moment else "—"

    @admin.display(description="all occurrences")
    def occurrences(self, obj: ScheduledTask) -> str:
        if obj.pk is None:
            return "—"
        url = reverse("admin:runs_taskoccurrence_changelist") + f"?task__id__exact={obj.pk}"
        return format_html('<a href="{}">{} occurrences</a>', url, obj.occurrences.count())

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        """A saved task keeps its tenant (`scheduled_task_errors`)."""
        fields = tuple(super().get_readonly_fields(request, obj))
        return ("tenant", *fields) if obj is not None else fields

    def formfield_for_foreignkey(self, db_field: Any, request: HttpRequest, **kwargs: Any):
        """Owners and agents are offered from the tenants this user administers only."""
        if not request.user.is_superuser:
            tenants = self.scoped_tenants(request)
            if db_field.name == "owner":
                kwargs["queryset"] = (
                    get_user_model().objects.filter(memberships__tenant__in=tenants).distinct()
                )
            elif db_field.name == "agent_config":
                kwargs["queryset"] = AgentConfig.objects.filter(tenant__in=tenants)
        return super().formfield_for_foreignkey(db_field, request, **kwargs)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """A task is paused, never deleted: its occurrences and runs are evidence."""
        return False

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        scheduled_task_save(
            actor=request.user,
            task=obj,
            reason="saved in admin",
            is_enabled_when_read=form.cleaned_data["is_enabled_when_opened"],
            version_when_read=form.cleaned_data["version_when_opened"],
        )

    @admin.action(description="Pause: stop firing", permissions=["change"])
    def pause(self, request: HttpRequest, queryset: QuerySet[ScheduledTask]) -> None:
        for task in queryset:
            self.run_service(
                request,
                lambda task=task: scheduled_task_pause(actor=request.user, task=task),
                f"{task.name} is paused.",
            )

    @admin.action(description="Resume firing", permissions=["change"])
    def resume(self, request: HttpRequest, queryset: QuerySet[ScheduledTask]) -> None:
        for task in queryset:
            self.run_service(
                request,
                lambda task=task: scheduled_task_resume(actor=request.user, task=task),
                f"{task.name} fires again.",
            )


@admin.register(TaskOccurrence)
class TaskOccurrenceAdmin(EvidenceAdmin):
    """Evidence: what each firing did, read here and changed only by the scheduler."""

    tenant_lookup = "task__tenant"
    required_action = Action.TENANT_ADMIN

    list_display = (
        "task",
        "slot",
        "status",
        "attempts",
        "lease_owner",
        "lease_expires_at",
        "deadline_at",
        "run_page",
        "owner_notified_at",
    )
    list_filter = ("status", "task__tenant")
    search_fields = ("task__name", "run__id", "detail")
    list_select_related = ("task__tenant",)
    date_hierarchy = "slot"
    fields = (
        "task",
        "slot",
        "status",
        "detail",
        "owner",
        "message",
        "attempts",
        "lease_owner",
        "lease_expires_at",
        "deadline_at",
        "run_page",
        "owner_notified_at",
        "created_at",
        "updated_at",
        "finished_at",
    )
    readonly_fields = fields

    @admin.display(description="run")
    def run_page(self, obj: TaskOccurrence) -> str:
        return run_link(obj)
