from django.conf import settings
from django.contrib import admin
from django.contrib.auth.views import LoginView, LogoutView
from django.core.exceptions import RequestDataTooBig, TooManyFieldsSent, TooManyFilesSent
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.urls import include, path
from django.views.defaults import bad_request, page_not_found, permission_denied, server_error
from django.views.generic import TemplateView
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView
from rest_framework.request import Request

from config.api import error_body
from config.handlers import MalformedContentType
from config.sign_in import PASSWORD_CHANGE, sign_in_throttled
from registry.admin.site import FormFieldAutocompleteView
from runs.views import MemoryListView, RegistryHistoryView


class SchemaView(SpectacularAPIView):
    """The OpenAPI document of the one version the API has (SPECTACULAR_SETTINGS["VERSION"]).
    drf-spectacular takes any `?version=` as the version asked for and writes it into the
    document's info.version and its file name: a client was served a version that does not
    exist, and a newline in it failed the response (500)."""

    def _get_version_parameter(self, request: Request) -> None:
        return None


urlpatterns = [
    path("", TemplateView.as_view(template_name="home.html"), name="home"),
    path("admin/login/", sign_in_throttled(admin.site.login)),
    path(
        "admin/password_change/",
        admin.site.admin_view(
            sign_in_throttled(admin.site.password_change, wording=PASSWORD_CHANGE), cacheable=True
        ),
    ),
    path(
        "admin/autocomplete/",
        admin.site.admin_view(FormFieldAutocompleteView.as_view(admin_site=admin.site)),
    ),
    path("admin/", admin.site.urls),
    path("accounts/login/", sign_in_throttled(LoginView.as_view()), name="login"),
    path("accounts/logout/", LogoutView.as_view(next_page="login"), name="logout"),
    path("api/v1/", include("registry.api.urls")),
    path("api/v1/", include("runs.api.urls")),
    path("api/v1/", include("approvals.api.urls")),
    path("api/v1/", include("evaluations.api.urls")),
    path("approvals/", include("approvals.urls")),
    path("runs/", include("runs.urls")),
    path("evaluations/", include("evaluations.urls")),
    path("registry/history/", RegistryHistoryView.as_view(), name="registry-history"),
    path("memories/", MemoryListView.as_view(), name="memories"),
    path("api/schema/", SchemaView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerSplitView.as_view(url_name="schema"), name="api-docs"),
]


# Django-level errors (unknown URL, bad Host header, CSRF, a crash) on /api/ paths answer
# with the same JSON error body as the views; pages keep Django's HTML pages, but for a form
# past the body limit (413) or a request past the number of parameters (400), which get a
# page saying so; the API names the limit of files too.


# What Django refuses to read past a count: the setting of the count, and what it counts.
_COUNT_LIMITS = {
    TooManyFieldsSent: ("DATA_UPLOAD_MAX_NUMBER_FIELDS", "parameters"),
    TooManyFilesSent: ("DATA_UPLOAD_MAX_NUMBER_FILES", "files"),
}


def _is_api(request: HttpRequest) -> bool:
    return request.path_info.startswith("/api/")


def handler400(request: HttpRequest, exception: Exception) -> HttpResponse:
    if _is_api(request):
        # Django answers a body over DATA_UPLOAD_MAX_MEMORY_SIZE read outside DRF with 400.
        if isinstance(exception, RequestDataTooBig):
            body = error_body("PAYLOAD_TOO_LARGE", "The request body is too large.")
            return JsonResponse(body, status=413)
        for refused, (setting, counted) in _COUNT_LIMITS.items():
            if isinstance(exception, refused):
                limit = getattr(settings, setting)
                message = f"The request carried more than {limit} {counted}."
                body = error_body("VALIDATION_ERROR", message, {f"max_{counted}": limit})
                return JsonResponse(body, status=400)
        message = str(exception) if isinstance(exception, MalformedContentType) else "Bad request."
        return JsonResponse(error_body("VALIDATION_ERROR", message), status=400)
    if isinstance(exception, RequestDataTooBig):
        # A page's form past the limit: Django's page would say "Bad Request" and nothing more.
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        shown = f"{limit / 1048576:g} MB" if limit >= 1048576 else f"{limit // 1024} KB"
        return render(request, "request_too_large.html", {"limit": shown}, status=413)
    if isinstance(exception, TooManyFieldsSent):
        # An address (a filter list pasted over and over) or a form with that many fields.
        limit = settings.DATA_UPLOAD_MAX_NUMBER_FIELDS
        return render(request, "too_many_parameters.html", {"limit": limit}, status=400)
    return bad_request(request, exception)


def handler403(request: HttpRequest, exception: Exception) -> HttpResponse:
    if _is_api(request):
        return JsonResponse(error_body("PERMISSION_DENIED", "Permission denied."), status=403)
    return permission_denied(request, exception)


def handler404(request: HttpRequest, exception: Exception) -> HttpResponse:
    if _is_api(request):
        return JsonResponse(error_body("NOT_FOUND", "No such resource."), status=404)
    return page_not_found(request, exception)


def handler500(request: HttpRequest) -> HttpResponse:
    if _is_api(request):
        body = error_body("INTERNAL_ERROR", "The server could not complete the request.")
        return JsonResponse(body, status=500)
    return server_error(request)
