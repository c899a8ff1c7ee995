"""Tracked models keep their change history through a manager class built once."""

import pytest

from config.history import creation_record
from registry.models import AgentConfig, Tenant


def test_a_tracked_model_keeps_its_history_through_one_manager_class(acme):
    acme.name = "Acme Corporation"
    acme.save()

    first, second = acme.history, Tenant.history

    assert type(first) is type(second)
    assert [record.name for record in acme.history.order_by("history_date")] == [
        "Acme",
        "Acme Corporation",
    ]
    assert acme.history.most_recent().name == "Acme Corporation"


def test_a_record_with_many_to_many_history_is_left_to_save(acme):
    with pytest.raises(TypeError):
        creation_record(AgentConfig(tenant=acme, name="unsaved"))
