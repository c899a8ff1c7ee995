"""Redaction by data classification, applied before anything is stored in a trace or shown.

Two levels. Everything stored in a span, and everything anyone is shown, loses secrets:
credential-like keys, bearer tokens, values that look like keys or tokens. A viewer without
clearance (`Action.RUN_VIEW_SENSITIVE`) also sees email addresses masked, the fields a tool
contract marks sensitive (`result_contract.sensitive_fields`) replaced, and what the run's tools
returned under those fields masked where it was copied into text (a name in a draft's body).
"""

import base64
import binascii
import functools
import html.entities
import re
import string
import unicodedata
from collections.abc import Iterable
from typing import Any

from config import jsontext
from config.secret_names import cached_by_name, name_words, secret_key

REDACTED = "[redacted]"
# An email address: the local part is taken whole, from where its run of characters starts
# (a match tried inside a run would scan it again: quadratic on long text), and masked from
# its first letter or digit. It may hold any of RFC 5322's atext (o'brien, first#last) but
# the characters that also join a URL's parts (/ ? = &); its @ may be written %40, as in a
# URL.
_EMAIL_LOCAL = r"[A-Za-z0-9.!#$%'*+^_`{|}~-]"
_EMAIL = re.compile(
    rf"(?<!{_EMAIL_LOCAL})({_EMAIL_LOCAL}+)(@|%40)([A-Za-z0-9.-]+\.[A-Za-z]{{2,}})\b"
)
_EMAIL_FIRST = re.compile(r"[A-Za-z0-9]")
_BEARER = re.compile(r"(?i:bearer)\s+[A-Za-z0-9._~+/=-]{8,}")
# A pasted Authorization header (or its JSON or Python form), with a scheme or without:
# "Authorization: Token 4f9c2a7e...". Its credential is long, with a digit: what follows
# "authorization:" in prose (a ticket, a version, "see RFC 7235") is shorter or has none.
_AUTHORIZATION = re.compile(
    r"((?i:authorization)[\"']?\s*[:=]\s*[\"']?(?:[A-Za-z][A-Za-z0-9-]*\s+)?)"
    r"(?=[A-Za-z._~+/-]*[0-9])[A-Za-z0-9._~+/-]{16,}=*"
)
# "Token 9944b091...", "token: 9944b091...": a long hex credential (32 characters or more).
_HEX_TOKEN = re.compile(r"\b((?i:token)(?:[\"']?\s*[:=]\s*[\"']?|\s+))[0-9A-Fa-f]{32,}\b")
# "Basic dXNlcjpzM2NyZXQ=": removed only when it decodes to "user:password" (the word basic
# is followed by ordinary words far more often).
_BASIC = re.compile(r"\b((?i:basic)\s+)([A-Za-z0-9+/]{8,}={0,2})(?![A-Za-z0-9+/=])")
# Each with what every match of it needs, as the text reads lower-cased (`_needs_met`).
_SECRET_VALUES: tuple[tuple[re.Pattern, tuple[str, ...]], ...] = (
    # agt_: this platform's own API tokens (registry.models.ApiToken); OpenAI's, Stripe's
    # secret and restricted keys, GitHub's, GitLab's, Slack's and the like by their prefixes
    # (a publishable pk_ key is public; a bare sk_ or pk_ names SQL constraints too).
    (
        re.compile(
            r"\b(?:sk-|(?:sk|rk)_(?:live|test)_|(?:ghp|gho|ghu|ghs|ghr|agt|xox[abeprs]|xapp)[-_]"
            r"|glpat-)[A-Za-z0-9_-]{12,}\b"
        ),
        ("sk-", "sk_", "rk_", "ghp", "gho", "ghu", "ghs", "ghr", "agt", "xox", "xapp", "glpat-"),
    ),
    (re.compile(r"\bgithub_pat_[A-Za-z0-9_]{22,}\b"), ("github_pat_",)),
    # Hugging Face, npm, PyPI tokens; webhook signing secrets.
    (
        re.compile(r"\b(?:hf_[A-Za-z0-9]{30,}|npm_[A-Za-z0-9]{36}|pypi-AgE[A-Za-z0-9_-]{50,})\b"),
        ("hf_", "npm_", "pypi-"),
    ),
    (re.compile(r"\bwhsec_[A-Za-z0-9+/=]{24,}(?![A-Za-z0-9+/=])"), ("whsec_",)),
    # Incoming-webhook URLs, which post to a channel with no other credential: Slack's and
    # Discord's.
    (
        re.compile(r"\bhttps://hooks\.slack\.com/(?:services|workflows|triggers)/[A-Za-z0-9/_-]+"),
        ("hooks.slack.com",),
    ),
    (
        re.compile(r"\bhttps://(?:\w+\.)?discord(?:app)?\.com/api/webhooks/\d+/[A-Za-z0-9_-]+"),
        ("discord",),
    ),
    # AWS access key ids, Google API keys.
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), ("akia", "asia")),
    (re.compile(r"\bAIza[0-9A-Za-z_-]{35}(?![0-9A-Za-z_-])"), ("aiza",)),
    # A JWT starts where its run of characters starts (not at every "eyJ" inside one).
    (
        re.compile(
            r"(?<![A-Za-z0-9_-])eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}\b"
        ),
        ("eyj",),
    ),
)
# A PEM (or PGP) private key: its BEGIN line, the headers of an encrypted key, its base64
# lines (with a digit or a sign: a long word of prose is none) and its END line; without an
# END line, the base64 lines only, never the text after. Lines are separated by whitespace
# or, in JSON text, by an escaped newline (escaped once or twice).
_LINE = r"(?:\s|\\{1,3}[nr])+"
_PRIVATE_KEY = re.compile(
    rf"-----BEGIN [A-Z0-9 ]{{0,40}}PRIVATE KEY(?: BLOCK)?-----"
    rf"(?:{_LINE}(?:Proc-Type|DEK-Info|Version|Comment|Hash|Charset): [^\n\\]{{0,200}})*"
    rf"(?:{_LINE}(?=[A-Za-z0-9+/=]*[0-9+/=])[A-Za-z0-9+/=]{{16,}})*"
    rf"(?:(?:{_LINE}[A-Za-z0-9+/=]{{1,15}})?{_LINE}"
    rf"-----END [A-Z0-9 ]{{0,40}}PRIVATE KEY(?: BLOCK)?-----)?"
)
# The password of a URL: postgres://app:s3cret@db.internal/prod (the user may hold an @, as
# Azure's user@server does). The scheme is read from where its run of characters starts; a
# port followed by a list of addresses (http://host:8080,bob@example.com) is none.
_URL_PASSWORD = re.compile(
    r"(?<![A-Za-z0-9+.-])([A-Za-z][A-Za-z0-9+.-]{0,31}://[^\s:/?#\[\]]*:)([^\s/?#@,;]+)@"
)
# A value given to a name that ends in a word naming a secret, and that `config.secret_names`
# reads as one: password=…, "api_key": "…", AWS_SECRET_ACCESS_KEY=…, ?token=…, --password=…,
# **Password:** …, password := "…", as in a config file, JSON (nested JSON text too), a
# command line, Markdown, code or a query string. A quoted value of six characters or more
# is taken whole; an unquoted one must look like a credential: eight characters or more,
# letters and digits, not a URL, a call, a dotted name, a date or a version, and it stops at
# brackets and separators (`password = request.POST["password"]`, "has_secret": false,
# token_expiry=2024-05-11, apiKey: process.env.KEY_V2 are kept). A password of letters only,
# or one on the next line (YAML), is not found; one holding & or ; loses only what precedes
# it. An Authorization header has its own rule above.
_SECRET_LAST_WORDS = frozenset(
    {"credential", "credentials", "key", "passphrase", "passwd", "password", "secret", "token"}
)
_ASSIGNED = re.compile(
    r"(?:(?<![A-Za-z0-9_.-])|(?<=\s-)|(?<=\s--))(?P<name>(?:[A-Za-z][A-Za-z0-9_.-]{0,63}?)?"
    rf"(?i:{'|'.join(sorted(_SECRET_LAST_WORDS))}))"
    r"(?P<separator>(?:\\?[\"'])?\*{0,2}[ \t]{0,16}(?::=|==|[:=])(?!//)\*{0,2}[ \t]{0,16})"
    r"(?:(?P<quote>\\?[\"'])(?P<quoted>(?:(?!(?P=quote))(?:\\.|[^\\\n])){6,})(?P=quote)"
    r"|(?![A-Za-z][A-Za-z0-9+.-]{0,31}://)(?P<bare>[^\s\"',;&<>(){}\[\]]{8,}+)(?![(\[]))"
)
# A secret given in Chinese: 密码是 Tr0ub4dor&3, 验证码=482913, 访问令牌 abcdefghijklmnop. The
# value is the run of ASCII that follows the word (and 是, 为, a colon, full-width too, or =):
# four characters or more with a digit, or eight or more; a question about one (密码是什么) or
# a word that goes on in Chinese (密码策略) has none.
SECRET_WORDS_ZH = (
    "密码",
    "口令",
    "密钥",
    "私钥",
    "令牌",
    "验证码",
    "校验码",
    "动态码",
    "凭证",
    "凭据",
)
_ASSIGNED_ZH = re.compile(
    rf"((?:{'|'.join(SECRET_WORDS_ZH)})[ \t\u3000]*(?:是|为|[:\uff1a=])?[ \t\u3000]*)"
    r"(?=[!-~]*[0-9]|[!-~]{8})([!-~]{4,})"
)
# Unquoted values that are code or data, not credentials.
_NOT_A_CREDENTIAL = re.compile(
    r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+"  # a dotted name
    r"|\d{4}-\d{2}-\d{2}.*"  # a date
    r"|v?\d+(?:\.\d+)+(?:[-+][A-Za-z0-9.]*)?"  # a version
)
_LETTER = re.compile(r"[A-Za-z]")
_DIGIT = re.compile(r"[0-9]")


