import re
from collections.abc import Iterable
from typing import Any

from django.http import QueryDict
from django.urls import reverse
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from config.api import StrictBooleanField, StrictCharField, StrictSerializer, StrictUUIDField
from registry.choices import DataClassification
from registry.selectors import user_roles
from runs import selectors
from runs.choices import ACTIVE_STATUSES, CLIENT_CHANNELS, RunStatus
from runs.context import message_max_tokens, text_shows_something
from runs.models import Attachment, CancelRequest, MemoryItem, Run, RunEvent
from runs.redaction import redact
from runs.tokens import estimate_tokens

MAX_PARTS = 20
MAX_TEXT_CHARS = 20_000
MAX_METADATA_KEYS = 32
# The policy refuses long values with its own reason; the API takes a little more to say so.
MEMORY_VALUE_CHARS_ACCEPTED = 4000


class TextPartSerializer(StrictSerializer):
    type = serializers.ChoiceField(choices=["text"])
    text = StrictCharField(max_length=MAX_TEXT_CHARS, trim_whitespace=False)


class AttachmentRefPartSerializer(StrictSerializer):
    type = serializers.ChoiceField(choices=["attachment_ref"])
    id = StrictUUIDField()


class ResourceRefPartSerializer(StrictSerializer):
    type = serializers.ChoiceField(choices=["resource_ref"])
    server = StrictCharField(max_length=63)
    uri = StrictCharField(max_length=500)


