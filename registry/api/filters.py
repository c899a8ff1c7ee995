import django_filters

from config.api import FilterSet
from registry.choices import Risk, VersionStatus
from registry.models import SkillVersion, ToolVersion


class ToolVersionFilter(FilterSet):
    name = django_filters.CharFilter(field_name="tool__name")
    namespace = django_filters.CharFilter(field_name="tool__namespace")
    status = django_filters.MultipleChoiceFilter(choices=VersionStatus.choices)
    risk = django_filters.MultipleChoiceFilter(choices=Risk.choices)

    class Meta:
        model = ToolVersion
        fields = ["name", "namespace", "status", "risk"]


class SkillVersionFilter(FilterSet):
    name = django_filters.CharFilter(field_name="skill__name")
    namespace = django_filters.CharFilter(field_name="skill__namespace")
    status = django_filters.MultipleChoiceFilter(choices=VersionStatus.choices)

    class Meta:
        model = SkillVersion
        fields = ["name", "namespace", "status"]