def mask_email(text: str) -> str:
    """li.wei@acme.example → l***@acme.example"""
    if "@" not in text and "%40" not in text:
        return text
    return _EMAIL.sub(_masked_email, text)


def _masked_email(match: re.Match) -> str:
    local, at, domain = match.groups()
    first = _EMAIL_FIRST.search(local)
    if first is None:
        return match.group(0)
    return f"{local[: first.end()]}***{at}{domain}"


def _basic_credential(match: re.Match) -> str:
    encoded = match.group(2)
    try:
        decoded = binascii.a2b_base64(
            encoded + "=" * (-len(encoded) % 4), strict_mode=True
        ).decode()
    except (binascii.Error, UnicodeDecodeError):
        return match.group(0)
    if ":" in decoded and decoded.isprintable():
        return match.group(1) + REDACTED
    return match.group(0)


def _assigned_secret(match: re.Match) -> str:
    name, quoted, bare = match.group("name", "quoted", "bare")
    # The pattern found the word at the name's end; it must be a word of its own there, or
    # end a word that names a secret by itself (api_key, apiKey, apikey, PGPASSWORD; not
    # monkey), in a name that holds a secret (not public_key).
    last = name_words(name)[-1]
    if (
        (last in _SECRET_LAST_WORDS or secret_key(last))
        and secret_key(name)
        and (
            quoted is not None
            or (
                _LETTER.search(bare)
                and _DIGIT.search(bare)
                and not _NOT_A_CREDENTIAL.fullmatch(bare)
            )
        )
    ):
        quote = match.group("quote") or ""
        return f"{name}{match.group('separator')}{quote}{REDACTED}{quote}"
    return match.group(0)


