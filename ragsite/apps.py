from django.apps import AppConfig

from ragsite import async_middleware, audit


class RagsiteConfig(AppConfig):
    name = "ragsite"
    verbose_name = "Site"

    def ready(self):
        async_middleware.install()
        audit.signals_connect()
