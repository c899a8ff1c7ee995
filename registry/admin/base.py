"""What every registry admin shares: history, object permissions, tenant scope by role."""

from collections.abc import Sequence
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.admin.utils import get_fields_from_path, unquote
from django.contrib.admin.views.main import ChangeList
from django.contrib.admin.widgets import AutocompleteSelect
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.exceptions import NON_FIELD_ERRORS, FieldDoesNotExist, ValidationError
from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.db import transaction
from django.db.models import JSONField, Model, Q, QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from guardian.admin import GuardedModelAdmin
from simple_history.admin import SimpleHistoryAdmin
from simple_history.utils import get_history_model_for_model

from config.errors import ApplicationError, detail_text, error_text
from config.forms import StrictJSONFormField
from registry.choices import Action
from registry.models import Tenant
from registry.selectors import tenants_where_user_can

# Where a POST the services refused keeps the refusal while its form is drawn again.
_REFUSAL = "_service_refusal"


def _refused(form: type[forms.ModelForm], error: ApplicationError) -> type[forms.ModelForm]:
    """`form`, invalid with the services' refusal: on the fields it names that the form
    shows, and as a whole otherwise. The whole-form refusal is added once the form has run its
    own checks, without what they already say (a name taken since the form was checked, which
    the form's unique check now finds too)."""

    class Refused(form):
        def clean(self) -> dict[str, Any]:
            cleaned = super().clean()
            for field, value in error.details.items():
                if field in self.fields:
                    self.add_error(field, detail_text(value))
            return cleaned

        def _post_clean(self) -> None:
            super()._post_clean()
            shown = self.non_field_errors()
            rest = {}
            for field, value in error.details.items():
                if field == NON_FIELD_ERRORS and isinstance(value, list):
                    value = [message for message in value if message not in shown]
                if field not in self.fields and value:
                    rest[field] = value
            self.add_error(None, error_text(ApplicationError(error.message, details=rest)))

    return Refused


class TolerantAutocompleteSelect(AutocompleteSelect):
    """Redraws a form whose posted choice is not even an id of the model (`user=abc`) as a
    form with that error; Django's widget looked the value up and failed with a 500."""

    def optgroups(self, name: str, value: Any, attr: Any = None) -> Any:
        target = self.field.target_field
        readable = []
        for item in value:
            try:
                target.to_python(item)
            except ValidationError:
                continue
            readable.append(item)
        return super().optgroups(name, readable, attr)


class ScopedChoicesMixin:
    """The objects a non-superuser may choose in a form, for a foreign key or a many-to-many
    field, are those of the tenants in scope, found through the tenant lookup of the chosen
    model's own admin, and platform-wide ones (no tenant), except for the field the row's own
    tenant is found through (`tenant_lookup`'s first step: the suite of a case, the tool of a
    version), which names an object of a tenant in scope. Models without a scoped admin
    (users, content types) are left as they are."""

    tenant_lookup = "tenant"

    def scoped_tenants(self, request: HttpRequest) -> QuerySet[Tenant]:
        raise NotImplementedError

    def _choices(self, request: HttpRequest, db_field: Any) -> QuerySet | None:
        related = db_field.related_model
        if related is Tenant:
            return self.scoped_tenants(request)
        try:
            lookup = getattr(self.admin_site.get_model_admin(related), "tenant_lookup", None)
        except admin.sites.NotRegistered:
            return None
        if lookup is None:
            return None
        scoped = Q(**{f"{lookup}__in": self.scoped_tenants(request)})
        if self.tenant_lookup.split("__")[0] != db_field.name:
            scoped |= Q(**{f"{lookup}__isnull": True})
        return related._default_manager.filter(scoped)

    def formfield_for_dbfield(self, db_field: Any, request: HttpRequest, **kwargs: Any):
        if isinstance(db_field, JSONField):
            kwargs.setdefault("form_class", StrictJSONFormField)
            if kwargs["form_class"] is StrictJSONFormField and not db_field.null:
                kwargs.setdefault("empty", db_field.get_default())
        return super().formfield_for_dbfield(db_field, request, **kwargs)

    def formfield_for_foreignkey(self, db_field: Any, request: HttpRequest, **kwargs: Any):
        if "widget" not in kwargs and db_field.name in self.get_autocomplete_fields(request):
            kwargs["widget"] = TolerantAutocompleteSelect(
                db_field, self.admin_site, using=kwargs.get("using")
            )
        if not request.user.is_superuser:
            choices = self._choices(request, db_field)
            if choices is not None:
                kwargs["queryset"] = choices
        field = super().formfield_for_foreignkey(db_field, request, **kwargs)
        if field is not None and db_field.related_model is Tenant and not request.user.is_superuser:
            field.required = True
        return field

    def formfield_for_manytomany(self, db_field: Any, request: HttpRequest, **kwargs: Any):
        if not request.user.is_superuser:
            choices = self._choices(request, db_field)
            if choices is not None:
                kwargs["queryset"] = choices
        return super().formfield_for_manytomany(db_field, request, **kwargs)