# What the patterns, written in ASCII, read as ASCII: a character NFKC makes one ASCII
# character, as the full-width forms of ASCII letters, digits and signs (U+FF01 to U+FF5E) and
# the ideographic space an input method in full-width mode types a password with, or the
# mathematical bold and italic letters; and the letters of other scripts that look like Latin
# ones, which NFKC leaves as they are (those of Unicode's confusables, UTS #39, whose look-alike
# is one ASCII letter or digit): "password=" or an "sk-" prefix written with a Cyrillic er
# (U+0440), a (U+0430) or dze (U+0455). The full-width marks that punctuate Chinese
# (exclamation and question marks, parentheses, comma, colon and semicolon) stay as they are,
# so they still end a value, as in text typed in ASCII. Each is read as one character, so a
# match in the text as read has its place in the text as typed.
_CHINESE_PUNCTUATION = frozenset("\uff01\uff08\uff09\uff0c\uff1a\uff1b\uff1f")
_LOOK_ALIKES = {
    unicodedata.lookup(name): ascii_form
    for ascii_form, names in {
        "3": ("CYRILLIC CAPITAL LETTER ZE",),
        "A": ("CYRILLIC CAPITAL LETTER A", "GREEK CAPITAL LETTER ALPHA"),
        "a": ("CYRILLIC SMALL LETTER A", "GREEK SMALL LETTER ALPHA", "LATIN SMALL LETTER ALPHA"),
        "B": ("CYRILLIC CAPITAL LETTER VE", "GREEK CAPITAL LETTER BETA"),
        "C": ("CYRILLIC CAPITAL LETTER ES", "GREEK CAPITAL LUNATE SIGMA SYMBOL"),
        "c": ("CYRILLIC SMALL LETTER ES", "GREEK LUNATE SIGMA SYMBOL"),
        "d": ("CYRILLIC SMALL LETTER KOMI DE",),
        "E": ("CYRILLIC CAPITAL LETTER IE", "GREEK CAPITAL LETTER EPSILON"),
        "e": ("CYRILLIC SMALL LETTER IE",),
        "g": ("ARMENIAN SMALL LETTER CO", "LATIN SMALL LETTER SCRIPT G"),
        "H": ("CYRILLIC CAPITAL LETTER EN", "GREEK CAPITAL LETTER ETA"),
        "h": ("CYRILLIC SMALL LETTER SHHA", "ARMENIAN SMALL LETTER HO"),
        "I": ("CYRILLIC CAPITAL LETTER BYELORUSSIAN-UKRAINIAN I", "GREEK CAPITAL LETTER IOTA"),
        "i": (
            "CYRILLIC SMALL LETTER BYELORUSSIAN-UKRAINIAN I",
            "GREEK SMALL LETTER IOTA",
            "LATIN SMALL LETTER DOTLESS I",
            "LATIN SMALL LETTER IOTA",
        ),
        "J": ("CYRILLIC CAPITAL LETTER JE", "GREEK CAPITAL LETTER YOT"),
        "j": ("CYRILLIC SMALL LETTER JE", "GREEK LETTER YOT", "LATIN SMALL LETTER DOTLESS J"),
        "K": ("CYRILLIC CAPITAL LETTER KA", "GREEK CAPITAL LETTER KAPPA"),
        "k": ("CYRILLIC SMALL LETTER KA", "GREEK SMALL LETTER KAPPA"),
        "l": (
            "CYRILLIC LETTER PALOCHKA",
            "CYRILLIC SMALL LETTER PALOCHKA",
            "LATIN LETTER DENTAL CLICK",
        ),
        "M": ("CYRILLIC CAPITAL LETTER EM", "GREEK CAPITAL LETTER MU"),
        "N": ("GREEK CAPITAL LETTER NU",),
        "n": ("ARMENIAN SMALL LETTER VO",),
        "O": (
            "CYRILLIC CAPITAL LETTER O",
            "GREEK CAPITAL LETTER OMICRON",
            "ARMENIAN CAPITAL LETTER OH",
        ),
        "o": ("CYRILLIC SMALL LETTER O", "GREEK SMALL LETTER OMICRON", "ARMENIAN SMALL LETTER OH"),
        "P": ("CYRILLIC CAPITAL LETTER ER", "GREEK CAPITAL LETTER RHO"),
        "p": ("CYRILLIC SMALL LETTER ER", "GREEK SMALL LETTER RHO"),
        "Q": ("CYRILLIC CAPITAL LETTER QA",),
        "q": ("CYRILLIC SMALL LETTER QA", "ARMENIAN SMALL LETTER ZA"),
        "S": ("CYRILLIC CAPITAL LETTER DZE",),
        "s": ("CYRILLIC SMALL LETTER DZE",),
        "T": ("CYRILLIC CAPITAL LETTER TE", "GREEK CAPITAL LETTER TAU"),
        "U": ("ARMENIAN CAPITAL LETTER SEH",),
        "u": ("GREEK SMALL LETTER UPSILON", "ARMENIAN SMALL LETTER SEH"),
        "v": ("GREEK SMALL LETTER NU",),
        "W": ("CYRILLIC CAPITAL LETTER WE",),
        "w": ("CYRILLIC SMALL LETTER WE",),
        "X": ("CYRILLIC CAPITAL LETTER HA", "GREEK CAPITAL LETTER CHI"),
        "x": ("CYRILLIC SMALL LETTER HA",),
        "Y": (
            "CYRILLIC CAPITAL LETTER U",
            "CYRILLIC CAPITAL LETTER STRAIGHT U",
            "GREEK CAPITAL LETTER UPSILON",
        ),
        "y": (
            "CYRILLIC SMALL LETTER U",
            "CYRILLIC SMALL LETTER STRAIGHT U",
            "GREEK SMALL LETTER GAMMA",
        ),
        "Z": ("GREEK CAPITAL LETTER ZETA",),
    }.items()
    for name in names
}

