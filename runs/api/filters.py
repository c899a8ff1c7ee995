from datetime import UTC

import django_filters
from django.core.exceptions import ValidationError
from django.core.validators import RegexValidator
from django_filters.fields import IsoDateTimeField
from drf_spectacular.utils import extend_schema_field

from config.api import FilterSet
from runs.choices import RunStatus
from runs.models import Run
from runs.selectors import runs_of_skill


class InstantField(IsoDateTimeField):
    """An ISO 8601 instant, taken in UTC: Python reads offsets up to ±23:59, PostgreSQL only
    up to ±15:59."""

    def to_python(self, value):
        instant = super().to_python(value)
        if instant is None:
            return None
        try:
            return instant.astimezone(UTC)
        except OverflowError as error:
            raise ValidationError("Outside the range of dates.", code="invalid") from error


class InstantFilter(django_filters.IsoDateTimeFilter):
    field_class = InstantField


# A skill as runs name it: `name` (every version) or `name@version`, neither empty.
SKILL_PATTERN = r"^[^@\s]+(@[^@\s]+)?$"


@extend_schema_field(
    {"type": "string", "pattern": SKILL_PATTERN, "description": "name or name@version"}
)
class SkillFilter(django_filters.CharFilter):
    """A skill filter, its pattern in the schema as in the check."""


class RunFilter(FilterSet):
    status = django_filters.MultipleChoiceFilter(choices=RunStatus.choices)
    session = django_filters.UUIDFilter(field_name="session_id")
    skill = SkillFilter(
        method="filter_skill",
        help_text="name or name@version",
        validators=[RegexValidator(SKILL_PATTERN, "Give a skill as name or name@version.")],
    )
    created_after = InstantFilter(field_name="created_at", lookup_expr="gte")
    created_before = InstantFilter(field_name="created_at", lookup_expr="lt")

    class Meta:
        model = Run
        fields = ["status", "session", "skill", "created_after", "created_before"]

    def filter_skill(self, queryset, name: str, value: str):
        return runs_of_skill(queryset, value)
