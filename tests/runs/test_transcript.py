"""A model's call keeps its provider's id unless that id could name another call of the run."""

import re

import pytest

from runs.model_clients.base import ToolCall
from runs.transcript import assistant_entry, calls_with_own_ids

EARLIER = [assistant_entry("", (ToolCall(call_id="call_1", name="project_search", arguments={}),))]


def _ids(*call_ids, transcript=EARLIER) -> list[str]:
    calls = tuple(
        ToolCall(call_id=call_id, name="project_search", arguments={}) for call_id in call_ids
    )
    return [call.call_id for call in calls_with_own_ids(calls, transcript=transcript)]


@pytest.mark.parametrize(
    ("given", "own"),
    [
        (("toolu_01A09q90qw90lq917835lq9", "call_x"), ["toolu_01A09q90qw90lq917835lq9", "call_x"]),
        (("call_1",), ["call00002"]),
        (("call_2", "call_2"), ["call_2", "call00003"]),
        (("host-recipient",), ["call00002"]),
        (("",), ["call00002"]),
        ((None,), ["call00002"]),
        (("x" * 65,), ["call00002"]),
        (("mail_send:abc",), ["call00002"]),
        (("call00003", "call_1"), ["call00003", "call00004"]),
    ],
)
def test_a_call_keeps_its_providers_id_unless_it_could_name_another_call(given, own):
    assert _ids(*given) == own


def test_a_call_that_keeps_its_id_is_the_call_the_model_made():
    call = ToolCall(call_id="call_9", name="project_search", arguments={"project_id": "apollo"})

    (own,) = calls_with_own_ids((call,), transcript=EARLIER)

    assert own is call


def test_the_ids_the_host_gives_fit_the_strictest_provider_and_name_one_call_each():
    """Sent back through an OpenAI-compatible gateway, a call id must be what every provider
    takes; Mistral's rule is the strictest: exactly nine letters and digits."""
    earlier = [assistant_entry("", (ToolCall(call_id="", name="project_search", arguments={}),))]
    earlier[0]["tool_calls"][0]["call_id"] = "call00002"

    own = _ids(*[""] * 12, transcript=earlier)

    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", call_id) for call_id in own)
    assert len(set(own)) == 12
    assert "call00002" not in own
