from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path

from apps.inventory.health import healthz

urlpatterns = [
    path("healthz", healthz, name="healthz"),
    path("admin/", admin.site.urls),
    path("accounts/login/", auth_views.LoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("api/", include("apps.api.urls")),
    path("", include("apps.dashboard.urls")),
]
