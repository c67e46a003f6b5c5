from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path

from apps.dashboard.views import LoginView, admin_login
from apps.inventory.health import healthz

urlpatterns = [
    path("healthz", healthz, name="healthz"),
    path("admin/login/", admin_login),  # before admin.site.urls: the same lock-out as every sign-in
    path("admin/", admin.site.urls),
    path("accounts/login/", LoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("api/", include("apps.api.urls")),
    path("", include("apps.dashboard.urls")),
]
