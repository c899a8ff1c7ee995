from collections.abc import Callable
from typing import Any, ClassVar

from django.db.models import QuerySet
from django.utils.cache import add_never_cache_headers
from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from config.api import BodiesDescribed, BodyDescribed, CommandSerializer
from config.ids import is_id_in_url
from registry import selectors
from registry.api import filters
from registry.api.serializers import (
    LifecycleSerializer,
    SkillPublishSerializer,
    SkillRollbackSerializer,
    SkillVersionCreateSerializer,
    SkillVersionSerializer,
    TokenRequestSerializer,
    TokenSerializer,
    ToolVersionCreateSerializer,
    ToolVersionSerializer,
)
from registry.choices import Action
from registry.errors import NotFound, PermissionDenied, ValidationFailed
from registry.models.versions import DefinitionVersion
from registry.services import lifecycle, skills, tenancy, tools
from runs.api.throttles import AccountTries, FirstRefusalThrottled, PasswordTries


class TokenView(FirstRefusalThrottled, BodyDescribed, APIView):
    """Exchange a username and password for a token acting in one tenant."""

    authentication_classes: ClassVar[list] = []
    permission_classes: ClassVar[list] = [AllowAny]
    throttle_classes: ClassVar[list] = [PasswordTries, AccountTries]
    body_serializer = TokenRequestSerializer

    @extend_schema(
        tags=["auth"], request=TokenRequestSerializer, responses={200: TokenSerializer}, auth=[]
    )
    def post(self, request: Request) -> Response:
        data = self.get_serializer(data=request.data)
        data.is_valid(raise_exception=True)
        token, key = tenancy.api_token_issue(
            username=data.validated_data["username"],
            password=data.validated_data["password"],
            tenant_slug=data.validated_data.get("tenant"),
        )
        output = {"token": key, "tenant": token.tenant.slug, "expires_at": token.expires_at}
        response = Response(TokenSerializer(output).data)
        # The answer holds the key: no browser or proxy keeps it (RFC 6749, 5.1).
        add_never_cache_headers(response)
        return response


@extend_schema_view(post=extend_schema(exclude=True))
class TokenWithoutSlashView(TokenView):
    """The same exchange at `auth/token`, the spelling of every other API path: a POST there
    would otherwise be redirected (a client following it sends a GET) or, with DEBUG, fail."""


class VersionViewSet(
    BodiesDescribed, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet
):
    """Versions of one kind of definition, scoped to the token's tenant; commands are POSTs
    that call one lifecycle service each."""

    lookup_value_regex = "[^/]+"
    output_serializer: ClassVar[type[serializers.Serializer]]
    create_serializer: ClassVar[type[serializers.Serializer]]
    select_visible: ClassVar[Callable[..., QuerySet]]
    create_service: ClassVar[Callable[..., DefinitionVersion]]
    publish_service: ClassVar[Callable[..., DefinitionVersion]]
    deprecate_service: ClassVar[Callable[..., DefinitionVersion]]
    revoke_service: ClassVar[Callable[..., DefinitionVersion]]
    rollback_service: ClassVar[Callable[..., DefinitionVersion]]
    version_argument: ClassVar[str]
    # What publishing takes besides the version (a skill's release-gate override).
    publish_serializer: ClassVar[type[serializers.Serializer]] = CommandSerializer
    # What rolling back takes besides the version (a skill's release-gate override).
    rollback_serializer: ClassVar[type[serializers.Serializer]] = CommandSerializer

    def get_queryset(self) -> QuerySet:
        if getattr(self, "swagger_fake_view", False):
            return self.output_serializer.Meta.model.objects.none()
        return type(self).select_visible(user=self.request.user, tenant=self.request.auth.tenant)

    def list(self, request: Request) -> Response:
        """By name, then by semver precedence, highest first (`version_ids_by_precedence`)."""
        versions = self.filter_queryset(self.get_queryset())
        page = self.paginate_queryset(selectors.version_ids_by_precedence(versions))
        found = versions.in_bulk(page)
        output = self.output_serializer([found[pk] for pk in page], many=True)
        return self.get_paginated_response(output.data)

    @classmethod
    def body_serializers(cls) -> dict[str, type[serializers.Serializer]]:
        return {
            "create": cls.create_serializer,
            "publish": cls.publish_serializer,
            "deprecate": LifecycleSerializer,
            "revoke": LifecycleSerializer,
            "rollback": cls.rollback_serializer,
        }

    def get_serializer_class(self) -> type[serializers.Serializer]:
        if body := self.body_described():
            return body
        return self.create_serializer if self.action == "create" else self.output_serializer

    def get_object(self) -> DefinitionVersion:
        if not is_id_in_url(self.kwargs["pk"]):
            raise NotFound("No such version.")
        return super().get_object()

    def _created(self, data: dict[str, Any]) -> DefinitionVersion:
        return type(self).create_service(
            actor=self.request.user, tenant=self.request.auth.tenant, **data
        )

    def create(self, request: Request) -> Response:
        # Who may create is answered before the body is read: 403, not a 400 on the input.
        if not selectors.user_can(
            user=request.user, action=Action.REGISTRY_PUBLISH, tenant=request.auth.tenant
        ):
            raise PermissionDenied("You may not create versions in this tenant.")
        data = self.create_serializer(data=request.data)
        data.is_valid(raise_exception=True)
        version = self._created(dict(data.validated_data))
        return Response(self.output_serializer(version).data, status=status.HTTP_201_CREATED)

    def _command(
        self, service: Callable[..., DefinitionVersion], body: type[serializers.Serializer]
    ) -> Response:
        version = self.get_object()
        # Who may manage it is answered before the body is read: 403, not a 400 on the input.
        lifecycle.require_publisher(actor=self.request.user, definition=version.parent)
        data = body(data=self.request.data)
        data.is_valid(raise_exception=True)
        version = service(
            actor=self.request.user, **{self.version_argument: version}, **data.validated_data
        )
        version.parent.refresh_from_db(fields=["current_version"])
        return Response(self.output_serializer(version).data)

    @action(detail=True, methods=["post"])
    def publish(self, request: Request, pk: str) -> Response:
        return self._command(type(self).publish_service, self.publish_serializer)

    @action(detail=True, methods=["post"])
    def deprecate(self, request: Request, pk: str) -> Response:
        return self._command(type(self).deprecate_service, LifecycleSerializer)

    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, pk: str) -> Response:
        return self._command(type(self).revoke_service, LifecycleSerializer)

    @action(detail=True, methods=["post"])
    def rollback(self, request: Request, pk: str) -> Response:
        """Make this (earlier, published) version current again."""
        return self._command(type(self).rollback_service, self.rollback_serializer)


