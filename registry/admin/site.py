"""Django's and django-celery-beat's own admins, registered again with what every admin of
the site shares (SelectionKeysMixin): the same admin class, only a refusal added."""

from django.contrib import admin
from django.contrib.auth import get_user_model
from django.contrib.auth.admin import GroupAdmin, UserAdmin
from django.contrib.auth.models import Group
from django_celery_beat.admin import (
    ClockedScheduleAdmin,
    CrontabScheduleAdmin,
    IntervalScheduleAdmin,
    PeriodicTaskAdmin,
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


class PlatformPeriodicTaskAdmin(SelectionKeysMixin, PeriodicTaskAdmin):
    """django-celery-beat's periodic task admin."""


class PlatformClockedScheduleAdmin(SelectionKeysMixin, ClockedScheduleAdmin):
    """django-celery-beat's clocked schedule admin."""


class PlatformCrontabScheduleAdmin(SelectionKeysMixin, CrontabScheduleAdmin):
    """django-celery-beat's crontab schedule admin."""


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
