"""Change history of registry, approval and evaluation models (django-simple-history).

`instance.history` builds a manager class from its queryset class on every access, copying
each queryset method onto it, and every save of a tracked model reads it once. The manager
here builds that class once per queryset class; `history_records` gives a model its history
with it.
"""

import functools
from typing import Any

from simple_history import manager
from simple_history.models import HistoricalRecords


class HistoryManager(manager.HistoryManager):
    @classmethod
    @functools.cache
    def from_queryset(cls, queryset_class: type, class_name: str | None = None) -> type:
        return super().from_queryset(queryset_class, class_name)


def history_records(**options: Any) -> HistoricalRecords:
    return HistoricalRecords(history_manager=HistoryManager, **options)
