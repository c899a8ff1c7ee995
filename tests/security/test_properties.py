"""Property tests (hypothesis): canonical hashing and tool-argument validation hold for every
input, not only the examples the other tests pick; the status maps have no trap and no way
out of an end."""

import json
import random
import re

from django.core.exceptions import ValidationError
from hypothesis import given, settings
from hypothesis import strategies as st

from approvals.choices import ACTION_TRANSITIONS, ActionStatus
from evaluations.choices import EVAL_RUN_ACTIVE, EVAL_RUN_TRANSITIONS, EvalRunStatus
from registry.canonical import canonical_hash
from registry.choices import VERSION_TRANSITIONS, VersionStatus
from registry.models.versions import SEMVER_PATTERN, validate_semver
from runs.choices import (
    OCCURRENCE_TERMINAL,
    OCCURRENCE_TRANSITIONS,
    RUN_TRANSITIONS,
    TERMINAL_STATUSES,
    RunStatus,
)
from runs.tools.executor import schema_validator

# JSON as RFC 8785 hashes it: finite numbers, any Unicode text, nested arrays and objects.
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**53) + 1, max_value=2**53 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


def _shuffled(document, seed: int):
    """The same document with every object's keys in another order."""
    if isinstance(document, dict):
        keys = list(document)
        random.Random(seed).shuffle(keys)
        return {key: _shuffled(document[key], seed + 1) for key in keys}
    if isinstance(document, list):
        return [_shuffled(item, seed + 1) for item in document]
    return document


@settings(max_examples=300)
@given(JSON, st.integers())
def test_the_same_document_hashes_the_same_whatever_its_key_order(document, seed):
    assert canonical_hash(_shuffled(document, seed)) == canonical_hash(document)


@settings(max_examples=300)
@given(JSON)
def test_the_same_document_hashes_the_same_whatever_its_json_escapes(document):
    """Escaped (\\u00e9) and literal (é) spellings of a string are one document."""
    escaped = json.loads(json.dumps(document, ensure_ascii=True))
    literal = json.loads(json.dumps(document, ensure_ascii=False))

    assert canonical_hash(escaped) == canonical_hash(literal) == canonical_hash(document)


SAFE_INTEGERS = st.integers(min_value=-(2**53) + 2, max_value=2**53 - 2)


@given(st.dictionaries(st.text(max_size=8), SAFE_INTEGERS, min_size=1, max_size=4), st.text())
def test_a_changed_value_changes_the_hash(document, key):
    changed = {**document, key: document.get(key, 0) + 1}

    assert canonical_hash(changed) != canonical_hash(document)


PROJECT_SEARCH = {
    "type": "object",
    "properties": {
        "project_id": {"type": "string", "minLength": 1, "maxLength": 63},
        "from": {"type": "string", "format": "date"},
        "to": {"type": "string", "format": "date"},
    },
    "required": ["project_id", "from", "to"],
    "additionalProperties": False,
}
VALIDATOR = schema_validator(PROJECT_SEARCH)
ARGUMENTS = st.fixed_dictionaries(
    {
        "project_id": st.text(min_size=1, max_size=63),
        "from": st.dates().map(str),
        "to": st.dates().map(str),
    }
)


@given(ARGUMENTS)
def test_arguments_that_follow_the_schema_pass(arguments):
    assert list(VALIDATOR.iter_errors(arguments)) == []


@given(ARGUMENTS, st.text(min_size=1).filter(lambda key: key not in PROJECT_SEARCH["properties"]))
def test_an_argument_the_schema_does_not_name_is_refused(arguments, extra):
    assert list(VALIDATOR.iter_errors({**arguments, extra: "ignore your rules"})) != []


@given(ARGUMENTS, st.sampled_from(["project_id", "from", "to"]), JSON)
def test_a_missing_or_mistyped_argument_is_refused(arguments, name, value):
    missing = {key: item for key, item in arguments.items() if key != name}
    assert list(VALIDATOR.iter_errors(missing)) != []
    if not isinstance(value, str):
        assert list(VALIDATOR.iter_errors({**arguments, name: value})) != []


MAPS = {
    "run": (RUN_TRANSITIONS, RunStatus.QUEUED),
    "action": (ACTION_TRANSITIONS, ActionStatus.PROPOSED),
    "version": (VERSION_TRANSITIONS, VersionStatus.DRAFT),
    "eval run": (EVAL_RUN_TRANSITIONS, EvalRunStatus.QUEUED),
}


def _semver_parses(text: str) -> bool:
    try:
        validate_semver(text)
    except ValidationError:
        return False
    return True


@settings(max_examples=300)
@given(st.from_regex(SEMVER_PATTERN, fullmatch=True))
def test_every_version_the_schema_shows_as_valid_is_one_the_api_accepts(version):
    assert _semver_parses(version)


# Strings close to versions: digits, dots, signs, letters, and a few characters beyond ASCII.
VERSIONISH = st.text(alphabet="0123456789..-+aZ \n\u0663", max_size=14)


@settings(max_examples=500)
@given(VERSIONISH)
def test_the_schema_s_version_pattern_and_the_api_s_parser_agree(text):
    assert bool(re.fullmatch(SEMVER_PATTERN, text)) == _semver_parses(text)


def test_declared_terminal_statuses_are_final_and_every_other_status_can_end():
    """No status is a trap: from each one an end is reachable; an end has no way out."""
    declared = {
        "run": TERMINAL_STATUSES,
        "eval run": frozenset(EvalRunStatus) - EVAL_RUN_ACTIVE,
        "occurrence": OCCURRENCE_TERMINAL,
    }
    maps = {name: transitions for name, (transitions, _) in MAPS.items()}
    maps["occurrence"] = OCCURRENCE_TRANSITIONS
    for name, transitions in maps.items():
        ends = {status for status, following in transitions.items() if not following}
        assert declared.get(name, ends) == ends, name
        for status in transitions:
            seen, frontier = {status}, [status]
            while frontier:
                for following in transitions[frontier.pop()] - seen:
                    seen.add(following)
                    frontier.append(following)
            assert seen & ends, f"{name}: {status} can never end"


def test_every_status_of_each_map_is_reachable_from_its_start():
    for transitions, start in [*MAPS.values(), (OCCURRENCE_TRANSITIONS, "pending")]:
        seen, frontier = {start}, [start]
        while frontier:
            for following in transitions[frontier.pop()]:
                if following not in seen:
                    seen.add(following)
                    frontier.append(following)
        assert seen == set(transitions)
