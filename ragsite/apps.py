from django.apps import AppConfig


class RagsiteConfig(AppConfig):
    name = "ragsite"
    verbose_name = "Site"

    def ready(self):
        from ragsite import async_middleware  # imports Django's middleware: only once the apps are ready

        async_middleware.install()
