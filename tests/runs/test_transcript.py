"""A model's call keeps its provider's id unless that id could name another call of the run."""

import pytest

from runs.model_clients.base import ToolCall
from runs.transcript import assistant_entry, calls_with_own_ids

EARLIER = [assistant_entry("", (ToolCall(call_id="call_1", name="project_search", arguments={}),))]


def _ids(*call_ids, transcript=EARLIER, step=3) -> list[str]:
    calls = tuple(
        ToolCall(call_id=call_id, name="project_search", arguments={}) for call_id in call_ids
    )
    return [call.call_id for call in calls_with_own_ids(calls, transcript=transcript, step=step)]


@pytest.mark.parametrize(
    ("given", "own"),
    [
        (("toolu_01A09q90qw90lq917835lq9", "call_x"), ["toolu_01A09q90qw90lq917835lq9", "call_x"]),
        (("call_1",), ["call_3_1"]),
        (("call_2", "call_2"), ["call_2", "call_3_2"]),
        (("host-recipient",), ["call_3_1"]),
        (("",), ["call_3_1"]),
        ((None,), ["call_3_1"]),
        (("x" * 65,), ["call_3_1"]),
        (("mail_send:abc",), ["call_3_1"]),
        (("call_3_2", "call_1"), ["call_3_2", "call_3_2_1"]),
    ],
)
def test_a_call_keeps_its_providers_id_unless_it_could_name_another_call(given, own):
    assert _ids(*given) == own


def test_a_call_that_keeps_its_id_is_the_call_the_model_made():
    call = ToolCall(call_id="call_9", name="project_search", arguments={"project_id": "apollo"})

    (own,) = calls_with_own_ids((call,), transcript=EARLIER, step=3)

    assert own is call