# Each pattern, what replaces its matches, and what every match of it needs as the text
# reads lower-cased: most text holds none of these, and `in` finds that out far faster than
# the patterns can (one search for a value given to a name that holds "key" reads the name's
# every start).
_REPLACEMENTS: tuple[tuple[re.Pattern, Any, tuple[str, ...]], ...] = (
    (_PRIVATE_KEY, REDACTED, ("-----begin",)),
    (_BEARER, "Bearer " + REDACTED, ("bearer",)),
    (_AUTHORIZATION, lambda match: match.group(1) + REDACTED, ("authorization",)),
    (_HEX_TOKEN, lambda match: match.group(1) + REDACTED, ("token",)),
    (_BASIC, _basic_credential, ("basic",)),
    *((pattern, REDACTED, needs) for pattern, needs in _SECRET_VALUES),
    (_URL_PASSWORD, lambda match: match.group(1) + REDACTED + "@", ("://",)),
    (_ASSIGNED_ZH, lambda match: match.group(1) + REDACTED, SECRET_WORDS_ZH),
    (_ASSIGNED, _assigned_secret, ("credential", "key", "pass", "secret", "token")),
)


def _any_of(words: Iterable[str]) -> str:
    """A pattern of any of `words`, as a trie: the words that start alike are told apart
    after their common start (`b(?:asic|earer)`), which searching a text that holds none of
    them (most text) tries once, not once per word."""
    tree: dict[str, dict] = {}
    for word in words:
        node = tree
        for char in word:
            node = node.setdefault(char, {})
        node[""] = {}

    def branches(node: dict[str, dict]) -> str:
        each = [re.escape(char) + branches(child) for char, child in sorted(node.items()) if char]
        if not each:
            return ""
        either = each[0] if len(each) == 1 else f"(?:{'|'.join(each)})"
        return f"(?:{either})?" if "" in node else either

    return branches(tree)


