"""Rate limits of the API and the sign-in pages: a sliding window kept in Redis (in
production) and taken in one atomic step, so every web process counts the same requests and
concurrent requests cannot slip through together; over the limit: 429 with Retry-After.
Ingress is limited per actor and per tenant, password tries per client. Only a request the view
serves counts: OPTIONS (a browser's CORS preflight, a client learning what to send) and a method
the view does not serve (405) do none of the work a limit guards, and must not spend a user's
allowance or lock a client out of signing in."""

import hashlib
import unicodedata
from typing import ClassVar

from rest_framework.request import Request
from rest_framework.throttling import SimpleRateThrottle

from registry.models import ApiToken
from runs.tools import limits


def _served(request: Request, view) -> bool:
    """Whether `view` answers the request with a handler of its own (a Django view of the
    sign-in pages, given as None, decides which requests it counts)."""
    if view is None:
        return True
    method = request.method.lower()
    return method != "options" and method in view.http_method_names and hasattr(view, method)


# The least a refused request is told to wait (Retry-After): the window may lapse between the
# refusal and reading when it does, and 0 would tell a client to send again at once.
WAIT_MIN_SECONDS = 1.0


class _WindowThrottle(SimpleRateThrottle):
    retry_after: float | None = None
    # The window and the take of the request it let through.
    taken: tuple[str, str] | None = None

    def allow_request(self, request: Request, view) -> bool:
        if self.rate is None or not _served(request, view):
            return True
        ident = self.get_cache_key(request, view)
        if ident is None:
            return True
        holder = limits.window_take(ident, cap=self.num_requests, seconds=self.duration)
        if holder is not None:
            self.taken = (ident, holder)
            return True
        self.retry_after = max(WAIT_MIN_SECONDS, limits.window_wait(ident, cap=self.num_requests))
        return False

    def wait(self) -> float | None:
        return self.retry_after

    def give_back(self) -> None:
        """The request this throttle let through was refused by another."""
        if self.taken is not None:
            limits.window_give_back(*self.taken)


class _TokenThrottle(_WindowThrottle):
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


class PasswordTries(_WindowThrottle):
    """The passwords a client (its peer address, as DRF counts it) may try: the API's token
    exchange and the sign-in pages (`config.sign_in`) count against one allowance,
    AUTH_TOKEN_RATE; a request (or a Django page's request) is counted before its password
    is checked."""

    scope = "auth_token"

    def get_cache_key(self, request: Request, view) -> str:
        return self.cache_format % {"scope": self.scope, "ident": self.get_ident(request)}


class AccountTries(_WindowThrottle):
    """The passwords of one account (the username posted) that clients may try, from
    whatever addresses, AUTH_ACCOUNT_RATE: a guesser with many addresses has each address's
    allowance of `PasswordTries`, but shares this one. Asked after `PasswordTries`, so a try
    refused for its address spends nothing of the account's. The username is counted as the
    sign-in form reads it (stripped, NFKC), so no other spelling of it has an allowance of its
    own. A page that posts none (the password change page) tries the signed-in person's."""

    scope = "auth_account"

    def get_cache_key(self, request: Request, view) -> str | None:
        data = request.data if view is not None else request.POST
        username = data.get("username") if hasattr(data, "get") else None
        if username is None and view is None and request.user.is_authenticated:
            username = request.user.get_username()
        if not isinstance(username, str) or not username.strip():
            return None
        username = unicodedata.normalize("NFKC", username.strip())
        ident = hashlib.sha256(username.encode(errors="surrogatepass")).hexdigest()
        return self.cache_format % {"scope": self.scope, "ident": ident}


class FirstRefusalThrottled:
    """Throttles asked in order, stopping at the first refusal, which gives back what the
    throttles before it took. DRF's `check_throttles` asks every throttle even after one
    refused, and asking takes a request from the window: a request refused anyway would use
    up a window it never used."""

    def check_throttles(self, request: Request) -> None:
        passed = []
        for throttle in self.get_throttles():
            if not throttle.allow_request(request, self):
                for earlier in passed:
                    earlier.give_back()
                self.throttled(request, throttle.wait())
            passed.append(throttle)


class IngressThrottled(FirstRefusalThrottled):
    """For the ingress views: the actor's limit first, then the tenant's."""

    throttle_classes: ClassVar[list] = [ActorIngressThrottle, TenantIngressThrottle]