class ScopedInline(ScopedChoicesMixin):
    """An inline offers what its parent's admin offers."""

    def scoped_tenants(self, request: HttpRequest) -> QuerySet[Tenant]:
        return self.admin_site.get_model_admin(self.parent_model).scoped_tenants(request)


class TolerantChangeList(ChangeList):
    """A filter value no date can hold (`?created_at__year=99999`) is a wrong filter, shown as
    the admin shows one (the list, unfiltered, with a note), not a server error. The date
    hierarchy's bounds fail in `get_filters`, a year's when the query runs (`get_results`)."""

    def get_filters(self, request: HttpRequest) -> Any:
        try:
            return super().get_filters(request)
        except (ValueError, OverflowError) as error:
            raise IncorrectLookupParameters(error) from error

    def get_results(self, request: HttpRequest) -> None:
        try:
            super().get_results(request)
        except (ValueError, OverflowError) as error:
            raise IncorrectLookupParameters(error) from error


# Where a request keeps, per action, whether the user may do it in some tenant.
_IN_SOME_SCOPE = "_admin_in_some_scope"


class SelectionKeysMixin:
    """An action on a selection that is not even a key of the model (`_selected_action=abc`)
    changes nothing and says so, as on an empty selection; Django filtered the rows by it and
    failed with a server error. So is a `_to_field` that names no field of the model. Every
    admin of the site uses it, Django's and third-party ones included
    (registry/admin/site.py)."""

    def response_action(self, request: HttpRequest, queryset: QuerySet) -> HttpResponse | None:
        key = self.model._meta.pk
        try:
            for selected in request.POST.getlist(ACTION_CHECKBOX_NAME):
                key.to_python(selected)
        except ValidationError:
            self.message_user(
                request,
                "The selection names no item of this list. No items have been changed.",
                level=messages.WARNING,
            )
            return None
        return super().response_action(request, queryset)

    def to_field_allowed(self, request: HttpRequest, to_field: str) -> bool:
        """A `_to_field` that names another model's relation to this one
        (`/admin/auth/group/?_to_field=tenant`) is no field to refer by, refused as any
        unknown one is; Django read it as a field and failed with a server error."""
        try:
            field = self.model._meta.get_field(to_field)
        except FieldDoesNotExist:
            return False
        return field.concrete and super().to_field_allowed(request, to_field)


