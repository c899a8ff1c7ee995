from rest_framework.permissions import BasePermission
from rest_framework.request import Request

from registry.choices import Action
from registry.models import ApiToken
from registry.selectors import user_can


class IsTenantMember(BasePermission):
    """A token holder with a role in the token's tenant. Finer checks happen in services."""

    message = "You have no role in this tenant."

    def has_permission(self, request: Request, view) -> bool:
        if not isinstance(request.auth, ApiToken):
            return False
        return user_can(user=request.user, action=Action.REGISTRY_VIEW, tenant=request.auth.tenant)
