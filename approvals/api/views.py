from django.db.models import QuerySet
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from approvals import selectors, services
from approvals.api.filters import ApprovalFilter, HandoffFilter
from approvals.api.serializers import (
    ApprovalSerializer,
    DecisionRequestSerializer,
    HandoffResolveSerializer,
    HandoffSerializer,
)
from approvals.errors import NotFound
from approvals.models import BusinessAction, Handoff
from config.api import BodiesDescribed
from config.ids import is_id_in_url


@extend_schema(tags=["approvals"])
class ApprovalViewSet(
    BodiesDescribed, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet
):
    """Business Actions of the token's tenant: the list holds those the caller may decide;
    an approver of the tenant may read any; a person of the tenant who may not decide one is
    refused the decision (403), an action of another tenant is not found (404)."""

    serializer_class = ApprovalSerializer
    filterset_class = ApprovalFilter
    lookup_value_regex = "[^/]+"

    def get_queryset(self) -> QuerySet[BusinessAction]:
        if getattr(self, "swagger_fake_view", False):
            return BusinessAction.objects.none()
        user, tenant = self.request.user, self.request.auth.tenant
        if self.action == "list":
            return selectors.actions_for_approver(user=user, tenant=tenant)
        if self.action == "decision":
            return selectors.actions_of_tenant(tenant=tenant)
        return selectors.actions_visible(user=user, tenant=tenant)

    @classmethod
    def body_serializers(cls) -> dict[str, type[serializers.Serializer]]:
        return {"decision": DecisionRequestSerializer}

    def get_object(self) -> BusinessAction:
        if not is_id_in_url(self.kwargs["pk"]):
            raise NotFound("No such approval.")
        return super().get_object()

    @extend_schema(
        summary="Approve or reject the frozen payload with the hash you reviewed.",
        request=DecisionRequestSerializer,
        responses={200: ApprovalSerializer},
    )
    @action(detail=True, methods=["post"])
    def decision(self, request: Request, pk: str) -> Response:
        action = self.get_object()
        # Who may decide is answered before the body is read: 403, not a 400 on the input.
        services.approval_decider_check(action=action, approver=request.user)
        data = DecisionRequestSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        services.approval_decide(action_id=action.pk, approver=request.user, **data.validated_data)
        action = self.get_queryset().get(pk=action.pk)
        return Response(ApprovalSerializer(action).data)


@extend_schema(tags=["approvals"])
class HandoffViewSet(
    BodiesDescribed, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet
):
    """Requests of the token's tenant that the policy leaves to people (the human queue)."""

    serializer_class = HandoffSerializer
    filterset_class = HandoffFilter
    lookup_value_regex = "[^/]+"

    def get_queryset(self) -> QuerySet[Handoff]:
        if getattr(self, "swagger_fake_view", False):
            return Handoff.objects.none()
        if self.action == "resolve":
            # Who may handle it is the service's answer: 403 in the tenant, 404 elsewhere.
            return Handoff.objects.filter(tenant=self.request.auth.tenant).select_related(
                "tenant", "run"
            )
        if self.action == "list":
            return selectors.handoffs_for_handler(
                user=self.request.user, tenant=self.request.auth.tenant
            )
        return selectors.handoffs_for_person(
            user=self.request.user, tenant=self.request.auth.tenant
        )

    @classmethod
    def body_serializers(cls) -> dict[str, type[serializers.Serializer]]:
        return {"resolve": HandoffResolveSerializer}

    def get_object(self) -> Handoff:
        if not is_id_in_url(self.kwargs["pk"]):
            raise NotFound("No such handoff.")
        return super().get_object()

    @extend_schema(
        summary="Close the request: handled (say what you did) or declined (say why).",
        request=HandoffResolveSerializer,
        responses={200: HandoffSerializer},
    )
    @action(detail=True, methods=["post"])
    def resolve(self, request: Request, pk: str) -> Response:
        handoff = self.get_object()
        # Who may handle it is answered before the body is read: 403, not a 400 on the input.
        services.handoff_handler_check(handoff=handoff, person=request.user)
        data = HandoffResolveSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        services.handoff_resolve(handoff_id=handoff.pk, person=request.user, **data.validated_data)
        resolved = selectors.handoffs_for_person(user=request.user, tenant=request.auth.tenant)
        return Response(HandoffSerializer(resolved.get(pk=handoff.pk)).data)
