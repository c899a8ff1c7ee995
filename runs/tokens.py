"""Token counting without downloads: a local estimate behind one function, so a deployment can
swap in an exact tokenizer. About four characters a token for Latin text, one for CJK."""

import math


def estimate_tokens(text: str) -> int:
    if not text:
        return 0
    wide = sum(1 for character in text if ord(character) >= 0x2E80)
    return wide + math.ceil((len(text) - wide) / 4)
