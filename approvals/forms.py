from django import forms

from approvals.choices import Decision, HandoffStatus


class DecisionForm(forms.Form):
    """The decision posts back the hash of the payload the page showed."""

    decision = forms.ChoiceField(choices=Decision.choices, widget=forms.HiddenInput)
    payload_hash = forms.RegexField(regex=r"^[0-9a-f]{64}$", widget=forms.HiddenInput)
    comment = forms.CharField(required=False, max_length=2000, widget=forms.Textarea)


class QueueFilterForm(forms.Form):
    tenant = forms.CharField(required=False, max_length=63)
    status = forms.CharField(required=False, max_length=24)


class HandoffForm(forms.Form):
    """How a person closes a request the route left to people, with what they did."""

    outcome = forms.ChoiceField(
        choices=[
            (status, label)
            for status, label in HandoffStatus.choices
            if status in (HandoffStatus.HANDLED, HandoffStatus.DECLINED)
        ],
        widget=forms.HiddenInput,
    )
    note = forms.CharField(max_length=4000, widget=forms.Textarea)
