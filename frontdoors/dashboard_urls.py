"""The billing dashboards, mounted at ``/admin/billing/dashboard/`` (frontdoors/urls.py), each
view behind the admin's login and staff check (``admin.site.admin_view``)."""

from django.contrib import admin
from django.urls import path

from frontdoors import dashboards as views

app_name = "billing_dashboard"

urlpatterns = [
    path("", admin.site.admin_view(views.cost), name="cost"),
    path("cost.csv", admin.site.admin_view(views.cost_csv), name="cost_csv"),
    path("charts/", admin.site.admin_view(views.charts), name="charts"),
    path("compare/", admin.site.admin_view(views.compare), name="compare"),
]
