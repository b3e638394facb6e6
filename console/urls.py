"""Console pages: one list / detail / form shape for every kind of object."""

from django.urls import path

from console.views import (
    admission,
    audit,
    auth,
    catalog,
    dashboard,
    deployments,
    keys,
    people,
    playground,
    profile,
    tenants,
    usage,
)

app_name = "console"

urlpatterns = [
    path("", auth.home, name="home"),
    path("login/", auth.LoginView.as_view(), name="login"),
    path("logout/", auth.LogoutView.as_view(), name="logout"),
    path("password/", auth.PasswordChangeView.as_view(), name="password-change"),
    path("profile/", profile.profile, name="profile"),
    path("profile/tokens/new/", profile.token_new, name="token-new"),
    path("profile/tokens/<int:pk>/revoke/", profile.token_revoke, name="token-revoke"),
    path("people/", people.people, name="people"),
    path("people/new/", people.user_new, name="user-new"),
    path("people/<int:pk>/", people.user_detail, name="user-detail"),
    path("people/<int:pk>/status/", people.user_status, name="user-status"),
    path(
        "people/<int:pk>/reset-password/",
        people.user_reset_password,
        name="user-reset-password",
    ),
    path("dashboard/", dashboard.dashboard, name="dashboard"),
    path("dashboard/live/", dashboard.dashboard_live, name="dashboard-live"),
    path("tenants/", tenants.tenant_list, name="tenant-list"),
    path("tenants/new/", tenants.tenant_new, name="tenant-new"),
    path("tenants/<slug:slug>/", tenants.tenant_detail, name="tenant-detail"),
    path("tenants/<slug:slug>/edit/", tenants.tenant_edit, name="tenant-edit"),
    path("tenants/<slug:slug>/status/", tenants.tenant_status, name="tenant-status"),
    path("tenants/<slug:slug>/members/", people.tenant_members, name="tenant-members"),
    path(
        "tenants/<slug:slug>/members/<int:pk>/role/",
        people.member_role,
        name="tenant-member-role",
    ),
    path(
        "tenants/<slug:slug>/members/<int:pk>/remove/",
        people.member_remove,
        name="tenant-member-remove",
    ),
    path("keys/", keys.key_list, name="key-list"),
    path("keys/new/", keys.key_new, name="key-new"),
    path("keys/<int:pk>/", keys.key_detail, name="key-detail"),
    path("keys/<int:pk>/edit/", keys.key_edit, name="key-edit"),
    path("keys/<int:pk>/revoke/", keys.key_revoke, name="key-revoke"),
    path("models/", catalog.model_list, name="model-list"),
    path("models/new/", catalog.model_new, name="model-new"),
    path("models/<int:pk>/", catalog.model_detail, name="model-detail"),
    path("models/<int:pk>/edit/", catalog.model_edit, name="model-edit"),
    path("models/<int:pk>/price/", catalog.price_new, name="price-new"),
    path("models/<int:pk>/grant/", catalog.model_grant, name="model-grant"),
    path(
        "models/<int:pk>/grants/<int:grant_id>/remove/", catalog.model_ungrant, name="model-ungrant"
    ),
    path("nodes/", catalog.node_list, name="node-list"),
    path("nodes/new/", catalog.node_new, name="node-new"),
    path("nodes/join/", catalog.node_join, name="node-join"),
    path("nodes/<int:pk>/", catalog.node_detail, name="node-detail"),
    path("nodes/<int:pk>/revoke/", catalog.node_revoke, name="node-revoke"),
    path("deployments/", deployments.deployment_list, name="deployment-list"),
    path("deployments/new/", deployments.deployment_new, name="deployment-new"),
    path("deployments/fit/", deployments.deployment_fit, name="deployment-fit"),
    path("deployments/<slug:name>/", deployments.deployment_detail, name="deployment-detail"),
    path(
        "deployments/<slug:name>/live/", deployments.deployment_progress, name="deployment-progress"
    ),
    path("deployments/<slug:name>/logs/", deployments.deployment_logs, name="deployment-logs"),
    path("deployments/<slug:name>/scale/", deployments.deployment_scale, name="deployment-scale"),
    path(
        "deployments/<slug:name>/<str:action>/",
        deployments.deployment_action,
        name="deployment-action",
    ),
    path("usage/", usage.usage, name="usage"),
    path("usage/export.csv", usage.usage_export, name="usage-export"),
    path("audit/", audit.audit_list, name="audit-list"),
    path("admission/", admission.admission, name="admission"),
    path("playground/", playground.playground, name="playground"),
    path("playground/chat", playground.playground_chat, name="playground-chat"),
]
