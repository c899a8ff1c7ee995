import re
from typing import Any

from django.conf import settings
from django.db.models import QuerySet
from django.http import Http404, QueryDict, StreamingHttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiRequest, extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.permissions import BasePermission
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from config.api import WHOLE_NUMBER, BodiesDescribed, BodyDescribed, CommandSerializer
from config.ids import is_id_in_url
from registry.api.permissions import IsTenantMember
from registry.authentication import token_usable
from registry.choices import Action
from registry.models import ApiToken
from registry.selectors import user_can
from runs import selectors
from runs.api.filters import RunFilter
from runs.api.parsers import UploadParser
from runs.api.serializers import (
    AttachmentSerializer,
    AttachmentUploadSerializer,
    MemoryCreateSerializer,
    MemoryItemSerializer,
    MessageAcceptedSerializer,
    MessageSerializer,
    RunEventSerializer,
    RunSerializer,
)
from runs.api.stream import EventStreamRenderer, event_stream, viewer_shape
from runs.api.throttles import IngressThrottled
from runs.errors import IdempotencyKeyRequired, NotFound
from runs.models import MemoryItem, Run
from runs.services import memory
from runs.services.attachments import attachment_store
from runs.services.ingress import message_ingest
from runs.services.runs import run_cancel

IDEMPOTENCY_KEY_PATTERN = "^[!-~]{1,200}$"
IDEMPOTENCY_KEY = re.compile(IDEMPOTENCY_KEY_PATTERN)


class MessageView(IngressThrottled, BodyDescribed, APIView):
    """A message in; a governed run out. The tenant and the actor come from the token."""

    body_serializer = MessageSerializer

    @extend_schema(
        tags=["runs"],
        request=MessageSerializer,
        responses={202: MessageAcceptedSerializer, 200: MessageAcceptedSerializer},
        parameters=[
            OpenApiParameter(
                "Idempotency-Key",
                location=OpenApiParameter.HEADER,
                required=True,
                pattern=IDEMPOTENCY_KEY_PATTERN,
                description="1-200 visible ASCII characters. The same key and body return the "
                "same run (200).",
            )
        ],
    )
    def post(self, request: Request) -> Response:
        key = request.headers.get("Idempotency-Key", "")
        if not IDEMPOTENCY_KEY.fullmatch(key):
            raise IdempotencyKeyRequired(
                "Send an Idempotency-Key header of 1-200 visible ASCII characters."
            )
        data = self.get_serializer(data=request.data)
        data.is_valid(raise_exception=True)
        ingested = message_ingest(
            actor=request.user,
            tenant=request.auth.tenant,
            idempotency_key=key,
            channel=data.validated_data["channel"],
            parts=data.validated_data["parts"],
            metadata=data.validated_data["metadata"],
            session_id=data.validated_data.get("session_id"),
        )
        return Response(
            MessageAcceptedSerializer(ingested.run).data,
            status=status.HTTP_202_ACCEPTED if ingested.created else status.HTTP_200_OK,
        )


class CanStartRuns(BasePermission):
    """Uploading serves starting runs. `attachment_store` decides; asking here as well refuses
    before the multipart body is parsed and spooled."""

    message = "You may not upload attachments in this tenant."

    def has_permission(self, request: Request, view: APIView) -> bool:
        return isinstance(request.auth, ApiToken) and user_can(
            user=request.user, action=Action.RUN_CREATE, tenant=request.auth.tenant
        )


