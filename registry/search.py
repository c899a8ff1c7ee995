"""Search terms of skills and requests, for retrieval-based skill assembly.

Text becomes a list of terms the same way for a skill and for a request: Latin words and
numbers lower-cased, Chinese segmented into words by jieba's dictionary in its search mode
(so "负责人" also yields "负责"; characters it leaves single are paired), function words of
either language dropped. PostgreSQL then stems the English terms with its `english`
configuration; the fallback of the embedded SQLite default matches the terms as they are.
"""

import itertools
import logging
import re
import threading
from collections.abc import Iterable
from typing import Any

import jieba

CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]+")
WORD = re.compile(r"[^\W_]+")
# Filler of requests that says nothing about the task.
CJK_STOP_WORDS = frozenset(
    {
        "一下",
        "一个",
        "一些",
        "这个",
        "那个",
        "我们",
        "你们",
        "他们",
        "可以",
        "能否",
        "是否",
        "麻烦",
        "帮忙",
        "需要",
        "什么",
        "怎么",
        "如何",
        "现在",
        "然后",
        "还有",
        "以及",
        "或者",
        "关于",
    }
)
# Characters that make no word of a task on their own (pronouns, particles, "please", "help").
CJK_STOP_CHARACTERS = frozenset(
    "我你他她它们的地得了着过吗呢吧啊呀和与及给把被在是有这那个么就都也还到哪怎帮请想要让"
)
# PostgreSQL's English stop words (and a request's usual politeness), dropped on both backends
# so that a request's length in filler does not change its score.
ENGLISH_STOP_WORDS = frozenset(
    """a about above after again against all am an and any are as at be because been before
    being below between both but by can could did do does doing down during each few for from
    further had has have having he her here hers herself him himself his how i if in into is
    it its itself just me more most my myself no nor not now of off on once only or other our
    ours ourselves out over own please same she should so some such than thank thanks that the
    their theirs them themselves then there these they this those through to too under until
    up very was we were what when where which while who whom why will with would you your
    yours yourself yourselves s t d ll m re ve""".split()  # noqa: SIM905 (a word list)
)
MAX_TERMS = 64

_segmenter_ready = threading.Lock()
_segmenter_loaded = False


def _segments(text: str) -> list[str]:
    """jieba loads its dictionary on first use (about a second), once per process."""
    global _segmenter_loaded
    if not _segmenter_loaded:
        with _segmenter_ready:
            if not _segmenter_loaded:
                jieba.setLogLevel(logging.WARNING)
                jieba.initialize()
                _segmenter_loaded = True
    return list(jieba.cut_for_search(text))


def _words(segments: list[str]) -> list[str]:
    """The words among jieba's segments. A word missing from its dictionary (年假) comes out
    as single characters: consecutive ones are joined in pairs; a lone one is dropped."""
    words, singles = [], []
    for segment in [*segments, ""]:
        if len(segment) == 1:
            if segment not in CJK_STOP_CHARACTERS:
                singles.append(segment)
            continue
        words += ["".join(pair) for pair in itertools.pairwise(singles)]
        singles = []
        if segment:
            words.append(segment)
    return words


def search_terms(text: str) -> list[str]:
    """The distinct terms of `text` in order of appearance, at most MAX_TERMS."""
    terms: dict[str, None] = {}
    for word in WORD.findall(text.lower()):
        if word in ENGLISH_STOP_WORDS:
            continue
        pieces = [word]
        if CJK.search(word):
            pieces = [
                segment
                for run in CJK.findall(word)
                for segment in _words(_segments(run))
                if segment not in CJK_STOP_WORDS
            ]
            pieces += [latin for latin in CJK.split(word) if latin]
        for piece in pieces:
            terms.setdefault(piece, None)
    return list(terms)[:MAX_TERMS]


def search_document(parts: Iterable[str]) -> str:
    """What a skill is searched by, as space-separated terms."""
    return " ".join(search_terms(" ".join(parts)))


def example_texts(examples: Any) -> list[str]:
    """What a user said in a skill's examples: plain strings, or an example's request text."""
    texts = []
    for example in examples if isinstance(examples, list) else []:
        if isinstance(example, str):
            texts.append(example)
        elif isinstance(example, dict):
            texts += [
                value
                for key in ("input", "request", "message", "user")
                if isinstance(value := example.get(key), str)
            ]
    return texts


def skill_search_fields(
    *, name: str, triggers: list[str], description: str, examples: Any
) -> dict[str, str]:
    """A skill version's search terms, by the weight they are ranked with."""
    return {
        "search_triggers": search_document([name.replace("-", " "), *triggers]),
        "search_description": search_document([description]),
        "search_examples": search_document(example_texts(examples)),
    }