@extend_schema_field(
    {
        "oneOf": [
            {
                "type": "object",
                "properties": {
                    "type": {"type": "string", "enum": ["text"]},
                    "text": {"type": "string", "maxLength": MAX_TEXT_CHARS},
                },
                "required": ["type", "text"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {
                    "type": {"type": "string", "enum": ["attachment_ref"]},
                    "id": {"type": "string", "format": "uuid"},
                },
                "required": ["type", "id"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "description": "A resource an MCP server lists, read when the run starts and "
                "given to the model as untrusted evidence with its URI as source.",
                "properties": {
                    "type": {"type": "string", "enum": ["resource_ref"]},
                    "server": {"type": "string", "maxLength": 63},
                    "uri": {"type": "string", "maxLength": 500},
                },
                "required": ["type", "server", "uri"],
                "additionalProperties": False,
            },
        ]
    }
)
class PartField(serializers.Field):
    """One message part: text, a reference to an uploaded attachment, or to an MCP resource."""

    serializers_by_type = {
        "text": TextPartSerializer,
        "attachment_ref": AttachmentRefPartSerializer,
        "resource_ref": ResourceRefPartSerializer,
    }

    def to_internal_value(self, data: Any) -> dict[str, Any]:
        kind = data.get("type") if isinstance(data, dict) else None
        if not isinstance(kind, str) or kind not in self.serializers_by_type:
            raise serializers.ValidationError(
                'A part is {"type": "text" | "attachment_ref" | "resource_ref", …}.'
            )
        part = self.serializers_by_type[kind](data=data)
        part.is_valid(raise_exception=True)
        value = dict(part.validated_data)
        if "id" in value:
            value["id"] = str(value["id"])
        return value

    def to_representation(self, value: dict[str, Any]) -> dict[str, Any]:
        return value


# A project's key or an agent's name, as the registry and the example data store them.
SLUG = re.compile(r"[-a-zA-Z0-9_]{1,63}")


def _is_instant(text: str) -> bool:
    """Whether `text` is a date and time with its UTC offset, as the normalized message keeps
    the time its source sent it beside the time it was received: a time without an offset
    names no instant."""
    try:
        moment = parse_datetime(text)
    except ValueError:
        return False
    return moment is not None and timezone.is_aware(moment)


class MessageSerializer(StrictSerializer):
    session_id = StrictUUIDField(required=False, allow_null=True)
    channel = serializers.ChoiceField(choices=CLIENT_CHANNELS)
    parts = serializers.ListField(child=PartField(), min_length=1, max_length=MAX_PARTS)
    metadata = serializers.DictField(required=False, default=dict)

    def validate_metadata(self, value: dict[str, Any]) -> dict[str, Any]:
        if len(value) > MAX_METADATA_KEYS:
            raise serializers.ValidationError(f"At most {MAX_METADATA_KEYS} keys.")
        for name in ("project_id", "agent", "recipient_record_id", "source_timestamp"):
            if name in value and not isinstance(value[name], str):
                raise serializers.ValidationError({name: "Must be a string."})
        for name in ("project_id", "agent", "recipient_record_id"):
            if name in value and not SLUG.fullmatch(value[name]):
                raise serializers.ValidationError(
                    {name: "A key of letters, digits, hyphens and underscores (at most 63)."}
                )
        if "source_timestamp" in value and not _is_instant(value["source_timestamp"]):
            raise serializers.ValidationError(
                {"source_timestamp": "An ISO 8601 date and time with its UTC offset."}
            )
        return value

    def validate_parts(self, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        texts = [part["text"] for part in value if part["type"] == "text"]
        if not any(map(text_shows_something, texts)):
            raise serializers.ValidationError("A message needs at least one non-empty text part.")
        # A character of Chinese is a token, of English a quarter of one.
        limit = message_max_tokens()
        if (tokens := sum(map(estimate_tokens, texts))) > limit:
            raise serializers.ValidationError(
                f"The text is too long for the model's context: about {tokens} tokens, at most "
                f"{limit}. Send long material as an attachment."
            )
        return value


def run_links(run: Run) -> dict[str, str]:
    return {
        "self": reverse("run-detail", args=[run.pk]),
        "events": reverse("run-events", args=[run.pk]),
        "stream": reverse("run-stream", args=[run.pk]),
    }


class MessageAcceptedSerializer(serializers.Serializer):
    run_id = serializers.UUIDField(source="id")
    session_id = serializers.UUIDField()
    status = serializers.ChoiceField(choices=RunStatus.choices)
    links = serializers.SerializerMethodField()

    def get_links(self, run: Run) -> dict[str, str]:
        return run_links(run)


def viewer_cleared(serializer: serializers.Serializer, run: Run) -> bool:
    """`selectors.viewer_cleared` for the requesting user, reading their roles once per
    tenant whatever the number of runs; without a request, nobody is cleared."""
    request = serializer.context.get("request")
    if request is None:
        return False
    roles = serializer.context.setdefault("_roles", {})
    if run.actor_id != request.user.pk and run.tenant_id not in roles:
        roles[run.tenant_id] = user_roles(user=request.user, tenant=run.tenant)
    return selectors.viewer_cleared(user=request.user, run=run, roles=roles.get(run.tenant_id))


def viewer_redaction(
    serializer: serializers.Serializer, run: Run, *, page: Iterable[Run] | None = None
) -> dict[str, Any]:
    """How `redact` shows the run to the requesting user: cleared or not, the fields hidden
    from them (`selectors.hidden_fields`, each tool version read once a request) and the
    texts masked inside strings (`selectors.hidden_texts`, read at once for the runs of
    `page`, the list being shown with `run`)."""
    cleared = viewer_cleared(serializer, run)
    contracts = serializer.context.setdefault("_contracts", {})
    sensitive = selectors.hidden_fields(run=run, cleared=cleared, contracts=contracts)
    texts = serializer.context.setdefault("_texts", {})
    if not cleared and run.pk not in texts:
        unread = {
            other.pk: other
            for other in (run, *(page or ()))
            if other.pk not in texts and not viewer_cleared(serializer, other)
        }
        for other in unread.values():
            selectors.hidden_fields(run=other, cleared=False, contracts=contracts)
        texts.update(selectors.hidden_texts(runs=unread.values(), contracts=contracts))
    return {"cleared": cleared, "sensitive": sensitive, "texts": texts.get(run.pk, frozenset())}


def cancel_kept(run: Run) -> CancelRequest | None:
    """The cancel kept beside a run that has not taken it in yet (`services.runs.run_cancel`,
    while a step held the run): the cancel answered with it, so the run shows it from then,
    not from its next step boundary. Read with the run by `select_related`."""
    if run.cancel_requested_at is not None or run.status not in ACTIVE_STATUSES:
        return None
    return getattr(run, "cancel_request", None)


class RunSerializer(serializers.ModelSerializer):
    """The result is redacted (runs.redaction) for viewers without clearance. A cancel kept
    beside the run shows as asked for (`cancel_kept`)."""

    session_id = serializers.UUIDField()
    actor = serializers.CharField(source="actor.get_username")
    cancelled_by = serializers.SerializerMethodField(
        help_text="Who asked first for the run to be cancelled; null when no one did, or the "
        "platform stopped it (a scheduled task's deadline, an approval that expired or was "
        "rejected)."
    )
    links = serializers.SerializerMethodField()

    class Meta:
        model = Run
        fields = [
            "id",
            "status",
            "reason_code",
            "session_id",
            "actor",
            "channel",
            "skill",
            "capability_hash",
            "result",
            "trace_id",
            "cancel_requested_at",
            "cancelled_by",
            "created_at",
            "updated_at",
            "finished_at",
            "links",
        ]
        read_only_fields = fields

    def get_cancelled_by(self, run: Run) -> str | None:
        kept = cancel_kept(run)
        asker = kept.requested_by if kept else run.cancelled_by
        return asker.get_username() if asker else None

    def get_links(self, run: Run) -> dict[str, str]:
        return run_links(run)

    def to_representation(self, instance: Run) -> dict[str, Any]:
        data = super().to_representation(instance)
        if kept := cancel_kept(instance):
            data["cancel_requested_at"] = self.fields["cancel_requested_at"].to_representation(
                kept.requested_at
            )
        page = self.parent.instance if isinstance(self.parent, serializers.ListSerializer) else None
        data["result"] = redact(data["result"], **viewer_redaction(self, instance, page=page))
        return data


class RunEventSerializer(serializers.ModelSerializer):
    """Payloads are redacted for viewers without clearance; `context["run"]` names the run."""

    class Meta:
        model = RunEvent
        fields = ["id", "seq", "type", "payload", "created_at"]
        read_only_fields = fields

    def to_representation(self, instance: RunEvent) -> dict[str, Any]:
        data = super().to_representation(instance)
        data["payload"] = redact(data["payload"], **viewer_redaction(self, self.context["run"]))
        return data


class AttachmentUploadSerializer(StrictSerializer):
    file = serializers.FileField(
        allow_empty_file=False,
        help_text="The part's Content-Type must be an accepted type its content shows.",
    )

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, QueryDict) and len(data.getlist("file")) > 1:
            raise serializers.ValidationError({"file": ["Send one file per request."]})
        return super().to_internal_value(data)


class AttachmentSerializer(serializers.ModelSerializer):
    class Meta:
        model = Attachment
        fields = ["id", "media_type", "size", "sha256"]
        read_only_fields = fields


class MemoryItemSerializer(serializers.ModelSerializer):
    class Meta:
        model = MemoryItem
        fields = [
            "id",
            "kind",
            "key",
            "value",
            "purpose",
            "sensitivity",
            "consent_at",
            "origin",
            "source",
            "created_at",
            "confirmed_at",
            "expires_at",
        ]
        read_only_fields = fields


class MemoryCreateSerializer(StrictSerializer):
    """An explicit preference, or a fact the user confirms; the write policy decides."""

    kind = serializers.ChoiceField(choices=[MemoryItem.Kind.PREFERENCE, MemoryItem.Kind.FACT])
    key = serializers.RegexField(r"^[a-z][a-z0-9_.-]{0,99}$")
    value = StrictCharField(max_length=MEMORY_VALUE_CHARS_ACCEPTED)
    purpose = StrictCharField(
        max_length=64,
        required=False,
        help_text="Omitted: the purpose of the item this replaces, or any for a new one.",
    )
    sensitivity = serializers.ChoiceField(
        choices=DataClassification.choices,
        required=False,
        help_text="Omitted: the level of the item this replaces, or internal for a new one.",
    )
    consent = StrictBooleanField(default=False)

    def _shows_something(self, text: str) -> str:
        """Refused as a blank is: a text of only zero-width or blank characters (U+200B,
        U+FEFF, the Braille blank), which `str.strip` keeps, says nothing either."""
        if not text_shows_something(text):
            raise serializers.ValidationError(
                serializers.CharField.default_error_messages["blank"], code="blank"
            )
        return text

    def validate_value(self, value: str) -> str:
        return self._shows_something(value)

    def validate_purpose(self, value: str) -> str:
        return self._shows_something(value)