class TenantScopedAdmin(SelectionKeysMixin, ScopedChoicesMixin, admin.ModelAdmin):
    """Platform admins see everything; other staff see the rows of the tenants where their
    role allows `required_action` (found through `tenant_lookup`), and nothing platform-wide."""

    required_action: str = Action.REGISTRY_PUBLISH

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return TolerantChangeList

    def scoped_tenants(self, request: HttpRequest) -> QuerySet[Tenant]:
        return tenants_where_user_can(user=request.user, action=self.required_action)

    def _allowed(self, request: HttpRequest, obj: Any = None) -> bool:
        user = request.user
        if not (user.is_active and user.is_staff):
            return False
        if user.is_superuser:
            return True
        if obj is None:
            return self._in_some_scope(request)
        return self.get_queryset(request).filter(pk=obj.pk).exists()

    def _in_some_scope(self, request: HttpRequest) -> bool:
        """Whether some tenant's role lets the user do `required_action`: asked once per
        request and action, not by every admin of the page's navigation for every one of
        its permissions."""
        known = request.__dict__.setdefault(_IN_SOME_SCOPE, {})
        if self.required_action not in known:
            known[self.required_action] = self.scoped_tenants(request).exists()
        return known[self.required_action]

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        queryset = super().get_queryset(request)
        if request.user.is_superuser:
            return queryset
        return queryset.filter(**{f"{self.tenant_lookup}__in": self.scoped_tenants(request)})

    def has_module_permission(self, request: HttpRequest) -> bool:
        return self._allowed(request)

    def get_list_filter(self, request: HttpRequest) -> Sequence[Any]:
        """For staff within a scope, a filter named by a related field (the tenant, a suite)
        offers only the objects of the rows they may see, never every tenant's. A filter given
        with its own class, or one through a relation to a plain field, must scope itself."""
        filters = super().get_list_filter(request)
        if request.user.is_superuser:
            return filters
        return [
            (entry, admin.RelatedOnlyFieldListFilter)
            if isinstance(entry, str) and get_fields_from_path(self.model, entry)[-1].is_relation
            else entry
            for entry in filters
        ]

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return self._allowed(request, obj)


