"""Tracked models keep their change history through a manager class built once."""

from registry.models import Tenant


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
