import os

from django.conf import settings
from django.core.asgi import get_asgi_application

from ragsite.body_limit import RequestBodyLimit

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ragsite.settings")
# Read by the settings: web processes under ASGI pool their database connections.
os.environ["RAGSITE_SERVER"] = "asgi"
# Oversized bodies are refused before Django reads (and spools to disk) any of them.
application = RequestBodyLimit(get_asgi_application(), settings.REQUEST_BODY_MAX_BYTES)
