from django.apps import AppConfig


class FrontdoorsConfig(AppConfig):
    name = "frontdoors"
    verbose_name = "Front doors"