class ReadOnlyAdminMixin:
    """Records of what happened: shown, never added, changed or deleted here."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class EvidenceAdmin(ReadOnlyAdminMixin, TenantScopedAdmin):
    """Read-only records of a model without history, within the tenant scope."""


class HistoryAdmin(SimpleHistoryAdmin):
    """simple-history's pages, where an id that is not even a key (`abc/history/`, a record
    `history/xyz/`) names an object or a record that does not exist, as on Django's own
    pages; simple-history looked it up as it came and failed with a server error. The
    history of an object the user may not see is not found either, as for one that never
    existed; simple-history refused it (403) and so told that it exists.

    A history record is evidence to read: simple-history saves the row from a record's page
    posted back to whoever may view it (SIMPLE_HISTORY_REVERT_DISABLED only hides the
    button), so a post is refused here, for every model with history."""

    def _are_keys(self, object_id: str, version_id: str | None = None) -> bool:
        try:
            self.model._meta.pk.to_python(unquote(object_id))
            if version_id is not None:
                get_history_model_for_model(self.model)._meta.pk.to_python(version_id)
        except ValidationError:
            return False
        return True

    def history_view(
        self, request: HttpRequest, object_id: str, extra_context: Any = None
    ) -> HttpResponse:
        if not self._are_keys(object_id):
            return self._get_obj_does_not_exist_redirect(request, self.model._meta, object_id)
        try:
            return super().history_view(request, object_id, extra_context)
        except DjangoPermissionDenied as denied:
            raise Http404("No such object.") from denied

    def history_form_view(
        self, request: HttpRequest, object_id: str, version_id: str, extra_context: Any = None
    ) -> HttpResponse:
        if request.method == "POST":
            raise DjangoPermissionDenied("History records cannot be reverted.")
        if not self._are_keys(object_id, version_id):
            raise Http404("No such history record.")
        try:
            return super().history_form_view(request, object_id, version_id, extra_context)
        except DjangoPermissionDenied as denied:
            raise Http404("No such history record.") from denied


class ServiceRefusalsMixin:
    """A save or a deletion the services refuse is shown as the admin shows a mistake, with
    the refusal's words, and changes nothing: not a server error. Registry admins use it, and
    Django's user admin (registry/admin/site.py), whose saves and deletions keep every tenant
    an admin."""

    def changeform_view(
        self,
        request: HttpRequest,
        object_id: str | None = None,
        form_url: str = "",
        extra_context: Any = None,
    ) -> HttpResponse:
        """A save the services refuse (a release gate, a version that exists already) is
        undone, and the form is drawn again with what was typed and the refusal as its error
        (`get_form`), not a server error."""
        try:
            return super().changeform_view(request, object_id, form_url, extra_context)
        except ApplicationError as error:
            if request.method != "POST" or hasattr(request, _REFUSAL):
                self.message_user(request, error_text(error), level=messages.ERROR)
                return HttpResponseRedirect(request.get_full_path())
            setattr(request, _REFUSAL, error)
            return super().changeform_view(request, object_id, form_url, extra_context)

    def get_form(
        self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any
    ) -> type[forms.ModelForm]:
        form = super().get_form(request, obj, change=change, **kwargs)
        refusal = getattr(request, _REFUSAL, None)
        return form if refusal is None else _refused(form, refusal)

    def delete_view(
        self, request: HttpRequest, object_id: str, extra_context: Any = None
    ) -> HttpResponse:
        """A deletion the services refuse (a tenant's last admin, a server whose tool versions
        are still published) deletes nothing and logs nothing: the page is drawn again, with
        the refusal, not a server error."""
        try:
            return super().delete_view(request, object_id, extra_context)
        except ApplicationError as error:
            self.message_user(request, error_text(error), level=messages.ERROR)
            return HttpResponseRedirect(request.get_full_path())

    def response_action(self, request: HttpRequest, queryset: QuerySet) -> HttpResponse | None:
        """Deleting the selected rows deletes all of them or, the services refusing one, none."""
        if request.POST.get("action") != "delete_selected":
            return super().response_action(request, queryset)
        try:
            with transaction.atomic():
                return super().response_action(request, queryset)
        except ApplicationError as error:
            self.message_user(request, error_text(error), level=messages.ERROR)
            return None


class RegistryAdmin(ServiceRefusalsMixin, TenantScopedAdmin, HistoryAdmin, GuardedModelAdmin):
    """A registry object's admin: tenant scope, history, object permissions."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return self._allowed(request)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return self._allowed(request, obj)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return request.user.is_active and request.user.is_superuser

    # Object grants (django-guardian) carry meaning only on platform-wide definitions, which
    # platform admins manage: their pages would let other staff look up any user or group
    # of the platform by name, so to those staff the pages do not exist, nor the link to them.
    def obj_perms_manage_view(self, request: HttpRequest, object_pk: str) -> HttpResponse:
        self._platform_admin_only(request)
        self._keys_or_404((self.model, object_pk))
        return super().obj_perms_manage_view(request, object_pk)

    def obj_perms_manage_user_view(
        self, request: HttpRequest, object_pk: str, user_id: str
    ) -> HttpResponse:
        self._platform_admin_only(request)
        self._keys_or_404((self.model, object_pk), (get_user_model(), user_id))
        return super().obj_perms_manage_user_view(request, object_pk, user_id)

    def obj_perms_manage_group_view(
        self, request: HttpRequest, object_pk: str, group_id: str
    ) -> HttpResponse:
        self._platform_admin_only(request)
        self._keys_or_404((self.model, object_pk), (Group, group_id))
        return super().obj_perms_manage_group_view(request, object_pk, group_id)

    @staticmethod
    def _platform_admin_only(request: HttpRequest) -> None:
        if not (request.user.is_active and request.user.is_superuser):
            raise Http404("Object permissions are managed by platform admins.")

    @staticmethod
    def _keys_or_404(*named: tuple[type[Model], str]) -> None:
        """An id in a permissions page's address that is not even a key of its model
        (`user-manage/abc/`) names nothing; django-guardian looked it up as it came and failed
        with a server error."""
        for model, value in named:
            try:
                model._meta.pk.to_python(unquote(value))
            except ValidationError as error:
                raise Http404("No such object.") from error

    def render_change_form(
        self, request: HttpRequest, context: dict[str, Any], *args: Any, **kwargs: Any
    ) -> HttpResponse:
        response = super().render_change_form(request, context, *args, **kwargs)
        if not request.user.is_superuser:
            opts = self.model._meta
            response.template_name = [
                f"admin/{opts.app_label}/{opts.model_name}/change_form.html",
                f"admin/{opts.app_label}/change_form.html",
                "admin/change_form.html",
            ]
        return response

    def run_service(self, request: HttpRequest, call: Any, success: str) -> bool:
        """Run one service call; a domain refusal becomes a readable admin message."""
        try:
            call()
        except ApplicationError as error:
            self.message_user(request, error_text(error), level=messages.ERROR)
            return False
        self.message_user(request, success, level=messages.SUCCESS)
        return True


admin.site.site_header = "Agent Governance Platform"
admin.site.site_title = "Agent Governance"
admin.site.index_title = "Control plane"
