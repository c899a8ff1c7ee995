"""The sign-in pages (`accounts/login/` and the admin's), and the admin's password change page,
which checks the old password: each password posted to them is a try of the client's
allowance, and of the account's, that the API's token exchange counts too (`PasswordTries`,
`AccountTries`). Past either, a post is refused with 429 and Retry-After
before its password is checked. With Redis down the allowance cannot be taken and a post is
refused with 503, as the API refuses it: never let through unlimited. Each page's refusal is
worded for what its user was doing: signing in, or changing their password."""

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from config.api import SERVICE_UNAVAILABLE_RETRY_AFTER
from runs.api.throttles import AccountTries, PasswordTries

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Wording:
    """How a page's refusal names what its user was doing."""

    title: str
    attempts: str
    unavailable: str


SIGN_IN = Wording(title="Sign in", attempts="sign-in", unavailable="Signing in")
PASSWORD_CHANGE = Wording(
    title="Change password", attempts="password-change", unavailable="Changing a password"
)


def _refused(
    request: HttpRequest, *, status: int, wait: int, title: str, message: str
) -> HttpResponse:
    response = render(
        request, "sign_in_refused.html", {"title": title, "message": message}, status=status
    )
    response["Retry-After"] = str(wait)
    return response


def sign_in_throttled(
    view: Callable[..., HttpResponse], *, wording: Wording = SIGN_IN
) -> Callable[..., HttpResponse]:
    """`view`, a sign-in page (or the password change page, with its `wording`), whose posts
    count against the client's and the account's password tries."""

    @functools.wraps(view)
    def throttled(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if request.method != "POST":
            return view(request, *args, **kwargs)
        throttles = (PasswordTries(), AccountTries())
        passed = []
        try:
            for tries in throttles:
                if not tries.allow_request(request, None):
                    break
                passed.append(tries)
        except redis.RedisError as error:
            logger.warning("Redis is unavailable: %s", type(error).__name__)
            return _refused(
                request,
                status=503,
                wait=SERVICE_UNAVAILABLE_RETRY_AFTER,
                title=wording.title,
                message=f"{wording.unavailable} is unavailable; retry shortly.",
            )
        if len(passed) < len(throttles):
            for earlier in passed:
                earlier.give_back()
            wait = max(1, math.ceil(tries.wait() or 0))
            return _refused(
                request,
                status=429,
                wait=wait,
                title=wording.title,
                message=f"Too many {wording.attempts} attempts; try again in {wait} seconds.",
            )
        return view(request, *args, **kwargs)

    return throttled
