from collections.abc import Iterable

from django import forms

from runs.choices import RunStatus


def ignored_filters(form: forms.Form) -> list[str]:
    """The labels of the filters a page ignores: those whose value is not valid (the valid
    ones still filter)."""
    return [str(form[name].label) for name in form.errors]


class AuditedTenantForm(forms.Form):
    """A filter by one of the tenants the viewer audits: another is not valid (ignored and
    said so), where it would show no run under a choice of every tenant."""

    tenant = forms.ChoiceField(required=False)

    def __init__(self, *args, tenants: Iterable[str], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fields["tenant"].choices = [("", "All"), *((slug, slug) for slug in tenants)]


class RunFilterForm(AuditedTenantForm):
    """The run history's filters; an invalid value is ignored, never an error page."""

    status = forms.ChoiceField(required=False, choices=[("", "Any"), *RunStatus.choices])
    skill = forms.CharField(required=False, max_length=140, help_text="name or name@version")
    user = forms.CharField(required=False, max_length=150)
    date_from = forms.DateField(required=False)
    date_to = forms.DateField(required=False)
    has_side_effect = forms.BooleanField(required=False)
    has_rejected_call = forms.BooleanField(required=False)

    def clean(self) -> dict:
        """Dates the wrong way round hold no day: both are ignored and said so, rather than
        every run filtered out as if none had been made."""
        values = super().clean()
        date_from, date_to = values.get("date_from"), values.get("date_to")
        if date_from and date_to and date_from > date_to:
            message = "The range ends before it starts."
            self.add_error("date_from", message)
            self.add_error("date_to", message)
        return values


class DashboardFilterForm(AuditedTenantForm):
    skill = forms.CharField(required=False, max_length=140, help_text="name or name@version")
    days = forms.IntegerField(required=False, min_value=1, max_value=90)
