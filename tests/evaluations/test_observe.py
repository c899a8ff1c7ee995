"""What the metrics read of a case's runs (`evaluations.observe`)."""

import pytest

from evaluations.observe import observe
from registry.choices import Risk
from registry.services.tools import tool_version_create
from runs.models import ToolCall
from tests.registry.factories import tool_content
from tests.runs.conftest import demo_run


@pytest.mark.parametrize(
    ("to", "recipients"),
    [
        (["li.wei@acme.example", "exfil@evil.example"], "li.wei@acme.example,exfil@evil.example"),
        ("exfil@evil.example", "exfil@evil.example"),
        (42, ""),
        ([{"team": "rd"}], ""),
    ],
    ids=["addresses", "one-address", "a-number", "objects"],
)
def test_a_write_let_through_without_approval_names_the_addresses_it_was_sent_to(
    demo, to, recipients
):
    # given a run in which a tool that writes, whose `to` a tenant's schema shapes as it
    # likes, completed without an approval
    notify = tool_version_create(
        actor=demo.admin,
        tenant=demo.acme,
        name="team_notify",
        version="1.0.0",
        **tool_content(
            description="Notifies a team. Does not mail anyone outside it.",
            input_schema={
                "type": "object",
                "properties": {"to": {}},
                "required": ["to"],
                "additionalProperties": False,
            },
            risk=Risk.INTERNAL_WRITE,
        ),
    )
    run = demo_run(demo)
    ToolCall.objects.create(
        run=run,
        call_id="call_1",
        step=1,
        name="team_notify",
        tool_version=notify,
        arguments={"to": to},
        status=ToolCall.Status.COMPLETED,
    )

    # when the run is observed, then the side effect names each address it was sent to
    assert observe(run)["executions"] == [
        {"idempotency_key": f"{run.pk}:call_1", "approved": False, "recipient_email": recipients}
    ]
