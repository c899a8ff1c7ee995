from django.db.models import F, Q, QuerySet
from django.http import Http404
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from config.api import BodiesDescribed, CommandSerializer
from config.ids import is_id_in_url
from evaluations import selectors, services
from evaluations.api.serializers import (
    EvalCaseResultSerializer,
    EvalRunSerializer,
    EvalRunStartSerializer,
    EvalSuiteDetailSerializer,
    EvalSuiteSerializer,
)
from evaluations.errors import NotFound, PermissionDenied, ValidationFailed
from evaluations.models import EvalRun, EvalSuite
from registry.choices import Action
from registry.models import AgentConfig, ModelConfig
from registry.selectors import skill_versions_visible, user_can


class _UUIDLookup:
    lookup_value_regex = "[^/]+"
    not_found = "Not found."

    def get_object(self):
        """The object, or one 404 whatever the id was: not an id, or none the caller sees."""
        if not is_id_in_url(self.kwargs["pk"]):
            raise NotFound(self.not_found)
        try:
            return super().get_object()
        except Http404 as error:
            raise NotFound(self.not_found) from error


@extend_schema(tags=["evaluations"])
class EvalSuiteViewSet(
    _UUIDLookup, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet
):
    """Suites you may run: the platform's and your tenant's."""

    not_found = "No such suite."

    def get_queryset(self) -> QuerySet[EvalSuite]:
        if getattr(self, "swagger_fake_view", False):
            return EvalSuite.objects.none()
        return selectors.eval_suites_visible(
            user=self.request.user, tenant=self.request.auth.tenant
        )

    def get_serializer_class(self):
        return EvalSuiteDetailSerializer if self.action == "retrieve" else EvalSuiteSerializer


def _resolve(request: Request, data: dict) -> dict:
    """The start request's names and ids as rows the caller may use, or field errors."""
    tenant, user = request.auth.tenant, request.user
    found = {
        "suite": selectors.eval_suites_visible(user=user, tenant=tenant)
        .filter(pk=data["suite"])
        .first(),
        "skill_version": skill_versions_visible(user=user, tenant=tenant)
        .filter(pk=data["skill_version"])
        .first(),
        "agent_config": AgentConfig.objects.filter(tenant=tenant, name=data["agent"]).first(),
    }
    if "model_config" in data:
        # The tenant's own configuration of that name before the platform's.
        found["model_config"] = (
            ModelConfig.objects.filter(
                Q(tenant=tenant) | Q(tenant__isnull=True), name=data["model_config"]
            )
            .order_by(F("tenant_id").asc(nulls_last=True))
            .first()
        )
    missing = {name: ["Not found in your tenant."] for name, row in found.items() if row is None}
    if missing:
        raise ValidationFailed("The eval run cannot start.", details=missing)
    return found


@extend_schema(tags=["evaluations"])
class EvalRunViewSet(
    BodiesDescribed,
    _UUIDLookup,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    viewsets.GenericViewSet,
):
    """Eval runs of your tenant: start one, follow its progress, read its metrics and per-case
    results, cancel it."""

    serializer_class = EvalRunSerializer
    not_found = "No such eval run."

    def get_queryset(self) -> QuerySet[EvalRun]:
        if getattr(self, "swagger_fake_view", False):
            return EvalRun.objects.none()
        return selectors.eval_runs_visible(user=self.request.user, tenant=self.request.auth.tenant)

    @classmethod
    def body_serializers(cls) -> dict[str, type[serializers.Serializer]]:
        return {"create": EvalRunStartSerializer, "cancel": CommandSerializer}

    @extend_schema(
        summary="Start a suite against one skill version with an agent (and another model).",
        request=EvalRunStartSerializer,
        responses={201: EvalRunSerializer, 200: EvalRunSerializer},
        description="201 with a new eval run; 200 with the one of the same suite, version, "
        "agent and model still queued or running (a request sent again starts no second one).",
    )
    def create(self, request: Request) -> Response:
        if not user_can(
            user=request.user, action=Action.REGISTRY_PUBLISH, tenant=request.auth.tenant
        ):
            raise PermissionDenied("Only publishers evaluate skill versions.")
        data = EvalRunStartSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        eval_run, created = services.eval_run_start(
            actor=request.user, **_resolve(request, data.validated_data)
        )
        eval_run = self.get_queryset().get(pk=eval_run.pk)
        return Response(
            EvalRunSerializer(eval_run).data,
            status=status.HTTP_201_CREATED if created else status.HTTP_200_OK,
        )

    @extend_schema(
        summary="Each case: passed or not, why, and what its run did.",
        responses={200: EvalCaseResultSerializer(many=True)},
    )
    @action(detail=True, methods=["get"], serializer_class=EvalCaseResultSerializer)
    def results(self, request: Request, pk: str) -> Response:
        eval_run = self.get_object()
        results = eval_run.results.select_related("case").order_by("case__key")
        page = self.paginate_queryset(results)
        return self.get_paginated_response(EvalCaseResultSerializer(page, many=True).data)

    @extend_schema(
        summary="Stop between cases; the results so far stay.", request=CommandSerializer
    )
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str) -> Response:
        eval_run = self.get_object()
        CommandSerializer(data=request.data).is_valid(raise_exception=True)
        eval_run = services.eval_run_cancel(eval_run=eval_run, actor=request.user)
        return Response(EvalRunSerializer(self.get_queryset().get(pk=eval_run.pk)).data)