def _version_schema(viewset: type[VersionViewSet], kind: str) -> type[VersionViewSet]:
    """Document one kind's endpoints; extend_schema_view copies inherited methods, so the
    tool and skill viewsets never share (and overwrite) one schema."""
    output = viewset.output_serializer
    commands = {
        "publish": (
            f"Publish a draft {kind} version; it is frozen and becomes current, unless it is "
            "a pre-release and a stable version is published."
        ),
        "deprecate": f"Deprecate a {kind} version: it serves existing pins only.",
        "revoke": f"Revoke a {kind} version: it is never used again.",
        "rollback": f"Make an earlier published {kind} version current again.",
    }
    requests = viewset.body_serializers()
    schemas = {
        name: extend_schema(summary=summary, request=requests[name], responses={200: output})
        for name, summary in commands.items()
    }
    schemas["create"] = extend_schema(
        summary=f"Create a draft {kind} version.",
        request=requests["create"],
        responses={201: output},
    )
    schemas["list"] = extend_schema(summary=f"{kind.title()} versions visible in your tenant.")
    schemas["retrieve"] = extend_schema(summary=f"One {kind} version.")
    return extend_schema_view(**schemas)(viewset)


@extend_schema(tags=["tools"])
class ToolVersionViewSet(VersionViewSet):
    output_serializer = ToolVersionSerializer
    create_serializer = ToolVersionCreateSerializer
    filterset_class = filters.ToolVersionFilter
    select_visible = staticmethod(selectors.tool_versions_visible)
    create_service = staticmethod(tools.tool_version_create)
    publish_service = staticmethod(tools.tool_version_publish)
    deprecate_service = staticmethod(tools.tool_version_deprecate)
    revoke_service = staticmethod(tools.tool_version_revoke)
    rollback_service = staticmethod(tools.tool_rollback)
    version_argument = "tool_version"


@extend_schema(tags=["skills"])
class SkillVersionViewSet(VersionViewSet):
    output_serializer = SkillVersionSerializer
    create_serializer = SkillVersionCreateSerializer
    filterset_class = filters.SkillVersionFilter
    select_visible = staticmethod(selectors.skill_versions_visible)
    create_service = staticmethod(skills.skill_version_create)
    publish_service = staticmethod(skills.skill_version_publish)
    deprecate_service = staticmethod(skills.skill_version_deprecate)
    revoke_service = staticmethod(skills.skill_version_revoke)
    rollback_service = staticmethod(skills.skill_rollback)
    version_argument = "skill_version"
    publish_serializer = SkillPublishSerializer
    rollback_serializer = SkillRollbackSerializer

    def _created(self, data: dict[str, Any]) -> DefinitionVersion:
        tenant = self.request.auth.tenant
        references = data.pop("tool_dependencies", [])
        try:
            pinned = [
                selectors.tool_version_resolve(tenant=tenant, reference=reference)
                for reference in references
            ]
        except (NotFound, ValidationFailed) as error:
            raise ValidationFailed(
                error.message, details={"tool_dependencies": [error.message]}
            ) from error
        return skills.skill_version_create(
            actor=self.request.user, tenant=tenant, tool_versions=pinned, **data
        )


_version_schema(ToolVersionViewSet, "tool")
_version_schema(SkillVersionViewSet, "skill")
