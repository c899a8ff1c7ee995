from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from approvals import services
from approvals.choices import Decision, HandoffStatus
from approvals.models import ApprovalDecision, BusinessAction, Handoff
from config.api import StrictCharField, StrictSerializer
from runs.choices import RunStatus


class DecisionSerializer(serializers.ModelSerializer):
    approver = serializers.CharField(source="approver.get_username", read_only=True)

    class Meta:
        model = ApprovalDecision
        fields = ["decision", "approver", "payload_hash", "comment", "created_at"]
        read_only_fields = fields


class ApprovalSerializer(serializers.ModelSerializer):
    """A Business Action as an approver sees it: exactly the frozen payload and its hash."""

    tenant = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    requester = serializers.CharField(source="requester.get_username", read_only=True)
    skill = serializers.SerializerMethodField()
    decision = serializers.SerializerMethodField()
    send_deadline = serializers.SerializerMethodField()

    class Meta:
        model = BusinessAction
        fields = [
            "id",
            "run",
            "tenant",
            "requester",
            "kind",
            "risk",
            "status",
            "status_reason",
            "skill",
            "payload",
            "payload_hash",
            "idempotency_key",
            "external_id",
            "created_at",
            "expires_at",
            "decided_at",
            "finished_at",
            "decision",
            "send_deadline",
        ]
        read_only_fields = fields

    @extend_schema_field(
        serializers.DateTimeField(
            allow_null=True,
            help_text="Once approved: when the send must have started (the action's expiry, "
            "or APPROVAL_RESUME_GRACE_SECONDS after an approval given in its last minutes); "
            "null before an approval or after a rejection.",
        )
    )
    def get_send_deadline(self, action: BusinessAction) -> str | None:
        deadline = services.approved_send_deadline(action)
        return serializers.DateTimeField().to_representation(deadline) if deadline else None

    def get_skill(self, action: BusinessAction) -> str | None:
        version = action.skill_version
        return version.qualified_name if version else None

    def get_decision(self, action: BusinessAction) -> dict | None:
        decision = getattr(action, "decision", None)
        return DecisionSerializer(decision).data if decision else None


class DecisionRequestSerializer(StrictSerializer):
    decision = serializers.ChoiceField(choices=Decision.choices)
    payload_hash = serializers.RegexField(r"^[0-9a-f]{64}$")
    comment = StrictCharField(required=False, allow_blank=True, max_length=2000, default="")


class HandoffSerializer(serializers.ModelSerializer):
    """A request the route left to people, as they see it."""

    tenant = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    requester = serializers.CharField(source="requester.get_username", read_only=True)
    resolved_by = serializers.SerializerMethodField()
    run_status = serializers.ChoiceField(
        source="run.status", choices=RunStatus.choices, read_only=True
    )

    class Meta:
        model = Handoff
        fields = [
            "id",
            "run",
            "run_status",
            "tenant",
            "requester",
            "skill",
            "risks",
            "request",
            "status",
            "status_reason",
            "resolved_by",
            "note",
            "created_at",
            "resolved_at",
        ]
        read_only_fields = fields

    def get_resolved_by(self, handoff: Handoff) -> str | None:
        return handoff.resolved_by.get_username() if handoff.resolved_by else None


class HandoffResolveSerializer(StrictSerializer):
    outcome = serializers.ChoiceField(choices=[HandoffStatus.HANDLED, HandoffStatus.DECLINED])
    note = StrictCharField(max_length=4000)
