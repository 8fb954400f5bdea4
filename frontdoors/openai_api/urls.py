"""Routes of the OpenAI-compatible API, mounted at ``/v1/`` (the SDK's ``base_url``)."""

from django.urls import path, re_path

from frontdoors.openai_api import views

app_name = "openai_api"

urlpatterns = [
    path("models", views.models_list, name="models"),
    path("models/<path:model_id>", views.model_retrieve, name="model"),
    path("chat/completions", views.chat_completions, name="chat-completions"),
    path("embeddings", views.embeddings, name="embeddings"),
    # Anything else under /v1/ answers in OpenAI's error shape, not with an HTML page.
    re_path(r"^.*$", views.not_found, name="not-found"),
]
