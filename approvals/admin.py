from django.contrib import admin

from approvals.models import ApprovalDecision, BusinessAction, Handoff
from registry.admin.base import EvidenceAdmin, HistoryAdmin
from registry.choices import Action


class ApprovalsEvidenceAdmin(EvidenceAdmin):
    """Evidence: shown, never edited here (decisions go through the approval queue and the
    human queue), to platform admins and to the tenant's own administrators."""

    required_action = Action.TENANT_ADMIN


@admin.register(BusinessAction)
class BusinessActionAdmin(ApprovalsEvidenceAdmin, HistoryAdmin):
    list_display = ["kind", "status", "tenant", "requester", "created_at", "expires_at"]
    list_select_related = ["tenant", "requester"]
    list_filter = ["status", "kind", "tenant"]
    search_fields = ["idempotency_key", "payload_hash", "external_id", "run__id"]
    date_hierarchy = "created_at"


@admin.register(ApprovalDecision)
class ApprovalDecisionAdmin(ApprovalsEvidenceAdmin):
    tenant_lookup = "action__tenant"
    list_display = ["action", "decision", "approver", "created_at"]
    list_select_related = ["action", "approver"]
    list_filter = ["decision"]
    search_fields = ["action__id", "approver__username", "payload_hash"]


@admin.register(Handoff)
class HandoffAdmin(ApprovalsEvidenceAdmin, HistoryAdmin):
    list_display = ["skill", "status", "tenant", "requester", "resolved_by", "created_at"]
    list_select_related = ["tenant", "requester", "resolved_by"]
    list_filter = ["status", "tenant"]
    search_fields = ["run__id", "requester__username", "request"]
    date_hierarchy = "created_at"
