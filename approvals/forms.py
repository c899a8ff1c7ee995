from django import forms

from approvals.choices import Decision, HandoffStatus


class OneValueForm(forms.Form):
    """Refuses a field posted more than once (`decision=approve&decision=reject`), rather
    than reading its last value: a post that says two things records neither."""

    def clean(self) -> dict:
        cleaned = super().clean()
        for name in self.fields:
            if len(self.data.getlist(name)) > 1:
                self.add_error(name, "Give one value.")
        return cleaned

    def refusal(self) -> str:
        """Why the post was refused, field by field, for the page to say: the text a person
        typed is not kept across the redirect, so they need to know what to change."""
        problems = [
            *self.non_field_errors(),
            *(f"{field.label}: {' '.join(field.errors)}" for field in self if field.errors),
        ]
        return " ".join(["Nothing was recorded.", *problems])


class DecisionForm(OneValueForm):
    """The decision posts back the hash of the payload the page showed."""

    decision = forms.ChoiceField(choices=Decision.choices, widget=forms.HiddenInput)
    payload_hash = forms.RegexField(regex=r"^[0-9a-f]{64}$", widget=forms.HiddenInput)
    comment = forms.CharField(
        required=False, max_length=2000, widget=forms.Textarea(attrs={"rows": 3, "cols": 60})
    )


class QueueFilterForm(forms.Form):
    tenant = forms.CharField(required=False, max_length=63)
    status = forms.CharField(required=False, max_length=24)


class HandoffForm(OneValueForm):
    """How a person closes a request the route left to people, with what they did."""

    outcome = forms.ChoiceField(
        choices=[
            (status, label)
            for status, label in HandoffStatus.choices
            if status in (HandoffStatus.HANDLED, HandoffStatus.DECLINED)
        ],
        widget=forms.HiddenInput,
    )
    note = forms.CharField(max_length=4000, widget=forms.Textarea(attrs={"rows": 4, "cols": 60}))
