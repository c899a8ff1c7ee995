"""Django's and django-celery-beat's own admins, registered again with what every admin of
the site shares (SelectionKeysMixin): the same admin class, only a refusal added.

The beat's rows that fire a scheduled task (its periodic task, and the crontab or interval
that runs on) are kept in step with the task by its services: here they are shown, never
changed, and the bulk actions leave them alone, pointing to the task's own page."""

from typing import Any

from celery.schedules import ParseException
from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.contrib.admin.views.autocomplete import AutocompleteJsonView
from django.contrib.auth import get_user_model
from django.contrib.auth.admin import GroupAdmin, UserAdmin
from django.contrib.auth.models import Group
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from django_celery_beat.admin import (
    ClockedScheduleAdmin,
    CrontabScheduleAdmin,
    IntervalScheduleAdmin,
    PeriodicTaskAdmin,
    PeriodicTaskForm,
    SolarScheduleAdmin,
)
from django_celery_beat.models import (
    ClockedSchedule,
    CrontabSchedule,
    IntervalSchedule,
    PeriodicTask,
    SolarSchedule,
)

from registry.admin.base import SelectionKeysMixin, ServiceRefusalsMixin
from registry.services.tenancy import user_save, users_delete


class PlatformUserAdmin(ServiceRefusalsMixin, SelectionKeysMixin, UserAdmin):
    """Django's user admin. A person is deactivated, or deleted (one, or a selection at
    once), only while every tenant they are an active admin of keeps another: the services
    refuse it otherwise, naming the tenants, and nothing is changed."""

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        user_save(user=obj)

    def delete_model(self, request: HttpRequest, obj: Any) -> None:
        users_delete(users=self.model._default_manager.filter(pk=obj.pk))

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet) -> None:
        users_delete(users=queryset)


class PlatformGroupAdmin(SelectionKeysMixin, GroupAdmin):
    """Django's group admin."""


class FormFieldAutocompleteView(AutocompleteJsonView):
    """Django's autocomplete, for a field a form can hold: one that names another model's
    relation to this one (`model_name=tenant&field_name=memberships`) is refused as an unknown
    field is; Django searched by it and failed with a server error."""

    def process_request(self, request: HttpRequest) -> tuple[str, Any, Any, str]:
        term, model_admin, source_field, to_field_name = super().process_request(request)
        if not source_field.concrete:
            raise PermissionDenied
        return term, model_admin, source_field, to_field_name


def _task_links(periodic_tasks: QuerySet[PeriodicTask]) -> SafeString:
    """The scheduled tasks these periodic tasks fire, each a link to its admin page."""
    tasks = periodic_tasks.filter(scheduled_task__isnull=False).values_list(
        "scheduled_task__pk", "scheduled_task__name", "scheduled_task__tenant__slug"
    )
    return format_html_join(
        ", ",
        '<a href="{}">{} ({})</a>',
        (
            (reverse("admin:runs_scheduledtask_change", args=[pk]), name, tenant)
            for pk, name, tenant in tasks.order_by("scheduled_task__name")
        ),
    )


class KeptByScheduledTasksMixin:
    """A row a scheduled task fires by is shown read-only, and a change posted to it is
    refused with a message naming the task, whose page changes its schedule and switch; to
    staff who may not see the row, the task is not named, as the row is not shown.
    Changed here, the beat would fire the task at other times, or not at all, while the
    task's page still showed its own settings. `periodic_field` is how a PeriodicTask
    refers to this admin's model."""

    periodic_field: str

    def _periodic_tasks(self, obj: Any) -> QuerySet[PeriodicTask]:
        return PeriodicTask.objects.filter(**{self.periodic_field: obj.pk})

    def _kept_by_tasks(self, obj: Any) -> SafeString:
        return _task_links(self._periodic_tasks(obj))

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return super().has_change_permission(request, obj) and (
            obj is None or not self._kept_by_tasks(obj)
        )

    def changeform_view(
        self,
        request: HttpRequest,
        object_id: str | None = None,
        form_url: str = "",
        extra_context: Any = None,
    ) -> HttpResponse:
        obj = self.get_object(request, unquote(object_id)) if object_id else None
        seen = obj is not None and self.has_view_or_change_permission(request, obj)
        tasks = self._kept_by_tasks(obj) if seen else ""
        if not tasks:
            return super().changeform_view(request, object_id, form_url, extra_context)
        kept = format_html(
            "{} fires the scheduled task {}: change its schedule, or pause and resume it, on "
            "the task's page, which keeps this row in step.",
            self.model._meta.verbose_name.capitalize(),
            tasks,
        )
        if request.method == "POST":
            self.message_user(
                request, format_html("Nothing was changed. {}", kept), level=messages.ERROR
            )
            return HttpResponseRedirect(request.get_full_path())
        self.message_user(request, kept, level=messages.WARNING)
        return super().changeform_view(request, object_id, form_url, extra_context)


