"""Per-actor and per-tenant rate limits on ingress, kept in the cache (Redis in production)
so every web process counts the same requests; over the limit: 429 with Retry-After."""

from rest_framework.request import Request
from rest_framework.throttling import SimpleRateThrottle

from registry.models import ApiToken


class _TokenThrottle(SimpleRateThrottle):
    def ident_of(self, token: ApiToken) -> str:
        raise NotImplementedError

    def get_cache_key(self, request: Request, view) -> str | None:
        if not isinstance(request.auth, ApiToken):
            return None
        return self.cache_format % {"scope": self.scope, "ident": self.ident_of(request.auth)}


class ActorIngressThrottle(_TokenThrottle):
    scope = "ingress_actor"

    def ident_of(self, token: ApiToken) -> str:
        return f"{token.tenant_id}:{token.user_id}"


class TenantIngressThrottle(_TokenThrottle):
    scope = "ingress_tenant"

    def ident_of(self, token: ApiToken) -> str:
        return str(token.tenant_id)
