"""Change history of registry, approval and evaluation models (django-simple-history).

`instance.history` builds a manager class from its queryset class on every access, copying
each queryset method onto it, and every save of a tracked model reads it once. The manager
here builds that class once per queryset class; `history_records` gives a model its history
with it, and remembers it, so that `creation_record` can make the historical row of a new
instance that is written without `save` (a run's step writes its rows in one statement).
"""

import functools
from typing import Any

from django.db import models
from django.utils import timezone
from simple_history import manager
from simple_history.models import HistoricalObjectDescriptor, HistoricalRecords


class HistoryManager(manager.HistoryManager):
    @classmethod
    @functools.cache
    def from_queryset(cls, queryset_class: type, class_name: str | None = None) -> type:
        return super().from_queryset(queryset_class, class_name)


class _ObjectAsItWas(HistoricalObjectDescriptor):
    """A record's `history_object`, with the related rows the record was read with (a history
    page reads its records with them): naming it, as the page does for every record, reads
    none of them again."""

    def __get__(self, instance: Any, owner: type) -> Any:
        if instance is None:
            return self
        result = super().__get__(instance, owner)
        read = instance._state.fields_cache
        for field in self.fields_included:
            if field.is_relation and field.cache_name in read:
                result._state.fields_cache[field.cache_name] = read[field.cache_name]
        return result


class _Records(HistoricalRecords):
    def get_extra_fields(self, model: type[models.Model], fields: Any) -> dict[str, Any]:
        extra = super().get_extra_fields(model, fields)
        extra["history_object"] = _ObjectAsItWas(model, self.fields_included(model))
        return extra

    def finalize(self, sender: type[models.Model], **kwargs: Any) -> None:
        super().finalize(sender, **kwargs)
        if self.cls is sender:
            _tracked[sender] = self

    def creation_record(self, instance: models.Model) -> models.Model:
        """The "+" record `save` would add after inserting `instance`, not saved: the same
        date, user, change reason and copied fields as `create_historical_record` gives."""
        if self.get_m2m_fields_from_model(type(instance)) or instance.pk is None:
            raise TypeError(
                "The record of a row with many-to-many history, or whose key the database "
                "sets, is made by save."
            )
        history_model = getattr(type(instance), self.manager_name).model
        return history_model(
            history_date=getattr(instance, "_history_date", timezone.now()),
            history_type="+",
            history_user=self.get_history_user(instance),
            history_change_reason=self.get_change_reason_for_object(instance, "+", None),
            **{
                field.attname: getattr(instance, field.attname)
                for field in self.fields_included(instance)
            },
        )


_tracked: dict[type[models.Model], _Records] = {}


def history_records(**options: Any) -> HistoricalRecords:
    return _Records(history_manager=HistoryManager, **options)


def has_history(model: type[models.Model]) -> bool:
    return model in _tracked


def creation_record(instance: models.Model) -> models.Model:
    """The historical row of a new instance of a tracked model, for the caller to write with
    it, once the values saving computes (`auto_now`) are set on the instance."""
    return _tracked[type(instance)].creation_record(instance)
