"""What the parts of a message read when its run starts (attachments, MCP resources) may show
the model.

The user's message is never cut by the context builder: it holds the message's text and, for
each part read, its excerpt wrapped as untrusted data. The message may take
`message_max_tokens()`; what its text leaves is shared evenly by the parts read, and an excerpt
past its share is cut to the longest start that fits, with a note saying how much is shown.
"""

import codecs
from collections.abc import Callable
from typing import Any

from config import jsontext
from config.errors import ValidationFailed
from runs.context import message_max_tokens
from runs.tokens import estimate_tokens

# As long as any `fetched_at` an envelope shows: an excerpt is measured before its Source is.
LONGEST_TIMESTAMP = "0000-00-00T00:00:00.000000+00:00"
NO_ROOM = "the message's text leaves it no room in the model's context"


def repeats_refused(
    parts: list[dict[str, Any]],
    *,
    part_type: str,
    key: Callable[[dict[str, Any]], Any],
    named: tuple[str, ...],
    noun: str,
) -> None:
    """Refuse a message that refers to one thing (an attachment, a server's resource: the
    parts of `part_type` of one `key`) in more than one part, naming each repeated part (by
    its `named` fields) and the part that refers to it first: each reference would read it
    in a share of its own, the model shown cut copies of one excerpt."""
    first_index: dict[Any, int] = {}
    repeated = []
    for index, part in enumerate(parts):
        if part["type"] != part_type:
            continue
        first = first_index.setdefault(key(part), index)
        if first != index:
            repeated.append(
                {
                    "index": index,
                    **{field: part[field] for field in named},
                    "message": f"Part {first} refers to it already.",
                }
            )
    if repeated:
        raise ValidationFailed(
            f"A message refers to each {noun} once.", details={"parts": repeated}
        )


def tokens_each(parts: list[dict[str, Any]], *, read: int) -> int:
    """The tokens each of the `read` parts read at the start may take in the user's message:
    an even share of what the message's text leaves of `message_max_tokens()`."""
    if not read:
        return 0
    text = sum(estimate_tokens(part["text"]) for part in parts if part["type"] == "text")
    return (message_max_tokens() - text) // read


def head(data: bytes, limit: int) -> tuple[str, bool]:
    """The text of `data`'s first `limit` bytes, never ending inside a character, and whether
    anything was left out."""
    if len(data) <= limit:
        return data.decode("utf-8", errors="replace"), False
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    return decoder.decode(data[:limit], final=False), True


def cut_note(kept: str, size: int, *, at_least: bool = False) -> str:
    """`kept` with the note saying how many of its text's `size` bytes it shows (of `at_least`
    that many when how long the whole text is was not found out)."""
    of = f"at least {size}" if at_least else str(size)
    return f"{kept}\n[cut: the first {len(kept.encode())} bytes of {of} are shown]"


def within(tokens: int, shown: Callable[[str], str]) -> Callable[[str], bool]:
    """Whether an excerpt, as `shown` in the user's message, takes at most `tokens` (counted
    as the context builder counts it, in JSON)."""
    return lambda content: estimate_tokens(jsontext.dumps(shown(content))) <= tokens


def _longest_start(text: str, fits: Callable[[str], bool]) -> str:
    """The longest start of `text` that `fits`, which holds for every shorter start too."""
    low, high = 0, len(text)
    while low < high:
        middle = (low + high + 1) // 2
        if fits(text[:middle]):
            low = middle
        else:
            high = middle - 1
    return text[:low]


def fitted(
    text: str,
    *,
    cut: bool,
    size: int,
    fits: Callable[[str], bool],
    at_least: bool = False,
) -> str | None:
    """`text` whole if it is all there is (not `cut` before) and `fits`; else its longest
    start that fits with the note saying how much of `size` bytes of text (`at_least`) it
    shows; None when not even a start fits."""
    if not cut and fits(text):
        return text
    kept = _longest_start(text, lambda start: fits(cut_note(start, size, at_least=at_least)))
    return cut_note(kept, size, at_least=at_least) if kept.strip() else None
