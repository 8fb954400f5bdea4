from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.templatetags.static import static
from django.urls import include, path
from django.views.generic import RedirectView

from frontdoors import readiness, scrape

admin.site.site_header = "RAG search administration"
admin.site.site_title = "RAG search admin"
admin.site.index_template = "billing/dashboard/admin_index.html"  # the admin index, with links to the dashboards

urlpatterns = [
    # The machine doors first: a path is matched against the patterns in order, and every
    # pattern an include tried and missed becomes a list kept on the request's ResolverMatch
    # (garbage in a cycle, for the collector, on every API call). No UI pattern matches these.
    path("v1/", include("frontdoors.openai_api.urls")),
    path("api/", include("frontdoors.api.urls")),
    path("", include("frontdoors.ui.urls")),  # the browser UI; its search page is the home page
    path("accounts/login/", auth_views.LoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(next_page="login"), name="logout"),
    path("healthz", readiness.healthz, name="healthz"),
    # Pages without an icon link (the admin's, the API docs) make browsers ask for this.
    path("favicon.ico", RedirectView.as_view(url=static("favicon.svg"), permanent=True), name="favicon"),
    path("readyz", readiness.readyz, name="readyz"),
    path("metrics", scrape.metrics_view, name="metrics"),  # Prometheus; token: METRICS_TOKEN
    path("admin/billing/dashboard/", include("frontdoors.dashboard_urls")),
    path("admin/", admin.site.urls),
]