class PlatformPeriodicTaskForm(PeriodicTaskForm):
    """A task name the field refuses (longer than 200 characters) is that field's error:
    django-celery-beat's form read the name it had refused and failed with a server error."""

    def clean(self) -> dict[str, Any]:
        if "task" in self.errors:
            return self.cleaned_data
        return super().clean()


class PlatformPeriodicTaskAdmin(KeptByScheduledTasksMixin, SelectionKeysMixin, PeriodicTaskAdmin):
    """django-celery-beat's periodic task admin. The bulk actions skip the periodic tasks of
    scheduled tasks, and say which they skipped."""

    form = PlatformPeriodicTaskForm
    periodic_field = "pk"

    def _free(self, request: HttpRequest, queryset: QuerySet[PeriodicTask]) -> QuerySet:
        """The selection without the periodic tasks of scheduled tasks, saying which those
        were."""
        tasks = _task_links(queryset)
        if tasks:
            self.message_user(
                request,
                format_html(
                    "Skipped the periodic tasks of the scheduled tasks {}: pause, resume or "
                    "change a scheduled task on its own page.",
                    tasks,
                ),
                level=messages.WARNING,
            )
        return queryset.filter(scheduled_task__isnull=True)

    def _on_free(self, action: str, request: HttpRequest, queryset: QuerySet) -> None:
        free = self._free(request, queryset)
        if free.exists():
            getattr(super(), action)(request, free)

    @admin.action(description="Enable selected tasks")
    def enable_tasks(self, request: HttpRequest, queryset: QuerySet[PeriodicTask]) -> None:
        self._on_free("enable_tasks", request, queryset)

    @admin.action(description="Disable selected tasks")
    def disable_tasks(self, request: HttpRequest, queryset: QuerySet[PeriodicTask]) -> None:
        self._on_free("disable_tasks", request, queryset)

    @admin.action(description="Toggle activity of selected tasks")
    def toggle_tasks(self, request: HttpRequest, queryset: QuerySet[PeriodicTask]) -> None:
        self._on_free("toggle_tasks", request, queryset)

    @admin.action(description="Run selected tasks")
    def run_tasks(self, request: HttpRequest, queryset: QuerySet[PeriodicTask]) -> None:
        self._on_free("run_tasks", request, queryset)


class PlatformClockedScheduleAdmin(SelectionKeysMixin, ClockedScheduleAdmin):
    """django-celery-beat's clocked schedule admin."""


class PlatformCrontabScheduleAdmin(
    KeptByScheduledTasksMixin, SelectionKeysMixin, CrontabScheduleAdmin
):
    """django-celery-beat's crontab schedule admin. A form drawn again with a field no crontab
    reads (`minute=-1`) shows the schedule as typed: django-celery-beat's description of it
    failed to parse it, with a server error."""

    periodic_field = "crontab"

    @admin.display(description="human readable")
    def human_readable(self, obj: CrontabSchedule) -> str:
        try:
            return obj.human_readable
        except ParseException:
            return str(obj)


class PlatformSolarScheduleAdmin(SelectionKeysMixin, SolarScheduleAdmin):
    """django-celery-beat's solar schedule admin."""


class PlatformIntervalScheduleAdmin(
    KeptByScheduledTasksMixin, SelectionKeysMixin, IntervalScheduleAdmin
):
    """django-celery-beat's interval schedule admin."""

    periodic_field = "interval"


for model, model_admin in [
    (get_user_model(), PlatformUserAdmin),
    (Group, PlatformGroupAdmin),
    (PeriodicTask, PlatformPeriodicTaskAdmin),
    (ClockedSchedule, PlatformClockedScheduleAdmin),
    (CrontabSchedule, PlatformCrontabScheduleAdmin),
    (SolarSchedule, PlatformSolarScheduleAdmin),
    (IntervalSchedule, PlatformIntervalScheduleAdmin),
]:
    admin.site.unregister(model)
    admin.site.register(model, model_admin)
