from django.apps import AppConfig


class CoordinatorConfig(AppConfig):
    name = "apps.coordinator"
    label = "coordinator"
