import os

from django.conf import settings
from django.core.asgi import get_asgi_application
from django.urls import get_resolver

from ragsite.body_limit import RequestBodyLimit
from ragsite.heap import startup_heap_freeze

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ragsite.settings")
# Read by the settings: web processes under ASGI pool their database connections.
os.environ["RAGSITE_SERVER"] = "asgi"
# Oversized bodies are refused before Django reads (and spools to disk) any of them.
application = RequestBodyLimit(get_asgi_application(), settings.REQUEST_BODY_MAX_BYTES)

# The URLconf imports every view (and the SDKs they use) at the first request otherwise:
# imported now, they are part of the start-up heap that is frozen (ragsite/heap.py).
get_resolver().url_patterns  # noqa: B018
startup_heap_freeze()
