"""The one list / detail / form pattern every console page uses (like NetBox's generic views).

- ``ListPage``: a queryset, columns, an optional django-filter FilterSet, sorting by
  whitelisted columns (``?sort=name`` / ``?sort=-name``), pagination, an empty state that
  says what to do next.
- ``service_form``: every create/edit page. A valid form goes to a service function; a
  ValidationError from the service lands on the form (field or top) and the bound form is
  shown again, nothing lost; success is a message and a redirect (``saved``) or a page.
- ``service_action``: every POST button (start, suspend, grant…): the service's refusal
  becomes an error message, its success a message, and the user goes back to the page.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from django import forms
from django.contrib import messages
from django.core.exceptions import ValidationError
from django.core.paginator import Paginator
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils.safestring import mark_safe

PER_PAGE = 25
Result = TypeVar("Result")


@dataclass
class Column:
    """One table column: a label, how to get the cell, and optionally how to sort it."""

    label: str
    value: Callable[[Any], Any]
    sort: str = ""  # the order_by field; empty: not sortable
    href: Callable[[Any], str] | None = None
    numeric: bool = False


@dataclass
class Action:
    """A button above a list or on a detail page."""

    label: str
    url: str
    method: str = "get"  # "post": a small form with the CSRF token
    style: str = ""  # "primary", "danger"
    confirm: str = ""


@dataclass
class ListPage:
    """Everything a generic list needs; views build one and call ``render``."""

    title: str
    queryset: QuerySet
    columns: list[Column]
    filterset_class: Any = None
    default_sort: str = ""
    actions: list[Action] = field(default_factory=list)
    empty_title: str = "Nothing here yet"
    empty_hint: str = ""
    empty_action: Action | None = None
    intro: str = ""
    nav: str = ""
    per_page: int = PER_PAGE

    def render(self, request: HttpRequest, extra: dict | None = None) -> HttpResponse:
        queryset, filter_form = self.queryset, None
        if self.filterset_class is not None:
            filterset = self.filterset_class(
                request.GET or None, queryset=queryset, request=request
            )
            filter_form = filterset.form
            queryset = filterset.qs if filterset.is_bound and filterset.is_valid() else queryset
        sort = request.GET.get("sort") or self.default_sort
        sortable = {c.sort for c in self.columns if c.sort}
        if sort.lstrip("-") in sortable:
            queryset = queryset.order_by(sort, "pk")
        else:
            sort = ""
        page = Paginator(queryset, self.per_page).get_page(request.GET.get("page"))
        filtered = bool(
            filter_form is not None
            and any(v for k, v in request.GET.items() if k not in ("page", "sort"))
        )
        context = {
            "page": self,
            "page_obj": page,
            "filter_form": filter_form,
            "sort": sort,
            "rows": [[_cell(c, obj) for c in self.columns] for obj in page.object_list],
            "filtered": filtered,
            "nav": self.nav,
            "query": _query_without(request, "page"),
            "sort_query": _query_without(request, "page", "sort"),
            **(extra or {}),
        }
        return render(request, "console/generic/list.html", context)


EMPTY_CELL = mark_safe('<span class="muted">—</span>')  # noqa: S308 - a constant


def _cell(column: Column, obj: Any) -> dict[str, Any]:
    value = column.value(obj)
    if value is None or value == "":
        value = EMPTY_CELL
    return {
        "value": value,
        "href": column.href(obj) if column.href else "",
        "numeric": column.numeric,
    }


def _query_without(request: HttpRequest, *names: str) -> str:
    params = request.GET.copy()
    for name in names:
        params.pop(name, None)
    return params.urlencode()


def apply_errors(form: forms.BaseForm, exc: ValidationError) -> None:
    """Put a service's ValidationError on the form: on its field when the form has one."""
    if not hasattr(exc, "error_dict"):
        form.add_error(None, exc)
        return
    for name, errors in exc.message_dict.items():
        target = name if name in form.fields else None
        for message in errors:
            label = "" if target or name in ("__all__", "detail") else f"{name.replace('_', ' ')}: "
            form.add_error(target, f"{label}{message}")


def render_form(
    request: HttpRequest,
    form: forms.BaseForm,
    title: str,
    *,
    cancel: str,
    submit: str = "Save",
    nav: str = "",
    intro: str = "",
    template: str = "console/generic/form.html",
    extra: dict | None = None,
    status: int | None = None,
) -> HttpResponse:
    context = {
        "form": form,
        "title": title,
        "cancel": cancel,
        "submit": submit,
        "nav": nav,
        "intro": intro,
        **(extra or {}),
    }
    if status is None:
        status = 400 if form.is_bound and form.errors else 200
    return render(request, template, context, status=status)


def service_form(
    request: HttpRequest,
    form: forms.BaseForm,
    save: Callable[[Any], Result],
    done: Callable[[Result], HttpResponse],
    title: str,
    *,
    cancel: str,
    extra: Callable[[], dict] | None = None,
    **page: Any,
) -> HttpResponse:
    """A create/edit page: on a valid POST, ``save(form)`` calls the service and ``done``
    turns its result into the answer; otherwise (or when the service refuses) the form is
    shown with its errors. ``extra`` is called last, so it sees the service's errors too."""
    if request.method == "POST" and form.is_valid():
        try:
            result = save(form)
        except ValidationError as exc:
            apply_errors(form, exc)
        else:
            return done(result)
    return render_form(
        request, form, title, cancel=cancel, extra=extra() if extra else None, **page
    )


def saved(request: HttpRequest, message: str, to: str, **kwargs: Any) -> HttpResponse:
    """Say what happened, then go to ``to`` (a URL name and its arguments)."""
    messages.success(request, message)
    return redirect(to, **kwargs)


def service_action(
    request: HttpRequest,
    act: Callable[[], Any],
    success: str,
    back: HttpResponse,
    onward: HttpResponse | None = None,
) -> HttpResponse:
    """A POST button: run the service. Its ValidationError becomes the error message and
    the user goes ``back``; otherwise ``success`` is said and the user goes ``onward``
    (``back`` when not given)."""
    try:
        act()
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
        return back
    messages.success(request, success)
    return onward or back