class AttachmentView(IngressThrottled, BodyDescribed, APIView):
    """A file in (multipart field `file`), checked and kept in private storage; messages refer
    to it by the returned id."""

    parser_classes = [UploadParser]
    permission_classes = [IsTenantMember, CanStartRuns]
    body_serializer = AttachmentUploadSerializer

    @extend_schema(
        tags=["runs"],
        request=OpenApiRequest(
            AttachmentUploadSerializer,
            encoding={"file": {"contentType": ", ".join(settings.ATTACHMENT_MEDIA_TYPES)}},
        ),
        responses={201: AttachmentSerializer},
    )
    def post(self, request: Request) -> Response:
        data = self.get_serializer(data=request.data)
        data.is_valid(raise_exception=True)
        upload = data.validated_data["file"]
        attachment = attachment_store(
            actor=request.user,
            tenant=request.auth.tenant,
            upload=upload,
            declared_media_type=upload.content_type or "",
        )
        return Response(AttachmentSerializer(attachment).data, status=status.HTTP_201_CREATED)


class SeqField(serializers.IntegerField):
    """A seq written in digits, as the log and the stream's ids write it: DRF reads a query
    value with int(), which also takes "1_0" (as 10), "+2", " 2", "2.0" and digits of other
    scripts, so a mangled seq skipped events or answered from the wrong one."""

    def to_internal_value(self, data: Any) -> int:
        if not (isinstance(data, str) and WHOLE_NUMBER.fullmatch(data)):
            self.fail("invalid")
        return super().to_internal_value(data)


class EventsQuerySerializer(serializers.Serializer):
    after = SeqField(min_value=0, default=0)

    def to_internal_value(self, data: Any) -> Any:
        """`?after=` is refused as the list's filters refuse an empty one: DRF reads an empty
        query parameter as left out, and a client whose seq went missing got the whole log
        again."""
        if isinstance(data, QueryDict) and len(data.getlist("after")) > 1:
            raise serializers.ValidationError({"after": ["Give one value."]})
        if isinstance(data, QueryDict) and data.getlist("after") == [""]:
            raise serializers.ValidationError(
                {"after": ["Give a value, or leave the parameter out."]}
            )
        return super().to_internal_value(data)


@extend_schema(tags=["runs"])
class RunViewSet(
    BodiesDescribed, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet
):
    serializer_class = RunSerializer
    filterset_class = RunFilter
    lookup_value_regex = "[^/]+"

    def get_queryset(self) -> QuerySet[Run]:
        if getattr(self, "swagger_fake_view", False):
            return Run.objects.none()
        # The id breaks ties of creation time, so that no run is on two pages or on none.
        return (
            selectors.runs_visible(user=self.request.user, tenant=self.request.auth.tenant)
            .select_related("actor", "tenant", "cancelled_by", "cancel_request__requested_by")
            .order_by("-created_at", "-pk")
        )

    @classmethod
    def body_serializers(cls) -> dict[str, type[serializers.Serializer]]:
        return {"cancel": CommandSerializer}

    def get_renderers(self) -> list[BaseRenderer]:
        """OPTIONS answers a description in JSON, the stream's too: with the stream's
        renderer it went out labelled as an event stream, and asked for JSON it was 406."""
        if self.action == "metadata":
            return [JSONRenderer()]
        return super().get_renderers()

    def get_object(self) -> Run:
        """The run of the id in the URL, as the API writes it; one that is malformed, unknown
        or of another tenant is the same 404, saying so in the same words."""
        if not is_id_in_url(self.kwargs["pk"]):
            raise NotFound("No such run.")
        try:
            return super().get_object()
        except Http404:
            raise NotFound("No such run.") from None

    @extend_schema(
        summary="The run's event log in order; `after` returns the events past that seq.",
        parameters=[EventsQuerySerializer],
        responses={200: RunEventSerializer(many=True)},
    )
    @action(detail=True, methods=["get"])
    def events(self, request: Request, pk: str) -> Response:
        run = self.get_object()
        query = EventsQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        page = self.paginate_queryset(
            selectors.run_events(run=run, after_seq=query.validated_data["after"])
        )
        context = {**self.get_serializer_context(), "run": run}
        return self.get_paginated_response(
            RunEventSerializer(page, many=True, context=context).data
        )

    @extend_schema(
        summary="Server-sent events of the run's log, live, until the run ends.",
        parameters=[
            EventsQuerySerializer,
            OpenApiParameter("Last-Event-ID", location=OpenApiParameter.HEADER, required=False),
        ],
        responses={(200, "text/event-stream"): OpenApiTypes.STR},
    )
    # Events are all the stream serves: asked for JSON, by `?format=` or `Accept`, it answers
    # 406 (errors still go out as JSON), and the schema offers no `format` to choose.
    @action(detail=True, methods=["get"], renderer_classes=[EventStreamRenderer])
    def stream(self, request: Request, pk: str) -> StreamingHttpResponse:
        run = self.get_object()
        last_event_id = request.headers.get("Last-Event-ID")
        query = EventsQuerySerializer(
            data={"after": last_event_id} if last_event_id else request.query_params
        )
        query.is_valid(raise_exception=True)
        cleared = selectors.viewer_cleared(user=request.user, run=run)
        token, user = request.auth, request.user

        def allowed() -> bool:
            """The token still authenticates and its holder may still read the run, unmasked
            if it was sent so."""
            if not token_usable(token):
                return False
            if not user_can(user=user, action=Action.REGISTRY_VIEW, tenant=token.tenant):
                return False
            if cleared and not selectors.viewer_cleared(user=user, run=run):
                return False
            return selectors.runs_visible(user=user, tenant=token.tenant).filter(pk=run.pk).exists()

        return event_stream(
            request._request,
            run,
            query.validated_data["after"],
            shape=viewer_shape(run, cleared=cleared),
            allowed=allowed,
        )

    @extend_schema(summary="Cancel a run that has not finished.", request=CommandSerializer)
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str) -> Response:
        run = self.get_object()
        CommandSerializer(data=request.data).is_valid(raise_exception=True)
        run = run_cancel(run=run, actor=request.user)
        return Response(RunSerializer(run, context=self.get_serializer_context()).data)


