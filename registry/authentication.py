from django.db.models import QuerySet
from django.utils import timezone
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions
from rest_framework.request import Request

from registry.models import ApiToken
from registry.models.tenancy import hash_token


def _usable_tokens() -> QuerySet[ApiToken]:
    """Tokens that authenticate now: not revoked, not expired, of an active user and tenant."""
    return ApiToken.objects.filter(
        revoked_at__isnull=True,
        expires_at__gt=timezone.now(),
        user__is_active=True,
        tenant__is_active=True,
    )


def token_usable(token: ApiToken) -> bool:
    """Whether `token` would still authenticate (a long answer, such as a stream, asks again)."""
    current = _usable_tokens().select_related("user").filter(pk=token.pk).first()
    return current is not None and current.is_password_unchanged


class ApiTokenAuthentication(authentication.BaseAuthentication):
    """`Authorization: Token <key>`, or `Bearer <key>` as most HTTP clients send a token; sets
    request.auth to the ApiToken, which names the tenant."""

    keyword = "Token"
    schemes = (b"token", b"bearer")

    def authenticate(self, request: Request) -> tuple | None:
        header = authentication.get_authorization_header(request).split()
        if not header or header[0].lower() not in self.schemes:
            return None
        if len(header) != 2:
            raise exceptions.AuthenticationFailed("Malformed Authorization header.")
        try:
            key = header[1].decode()
        except UnicodeDecodeError as error:
            raise exceptions.AuthenticationFailed("Malformed token.") from error
        token = (
            _usable_tokens()
            .select_related("user", "tenant", "tenant__grant_group")
            .filter(key_hash=hash_token(key))
            .first()
        )
        if token is None:
            raise exceptions.AuthenticationFailed("Invalid or expired token.")
        if not token.is_password_unchanged:
            raise exceptions.AuthenticationFailed(
                "The password changed after this token was issued; ask for a new token."
            )
        return token.user, token

    def authenticate_header(self, request: Request) -> str:
        return self.keyword


class ApiTokenScheme(OpenApiAuthenticationExtension):
    target_class = ApiTokenAuthentication
    name = "tokenAuth"

    def get_security_definition(self, auto_schema):
        return {
            "type": "apiKey",
            "in": "header",
            "name": "Authorization",
            "description": 'Send "Token <key>" (or "Bearer <key>") from POST /api/v1/auth/token/.',
        }