# Whether a text meets any of those needs: one search, for the text that meets none.
_ANY_NEED = re.compile(_any_of(need for *_, needs in _REPLACEMENTS for need in needs))
# The dotted capital I, which a case-insensitive pattern reads as an i but `str.lower` makes
# an i and a combining dot (`as_read` reads the dotless i and the long s as i and s).
_FOLDED_AS_ASCII = str.maketrans({"\u0130": "i"})


def _possible_replacements(lowered: str) -> list[tuple[re.Pattern, Any]]:
    """The replacements whose needs `lowered` (a text as read, lower-cased) meets, in their
    order."""
    return [
        (pattern, replacement)
        for pattern, replacement, needs in _REPLACEMENTS
        if any(need in lowered for need in needs)
    ]


def _common_head(first: str, second: str) -> int:
    """How many characters `first` and `second` start with alike."""
    for index, (one, other) in enumerate(zip(first, second, strict=False)):
        if one != other:
            return index
    return min(len(first), len(second))


@functools.lru_cache(maxsize=4096)
def _char_as_read(char: str) -> str | None:
    """A character beyond ASCII as the patterns read it (`_LOOK_ALIKES`); None for one that
    shows nothing (a format character)."""
    if unicodedata.category(char) == "Cf":
        return None
    if char in _CHINESE_PUNCTUATION:
        return char
    if char in _LOOK_ALIKES:
        return _LOOK_ALIKES[char]
    folded = unicodedata.normalize("NFKC", char)
    return folded if len(folded) == 1 and folded.isascii() else char


def as_read(text: str) -> str:
    """`text` as the patterns read it: what looks like ASCII or NFKC makes ASCII as ASCII
    (`_LOOK_ALIKES`), and without the characters that show nothing (format characters:
    zero-width spaces and joiners, a soft hyphen, bidirectional marks), which a page that
    breaks long words puts inside a token and which would hide it."""
    if text.isascii():
        return text
    return text.translate({ord(char): _char_as_read(char) for char in set(text) if ord(char) > 127})


def _replaced_as_typed(pattern: re.Pattern, replacement: Any, text: str, read: str) -> str:
    """`text` with the matches `pattern` finds in `read` (`text` as the patterns read it)
    replaced, and the rest as it was typed: of a match, what its replacement keeps at its
    start and end (a name, a colon) too."""
    if len(read) == len(text):
        positions: range | list[int] = range(len(text))
    else:
        positions = [index for index, char in enumerate(text) if unicodedata.category(char) != "Cf"]
    parts, at = [], 0
    for match in pattern.finditer(read):
        start, end = match.span()
        found = match.group(0)
        replaced = replacement(match) if callable(replacement) else replacement
        head = _common_head(found, replaced)
        tail = _common_head(found[head:][::-1], replaced[head:][::-1])
        typed_start, typed_end = positions[start], positions[end - 1] + 1
        kept_head = positions[start + head - 1] + 1 if head else typed_start
        kept_tail = positions[end - tail] if tail else typed_end
        parts += [
            text[at:typed_start],
            text[typed_start:kept_head],
            replaced[head : len(replaced) - tail],
            text[kept_tail:typed_end],
        ]
        at = typed_end
    return "".join([*parts, text[at:]])


