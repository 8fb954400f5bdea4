from django.contrib import admin
from django.urls import include, path
from django.views.generic import TemplateView

from ragsite import health

admin.site.site_header = "RAG search administration"
admin.site.site_title = "RAG search admin"
admin.site.index_template = "billing/dashboard/admin_index.html"  # the admin index, with links to the dashboards

urlpatterns = [
    path("", TemplateView.as_view(template_name="ragsite/home.html"), name="home"),
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("admin/billing/dashboard/", include("billing.urls")),
    path("admin/", admin.site.urls),
]
