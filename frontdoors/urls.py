from django.contrib import admin
from django.templatetags.static import static
from django.urls import include, path
from django.views.generic import RedirectView

from frontdoors import readiness, scrape
from frontdoors.ui import sign_in

admin.site.site_header = "RAG search administration"
admin.site.site_title = "RAG search admin"
admin.site.index_template = "billing/dashboard/admin_index.html"  # the admin index, with links to the dashboards
# The admin signs in where everyone does: single sign-on, and passwords as configured.
admin.site.login = sign_in.admin_sign_in

urlpatterns = [
    # The machine doors first: a path is matched against the patterns in order, and every
    # pattern an include tried and missed becomes a list kept on the request's ResolverMatch
    # (garbage in a cycle, for the collector, on every API call). No UI pattern matches these.
    path("v1/", include("frontdoors.openai_api.urls")),
    path("api/", include("frontdoors.api.urls")),
    path("", include("frontdoors.ui.urls")),  # the browser UI; its search page is the home page
    path("accounts/login/", sign_in.SignInView.as_view(), name="login"),
    path("accounts/logout/", sign_in.sign_out, name="logout"),
    # Single sign-on (ragsite/identity.py): to the provider, and back.
    path("accounts/oidc/start/", sign_in.OpenIDStartView.as_view(), name="oidc_start"),
    path("accounts/oidc/callback/", sign_in.OpenIDCallbackView.as_view(), name="oidc_callback"),
    path("healthz", readiness.healthz, name="healthz"),
    # Pages without an icon link (the admin's, the API docs) make browsers ask for this.
    path("favicon.ico", RedirectView.as_view(url=static("favicon.svg"), permanent=True), name="favicon"),
    path("readyz", readiness.readyz, name="readyz"),
    path("metrics", scrape.metrics_view, name="metrics"),  # Prometheus; token: METRICS_TOKEN
    path("admin/billing/dashboard/", include("frontdoors.dashboard_urls")),
    path("admin/", admin.site.urls),
]
