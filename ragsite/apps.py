from django.apps import AppConfig


class RagsiteConfig(AppConfig):
    name = "ragsite"
    verbose_name = "Site"
