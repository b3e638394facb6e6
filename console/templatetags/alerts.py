"""The console's notice banner: open alerts for the user, on every page until acknowledged."""

from typing import Any

from django import template

from alerts.services import banner_notices

register = template.Library()

SHOWN = 3  # notices in the banner; the rest are counted and linked


@register.inclusion_tag("console/alerts/_banner.html", takes_context=True)
def notice_banner(context: template.Context) -> dict[str, Any]:
    request = context.get("request")
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {"banner": []}
    notices = banner_notices(user)
    shown = list(notices[:SHOWN])
    return {
        "banner": shown,
        "more": max(notices.count() - SHOWN, 0) if len(shown) == SHOWN else 0,
        "show_tenant": user.is_staff or len({n.tenant_id for n in shown}) > 1,
        "csrf_token": context.get("csrf_token"),
        "next": request.get_full_path(),
    }
