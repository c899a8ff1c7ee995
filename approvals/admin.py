from django.contrib import admin
from django.http import HttpRequest
from simple_history.admin import SimpleHistoryAdmin

from approvals.models import ApprovalDecision, BusinessAction, Handoff


class ReadOnlyAdmin(admin.ModelAdmin):
    """Evidence: shown, never edited here (decisions go through the approval queue and the
    human queue)."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj=None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj=None) -> bool:
        return False


@admin.register(BusinessAction)
class BusinessActionAdmin(ReadOnlyAdmin, SimpleHistoryAdmin):
    list_display = ["kind", "status", "tenant", "requester", "created_at", "expires_at"]
    list_filter = ["status", "kind", "tenant"]
    search_fields = ["idempotency_key", "payload_hash", "external_id", "run__id"]
    date_hierarchy = "created_at"


@admin.register(ApprovalDecision)
class ApprovalDecisionAdmin(ReadOnlyAdmin):
    list_display = ["action", "decision", "approver", "created_at"]
    list_filter = ["decision"]
    search_fields = ["action__id", "approver__username", "payload_hash"]


@admin.register(Handoff)
class HandoffAdmin(ReadOnlyAdmin, SimpleHistoryAdmin):
    list_display = ["skill", "status", "tenant", "requester", "resolved_by", "created_at"]
    list_filter = ["status", "tenant"]
    search_fields = ["run__id", "requester__username", "request"]
    date_hierarchy = "created_at"