@extend_schema(tags=["memory"])
class MemoryViewSet(
    BodiesDescribed, mixins.ListModelMixin, mixins.DestroyModelMixin, viewsets.GenericViewSet
):
    """What the platform keeps about you in the token's tenant: list it, add an explicit
    preference or a fact you confirm, delete any of it."""

    serializer_class = MemoryItemSerializer
    permission_classes = [IsTenantMember]
    lookup_value_regex = "[^/]+"

    def get_queryset(self) -> QuerySet[MemoryItem]:
        if getattr(self, "swagger_fake_view", False):
            return MemoryItem.objects.none()
        return memory.memories_of(tenant=self.request.auth.tenant, user=self.request.user)

    @classmethod
    def body_serializers(cls) -> dict[str, type[serializers.Serializer]]:
        return {"create": MemoryCreateSerializer}

    @extend_schema(
        summary="Keep a preference or a confirmed fact (201), or replace the item of its kind "
        "and key (200); secrets, tokens, passwords, one-time codes, long text and sensitive "
        "items without consent are refused.",
        request=MemoryCreateSerializer,
        responses={201: MemoryItemSerializer, 200: MemoryItemSerializer},
    )
    def create(self, request: Request) -> Response:
        data = MemoryCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values = dict(data.validated_data)
        kind = values.pop("kind")
        item, created = memory.memory_write(
            tenant=request.auth.tenant,
            user=request.user,
            kind=kind,
            origin=MemoryItem.Origin.USER_STATED
            if kind == MemoryItem.Kind.PREFERENCE
            else MemoryItem.Origin.USER_CONFIRMED,
            source={"via": "api"},
            **values,
        )
        return Response(
            MemoryItemSerializer(item).data,
            status=status.HTTP_201_CREATED if created else status.HTTP_200_OK,
        )

    @extend_schema(summary="Forget one item.")
    def destroy(self, request: Request, pk: str) -> Response:
        if not is_id_in_url(pk):
            raise NotFound("No such memory.")
        memory.memory_delete(tenant=request.auth.tenant, user=request.user, item_id=pk)
        return Response(status=status.HTTP_204_NO_CONTENT)
