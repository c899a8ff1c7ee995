from django.contrib import admin
from django.http import HttpRequest
from simple_history.admin import SimpleHistoryAdmin

from evaluations.models import (
    EvalCase,
    EvalCaseResult,
    EvalRun,
    EvalSuite,
    EvalThreshold,
    ReleaseOverride,
)


class EvalCaseInline(admin.TabularInline):
    model = EvalCase
    fields = ("key", "title", "vector")
    readonly_fields = fields
    extra = 0
    show_change_link = True

    def has_add_permission(self, request: HttpRequest, obj=None) -> bool:
        return False


@admin.register(EvalSuite)
class EvalSuiteAdmin(SimpleHistoryAdmin):
    list_display = ("key", "name", "kind", "skill_name", "tenant")
    list_filter = ("kind", "tenant")
    search_fields = ("key", "name", "skill_name")
    inlines = (EvalCaseInline,)


@admin.register(EvalCase)
class EvalCaseAdmin(SimpleHistoryAdmin):
    list_display = ("key", "suite", "title", "vector")
    list_filter = ("suite", "vector")
    search_fields = ("key", "title", "payload")
    list_select_related = ("suite",)


class EvidenceAdmin(admin.ModelAdmin):
    """Measured results: shown, never edited (eval runs start from the API)."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj=None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj=None) -> bool:
        return False


class EvalCaseResultInline(admin.TabularInline):
    model = EvalCaseResult
    fields = ("case", "passed", "failures", "run")
    readonly_fields = fields
    extra = 0

    def has_add_permission(self, request: HttpRequest, obj=None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj=None) -> bool:
        return False


@admin.register(EvalRun)
class EvalRunAdmin(EvidenceAdmin):
    list_display = (
        "id",
        "suite",
        "skill_version",
        "model_config",
        "status",
        "cases_done",
        "cases_total",
        "created_at",
    )
    list_filter = ("status", "suite", "tenant")
    list_select_related = ("suite", "skill_version__skill", "model_config")
    inlines = (EvalCaseResultInline,)


@admin.register(EvalThreshold)
class EvalThresholdAdmin(SimpleHistoryAdmin):
    list_display = ("skill_name", "suite", "metric", "comparator", "value", "tenant")
    list_filter = ("tenant", "suite", "metric")
    search_fields = ("skill_name",)
    list_select_related = ("suite", "tenant")


@admin.register(ReleaseOverride)
class ReleaseOverrideAdmin(EvidenceAdmin):
    list_display = ("skill_version", "actor", "reason", "created_at")
    list_select_related = ("skill_version__skill", "actor")
    search_fields = ("reason", "skill_version__skill__name")
