"""Metering URLs outside the router: tenant self-service usage and the showback export.

Included from config/urls.py before ``api/v1/`` so ``usage/export.csv`` is not taken for a
usage event's detail route.
"""

from django.urls import path

from metering import views

urlpatterns = [
    path("v1/usage", views.v1_usage, name="v1-usage"),
    path("api/v1/usage/export.csv", views.UsageExportView.as_view(), name="usage-export"),
]