def secrets_removed(text: str) -> str:
    """`text` with credentials replaced: bearer tokens, pasted Authorization headers, hex
    tokens, Basic credentials, values that look like API keys or JWTs, private keys, the
    passwords of URLs, and values given to names that say they hold secrets (in Chinese too),
    typed in ASCII or in its full-width forms, with invisible characters inside or without."""
    read = as_read(text)
    lowered = (read if read.isascii() else read.translate(_FOLDED_AS_ASCII)).lower()
    if not _ANY_NEED.search(lowered):
        return text
    possible = _possible_replacements(lowered)
    if not any(pattern.search(read) for pattern, _ in possible):
        return text
    for pattern, replacement in possible:
        if read == text:
            text = read = pattern.sub(replacement, text)
        else:
            text = _replaced_as_typed(pattern, replacement, text, read)
            read = as_read(text)
    return text


def _percent_hex(byte: int) -> str:
    return "%" + "".join(f"[{d}{d.lower()}]" if d.isalpha() else d for d in f"{byte:02X}")


@functools.lru_cache(maxsize=64)
def _percent_encoded(secret: str) -> re.Pattern:
    """The secret as a URL or a form carries it: any of its characters percent-encoded (hex
    in either case), a space as +. A service echoes a credential in a link as readily as
    verbatim."""
    characters = []
    for character in secret:
        forms = [re.escape(character), "".join(map(_percent_hex, character.encode()))]
        if character == " ":
            forms.append(r"\+")
        characters.append(f"(?:{'|'.join(forms)})")
    return re.compile("".join(characters))


_BASE64_ALPHABET = string.ascii_uppercase + string.ascii_lowercase + string.digits + "+/"
# The base64 characters the standard and the URL-safe alphabets write differently, as each
# does and percent-encoded, as a link carries them.
_BASE64_WRITTEN = {"+": ("+", "-", "%2B", "%2b"), "/": ("/", "_", "%2F", "%2f")}
_BASE64_PADDING = r"(?:=|%3[Dd]){0,2}"
# The fewest characters a secret's base64 form is sought by (42 bits): fewer, as a short
# secret's are, turn up by chance in other base64 text (a picture's) and in words.
_BASE64_MIN_CHARS = 7


def _base64_character(sextets: Iterable[int]) -> str:
    """A pattern of one base64 character of any of `sextets`, however it is written."""
    plain, written = [], []
    for character in (_BASE64_ALPHABET[sextet] for sextet in sextets):
        plain += [character] if character not in _BASE64_WRITTEN else []
        written += _BASE64_WRITTEN.get(character, ())
    if not written and len(plain) == 1:
        return plain[0]
    forms = [f"[{''.join(plain)}]"] if plain else []
    return f"(?:{'|'.join([*forms, *map(re.escape, written)])})"


