"""The approval queue and the human queue: server-rendered pages for approvers, through the
same services as the API."""

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils.decorators import method_decorator
from django.views import View

from approvals import selectors, services
from approvals.errors import NotFound
from approvals.forms import DecisionForm, HandoffForm, QueueFilterForm
from approvals.models import BusinessAction, Handoff
from config import jsontext
from config.errors import ApplicationError
from registry.mcp.review import visible
from runs.capability import pinned_model_label

PAGE_SIZE = 50


def _action_or_404(request: HttpRequest, action_id) -> BusinessAction:
    action = selectors.actions_visible(user=request.user).filter(pk=action_id).first()
    if action is None:
        raise Http404("No such approval.")
    return action


@method_decorator(login_required, name="dispatch")
class QueueView(View):
    """Waiting actions first (oldest first), then the decided ones; filter by tenant."""

    def get(self, request: HttpRequest) -> HttpResponse:
        actions = selectors.actions_for_approver(user=request.user)
        tenants = sorted(set(actions.order_by().values_list("tenant__slug", flat=True).distinct()))
        filters = QueueFilterForm(request.GET)
        filters.is_valid()
        if tenant := filters.cleaned_data.get("tenant"):
            actions = actions.filter(tenant__slug=tenant)
        if filters.cleaned_data.get("status") == "pending":
            actions = selectors.pending(actions)
        page = Paginator(actions, PAGE_SIZE).get_page(request.GET.get("page"))
        return render(
            request,
            "approvals/queue.html",
            {"page": page, "tenants": tenants, "filters": filters.cleaned_data},
        )


def _action_page(
    request: HttpRequest, action: BusinessAction, *, status: int = 200
) -> HttpResponse:
    """The action, with when an approval of it must have started its send and the model its
    run pinned (the offline planner named as such: no provider wrote the draft). Its payload is
    shown with its hidden characters spelled out: raw, a right-to-left override or a
    zero-width character would show the approver other text than the one sent. The page
    says so when it spelled out any, in the payload or in the approver's comment. The tool
    versions are listed as pairs by name: a template would read a tool named `items` for the
    mapping's own items()."""
    shown = jsontext.strings_mapped(action.payload, visible)
    decision = getattr(action, "decision", None)
    comment = decision.comment if decision else ""
    context = {
        "action": action,
        "shown": shown,
        "tool_versions": sorted(shown["tool_versions"].items()),
        "model": pinned_model_label(action.run.capability),
        "hidden_characters_spelled_out": shown != action.payload or visible(comment) != comment,
        "grace_minutes": settings.APPROVAL_RESUME_GRACE_SECONDS // 60,
        "send_deadline": services.approved_send_deadline(action),
        "can_decide": services.approval_may_decide(action=action, approver=request.user),
        "form": DecisionForm(),
    }
    return render(request, "approvals/action.html", context, status=status)


@method_decorator(login_required, name="dispatch")
class ActionView(View):
    """Exactly what will be done: recipient, subject, body, versions and hash; the form
    posts the hash it showed."""

    def get(self, request: HttpRequest, action_id) -> HttpResponse:
        return _action_page(request, _action_or_404(request, action_id))

    def post(self, request: HttpRequest, action_id) -> HttpResponse:
        action = _action_or_404(request, action_id)
        form = DecisionForm(request.POST)
        if not form.is_valid():
            messages.error(request, form.refusal())
            return redirect("approvals:action", action_id=action.pk)
        try:
            services.approval_decide(
                action_id=action.pk, approver=request.user, **form.cleaned_data
            )
        except NotFound as error:
            raise Http404(str(error)) from error
        except ApplicationError as error:
            # The refusal may have moved the action on (an expiry is recorded as it is
            # found): the page shows it as it is now.
            messages.error(request, error.message)
            return _action_page(
                request, _action_or_404(request, action_id), status=error.http_status
            )
        messages.success(request, f"Recorded: {form.cleaned_data['decision']}.")
        return redirect("approvals:action", action_id=action.pk)


def _handoff_or_404(request: HttpRequest, handoff_id) -> Handoff:
    handoff = selectors.handoffs_for_person(user=request.user).filter(pk=handoff_id).first()
    if handoff is None:
        raise Http404("No such handoff.")
    return handoff


def _handoff_context(request: HttpRequest, handoff: Handoff) -> dict:
    """The request with its hidden characters spelled out, as an action's payload is shown
    (`_action_page`): raw, they would show the person another request than the one made. The
    page says so when it spelled out any, in the request or in the handler's note."""
    can_handle = services.handoff_may_handle(handoff=handoff, person=request.user)
    shown = visible(handoff.request)
    return {
        "handoff": handoff,
        "request_shown": shown,
        "hidden_characters_spelled_out": shown != handoff.request
        or visible(handoff.note) != handoff.note,
        "can_handle": can_handle,
        "form": HandoffForm(),
    }


@method_decorator(login_required, name="dispatch")
class HandoffQueueView(View):
    """Requests the route left to people: open ones first (oldest first), then the rest."""

    def get(self, request: HttpRequest) -> HttpResponse:
        handoffs = selectors.handoffs_for_handler(user=request.user)
        page = Paginator(handoffs, PAGE_SIZE).get_page(request.GET.get("page"))
        return render(request, "approvals/handoffs.html", {"page": page})


@method_decorator(login_required, name="dispatch")
class HandoffView(View):
    """The request as the requester wrote it; the form handles or declines it with a note."""

    def get(self, request: HttpRequest, handoff_id) -> HttpResponse:
        handoff = _handoff_or_404(request, handoff_id)
        return render(request, "approvals/handoff.html", _handoff_context(request, handoff))

    def post(self, request: HttpRequest, handoff_id) -> HttpResponse:
        handoff = _handoff_or_404(request, handoff_id)
        form = HandoffForm(request.POST)
        if not form.is_valid():
            messages.error(request, form.refusal())
            return redirect("approvals:handoff", handoff_id=handoff.pk)
        try:
            services.handoff_resolve(
                handoff_id=handoff.pk, person=request.user, **form.cleaned_data
            )
        except NotFound as error:
            raise Http404(str(error)) from error
        except ApplicationError as error:
            messages.error(request, error.message)
            return render(
                request,
                "approvals/handoff.html",
                _handoff_context(request, _handoff_or_404(request, handoff_id)),
                status=error.http_status,
            )
        messages.success(request, f"Recorded: {form.cleaned_data['outcome']}.")
        return redirect("approvals:handoff", handoff_id=handoff.pk)
