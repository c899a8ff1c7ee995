"""Whether a field's name says it holds a secret: the one rule for a tool's result (its
envelope), what a trace keeps or a page shows, what memory refuses and which model
parameters the registry refuses.

A name is read as words, whatever its case or separators (`apiKey`, `API_KEY`, `x-api-key`
and `apikey` alike). Some words name a secret wherever they stand: password, secret,
credential, authorization, cookie, and token unless it is counted (token_count) or marks a
place in a list (nextPageToken). Others only after a word that makes them one: an api,
access, private or signing key is a secret, an idempotency, primary or public key is not; a
refresh token is, a count of input tokens is not.
"""

import functools
import re
from collections.abc import Callable
from typing import Any, TypeVar

_WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")

_SECRET_WORDS = frozenset(
    {"authorization", "cookie", "cookies", "credential", "credentials", "secret", "secrets"}
)
# Inside any word: dbpassword, passwd, passphrase.
_SECRET_WITHIN = re.compile("passw|passphrase")
# A "token" counted rather than held (token_count, tokenUsage) or a place in a list
# (nextPageToken, continuation_token).
_COUNTING = frozenset(
    {"budget", "count", "counts", "estimate", "limit", "limits", "total", "usage"}
)
_PLACE = frozenset({"continuation", "page"})
# Words after which "key", "keys" or "tokens" name secrets.
_QUALIFIERS = frozenset(
    {
        "access",
        "account",
        "api",
        "auth",
        "bearer",
        "client",
        "encryption",
        "master",
        "private",
        "refresh",
        "secret",
        "session",
        "signing",
        "ssh",
    }
)
_QUALIFIED = frozenset({"key", "keys", "tokens"})
# The same pairs written as one word: apikey, accesstoken, clientsecret.
_RUN_TOGETHER = frozenset(
    qualifier + word for qualifier in _QUALIFIERS for word in (*_QUALIFIED, "token", "secret")
)


def name_words(name: str) -> list[str]:
    """The words of a name, lower-cased: apiKey, API_KEY and x-api-key give api, key."""
    return [word.lower() for word in _WORDS.findall(name)]


T = TypeVar("T")

# A name longer than this is answered without the cache of `cached_by_name`.
CACHED_NAME_CHARS = 256


def cached_by_name(function: Callable[..., T]) -> Callable[..., T]:
    """`function` of a name (and more) answered from a cache of the process: the same few
    names repeat in every item. A name longer than CACHED_NAME_CHARS is answered without it:
    a tool's answer may use any text as a key, and a cached one would hold its memory for the
    life of the process."""
    cached = functools.lru_cache(maxsize=4096)(function)

    @functools.wraps(function)
    def answer(name: str, *args: Any, **kwargs: Any) -> T:
        if len(name) > CACHED_NAME_CHARS:
            return function(name, *args, **kwargs)
        return cached(name, *args, **kwargs)

    answer.cache_info = cached.cache_info  # type: ignore[attr-defined]
    return answer


@cached_by_name
def secret_key(name: str) -> bool:
    """Whether a field of this name holds a secret: access_token, apiKey, client_secret,
    AWS_SECRET_ACCESS_KEY, password (not input_tokens, token_count, nextPageToken,
    idempotency_key, public_key or keywords)."""
    words = name_words(name)
    for index, word in enumerate(words):
        before = words[index - 1] if index else ""
        after = words[index + 1] if index + 1 < len(words) else ""
        if word == "token":
            if after not in _COUNTING and before not in _PLACE:
                return True
        elif (
            word in _SECRET_WORDS
            or word in _RUN_TOGETHER
            or _SECRET_WITHIN.search(word)
            or (after in _QUALIFIED and word in _QUALIFIERS)
        ):
            return True
    return False
