"""Django's and django-celery-beat's own admins, registered again with what every admin of
the site shares (SelectionKeysMixin): the same admin class, only a refusal added."""

from typing import Any

from celery.schedules import ParseException
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.contrib.auth.admin import GroupAdmin, UserAdmin
from django.contrib.auth.models import Group
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

from registry.admin.base import SelectionKeysMixin


class PlatformUserAdmin(SelectionKeysMixin, UserAdmin):
    """Django's user admin."""


class PlatformGroupAdmin(SelectionKeysMixin, GroupAdmin):
    """Django's group admin."""


class PlatformPeriodicTaskForm(PeriodicTaskForm):
    """A task name the field refuses (longer than 200 characters) is that field's error:
    django-celery-beat's form read the name it had refused and failed with a server error."""

    def clean(self) -> dict[str, Any]:
        if "task" in self.errors:
            return self.cleaned_data
        return super().clean()


class PlatformPeriodicTaskAdmin(SelectionKeysMixin, PeriodicTaskAdmin):
    """django-celery-beat's periodic task admin."""

    form = PlatformPeriodicTaskForm


class PlatformClockedScheduleAdmin(SelectionKeysMixin, ClockedScheduleAdmin):
    """django-celery-beat's clocked schedule admin."""


class PlatformCrontabScheduleAdmin(SelectionKeysMixin, CrontabScheduleAdmin):
    """django-celery-beat's crontab schedule admin. A form drawn again with a field no crontab
    reads (`minute=-1`) shows the schedule as typed: django-celery-beat's description of it
    failed to parse it, with a server error."""

    @admin.display(description="human readable")
    def human_readable(self, obj: CrontabSchedule) -> str:
        try:
            return obj.human_readable
        except ParseException:
            return str(obj)


class PlatformSolarScheduleAdmin(SelectionKeysMixin, SolarScheduleAdmin):
    """django-celery-beat's solar schedule admin."""


class PlatformIntervalScheduleAdmin(SelectionKeysMixin, IntervalScheduleAdmin):
    """django-celery-beat's interval schedule admin."""


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