def _base64_at(data: bytes, offset: int) -> tuple[str, str] | None:
    """A pattern of `data` base64-encoded `offset` bytes (0 to 2) into what is encoded, and
    its longest part written alike in every alphabet (what text holding it must hold). The
    pattern is of the characters of `data`'s bits alone, and, should they be there, of the
    character before them and the one after them (with padding, where `data` ends what is
    encoded), which also hold bits of what is around it. None if too few characters are of
    `data`'s bits alone."""
    start, end = 8 * offset, 8 * (offset + len(data))
    encoded = base64.b64encode(bytes(offset) + data + bytes(2)).decode()
    sextets = [_BASE64_ALPHABET.index(character) for character in encoded.rstrip("=")]
    first, last = -(-start // 6), end // 6
    if last - first < _BASE64_MIN_CHARS:
        return None
    pattern = "".join(_base64_character([sextet]) for sextet in sextets[first:last])
    if start % 6:
        known = (1 << (6 - start % 6)) - 1
        before = [other for other in range(64) if other & known == sextets[first - 1] & known]
        pattern = f"{_base64_character(before)}?{pattern}"
    if end % 6:
        known = 0o77 ^ ((1 << (6 - end % 6)) - 1)
        after = [other for other in range(64) if other & known == sextets[last] & known]
        pattern = f"{pattern}(?:{_base64_character(after)}{_BASE64_PADDING})?"
    alike = max(re.split(r"[+/]", encoded[first:last]), key=len)
    return pattern, alike


@functools.lru_cache(maxsize=64)
def _base64_encoded(secret: str) -> tuple[re.Pattern, tuple[str, ...]] | None:
    """The secret base64-encoded, standard or URL-safe, padded or not, alone or inside more
    (as Basic authentication encodes "user:secret"): at each of the three places its first
    byte may fall in a group of three, whose characters differ; and what text must hold for
    the pattern to be worth running. None for a secret too short to be told from chance
    (`_BASE64_MIN_CHARS`)."""
    forms = [form for offset in range(3) if (form := _base64_at(secret.encode(), offset))]
    if not forms:
        return None
    patterns, alike = zip(*forms, strict=True)
    return re.compile("|".join(patterns)), alike


def known_secrets_replaced(text: str, secrets: tuple[str, ...]) -> str:
    """`text` with each of `secrets` (credentials the host gave a service, which it may
    echo) replaced, verbatim, percent-encoded (`_percent_encoded`) or base64-encoded
    (`_base64_encoded`). Each form is a pattern made once per secret, run only on text that
    holds a part of it: nothing in `text` is decoded."""
    for secret in filter(None, secrets):
        text = text.replace(secret, REDACTED)
        if "%" in text:
            text = _percent_encoded(secret).sub(REDACTED, text)
        encoded = _base64_encoded(secret)
        if encoded is not None and any(part in text for part in encoded[1]):
            text = encoded[0].sub(REDACTED, text)
    return text


def secrets_removed_within(value: Any) -> Any:
    """A JSON value with `secrets_removed` applied to each of its strings, its objects' keys
    included."""
    return jsontext.strings_mapped(value, secrets_removed)


def holds_secret(value: Any) -> bool:
    """Whether a string of a JSON value, its objects' keys included, holds what
    `secrets_removed` would replace."""
    return isinstance(value, str | dict | list) and secrets_removed_within(value) != value


# The shortest text of a sensitive field masked inside other text: a shorter one ("Li", "42")
# is part of too many other words.
HIDDEN_TEXT_MIN_CHARS = 3


def sensitive_texts(value: Any) -> set[str]:
    """The texts a sensitive field's value holds, as they are masked inside other text: its
    strings and numbers (not booleans), in lists and objects too, each without the whitespace
    around it, of HIDDEN_TEXT_MIN_CHARS characters or more."""
    if isinstance(value, dict):
        return set().union(*map(sensitive_texts, value.values()))
    if isinstance(value, list | tuple):
        return set().union(*map(sensitive_texts, value))
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        return set()
    text = str(value).strip()
    return {text} if len(text) >= HIDDEN_TEXT_MIN_CHARS else set()


# Where text holds a character escaped rather than as itself: JSON's escapes (\u00eb, \",
# \/; escaped once or more, as JSON text inside JSON text is) and HTML's character references
# (&euml;, &#235;, &#xeb;).
_JSON_BACKSLASHED = frozenset('"/\\')
# Whitespace between the words of a text, as itself or escaped so.
_SPACE = (
    r"(?:\s|\\+[nrt]|\\+u(?:0020|00a0|2002|2009|202f|3000)"
    r"|&(?:nbsp|ensp|thinsp|#0*(?:32|160)|#x0*(?:20|a0));)+"
)
# Where a word starts: after no letter, digit or _, or after an escaped whitespace; and where
# it ends: before none, nor before a combining mark (an accent written apart from its letter).
_WORD_START = r"(?:(?<!\w)|(?<=\\[nrt])|(?<=\\u(?:0020|00a0|2002|2009|202f|3000)))"
_WORD_END = r"(?![\w\u0300-\u036f])"


@functools.cache
def _html_names() -> dict[str, tuple[str, ...]]:
    """By character: the names HTML5 gives it (euml; and euml for ë)."""
    names: dict[str, list[str]] = {}
    for name, char in html.entities.html5.items():
        if len(char) == 1:
            names.setdefault(char, []).append(name)
    return {char: tuple(found) for char, found in names.items()}


@functools.cache
def _char_pattern(char: str) -> str:
    """`char` as text may hold it: an ASCII letter or digit as itself only; any other also
    JSON-escaped and as an HTML character reference, in either case, and a composed letter
    (ë) as its canonical decomposition too (e and a combining diaeresis), each part in any of
    these forms."""
    if char.isascii() and char.isalnum():
        return re.escape(char)
    forms = {re.escape(char)}
    for variant in {char, char.lower(), char.upper()}:
        if len(variant) != 1:
            continue
        code = ord(variant)
        if code > 0xFFFF:
            high, low = divmod(code - 0x10000, 0x400)
            forms.add(rf"\\+u{0xD800 + high:04x}\\+u{0xDC00 + low:04x}")
        else:
            forms.add(rf"\\+u{code:04x}")
        forms |= {rf"&#0*{code};", rf"&#x0*{code:x};"}
        forms |= {re.escape(f"&{name}") for name in _html_names().get(variant, ())}
    if char in _JSON_BACKSLASHED:
        forms.add(r"\\+" + re.escape(char))
    decomposed = unicodedata.normalize("NFD", char)
    if decomposed != char:
        forms.add("".join(map(_char_pattern, decomposed)))
    return f"(?:{'|'.join(sorted(forms, key=lambda form: (-len(form), form)))})"


@functools.lru_cache(maxsize=256)
def _texts_pattern(texts: frozenset[str]) -> re.Pattern | None:
    """Any of `texts` as a whole word (no letter, digit or _ on either side), in any case and
    with any run of whitespace between its words; the longest first, so that where both
    "Li Wei" and "Li Wei Chen" are sensitive the longer is masked whole. A text is found in
    either Unicode normal form (NFC, NFD) and however its characters beyond ASCII letters
    and digits are written in JSON or HTML text (`_char_pattern`): "Zoë" in a draft the model
    wrote as JSON with "Zo\\u00eb", or as HTML with "Zo&euml;"."""
    ordered = sorted(
        {unicodedata.normalize("NFC", text.strip()) for text in texts if text.strip()},
        key=lambda text: (-len(text), text),
    )
    alternatives = [
        _SPACE.join("".join(map(_char_pattern, word)) for word in text.split()) for text in ordered
    ]
    if not alternatives:
        return None
    # The characters a match can start with, looked for first: most places in text start none.
    starts = {
        form for text in ordered for form in (text[0], unicodedata.normalize("NFD", text[0])[0])
    }
    if not all(char.isascii() and char.isalnum() for char in starts):
        starts |= {"\\", "&"}
    return re.compile(
        rf"(?=[{''.join(map(re.escape, sorted(starts)))}]){_WORD_START}"
        rf"(?:{'|'.join(alternatives)}){_WORD_END}",
        re.IGNORECASE,
    )


def texts_masked(text: str, texts: frozenset[str]) -> str:
    """`text` with each of `texts` (from `sensitive_texts`) replaced where it is a whole word."""
    pattern = _texts_pattern(texts) if texts else None
    return text if pattern is None else pattern.sub(REDACTED, text)


def _text(value: str, *, cleared: bool, texts: frozenset[str] = frozenset()) -> str:
    value = secrets_removed(value)
    return value if cleared else mask_email(texts_masked(value, texts))


def names_secret(key: str) -> bool:
    """Whether a key names a secret (`config.secret_names.secret_key`), read as the patterns
    read text (`as_read`): a "password" written with a Cyrillic er and a names one too."""
    return secret_key(as_read(key))


@cached_by_name
def key_shown(key: str, cleared: bool) -> tuple[str, bool]:
    """A key as shown (`cleared`: with secrets removed only), and whether it names a secret."""
    return _text(key, cleared=cleared), names_secret(key)


def redact(
    value: Any,
    *,
    cleared: bool = False,
    sensitive: frozenset[str] = frozenset(),
    texts: frozenset[str] = frozenset(),
) -> Any:
    """`value` with secrets removed everywhere (keys too) and, unless `cleared`, emails masked,
    the `sensitive` keys replaced and, inside every string value (not keys), each of `texts`
    (`texts_masked`: what the run's tools returned under those keys) replaced by the same
    marker."""
    if isinstance(value, str):
        return _text(value, cleared=cleared, texts=texts)
    if isinstance(value, dict):
        redacted = {}
        for key, item in value.items():
            if isinstance(key, str):
                name, hidden = key_shown(key, cleared)
            else:
                name, hidden = key, secret_key(str(key))
            hidden = hidden or (not cleared and key in sensitive)
            redacted[name] = (
                REDACTED
                if hidden
                else redact(item, cleared=cleared, sensitive=sensitive, texts=texts)
            )
        return redacted
    if isinstance(value, list | tuple):
        return [redact(item, cleared=cleared, sensitive=sensitive, texts=texts) for item in value]
    return value
