from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.templatetags.static import static
from django.urls import include, path
from django.views.generic import RedirectView

from apps.dashboard.views import LoginView, admin_login
from apps.inventory.health import healthz
from apps.telemetry.prometheus import metrics

urlpatterns = [
    path("healthz", healthz, name="healthz"),
    path("metrics", metrics, name="metrics"),  # Prometheus; off unless METRICS_* is set
    # pages that do not extend base.html (the admin's) make browsers ask for /favicon.ico
    path("favicon.ico", RedirectView.as_view(url=static("favicon.svg"), permanent=True)),
    path("admin/login/", admin_login),  # before admin.site.urls: the same lock-out as every sign-in
    path("admin/", admin.site.urls),
    path("accounts/login/", LoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("api/", include("apps.api.urls")),
    path("", include("apps.dashboard.urls")),
]
