"""URLs of the REST API, included under ``/api/`` (``frontdoors/urls.py``): v1's endpoints, the
OpenAPI schema and its interactive docs. Paths have no trailing slash."""

from django.urls import path, re_path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView

from frontdoors.api import streaming, views

app_name = "api"

urlpatterns = [
    path("v1/collections", views.CollectionListView.as_view(), name="collections"),
    path("v1/collections/<int:collection_id>", views.CollectionDetailView.as_view(), name="collection-detail"),
    path("v1/documents", views.DocumentListView.as_view(), name="documents"),
    path("v1/documents/<int:document_id>", views.DocumentDetailView.as_view(), name="document-detail"),
    path("v1/documents/<int:document_id>/file", views.DocumentFileView.as_view(), name="document-file"),
    path("v1/documents/<int:document_id>/retry", views.DocumentRetryView.as_view(), name="document-retry"),
    path("v1/documents/<int:document_id>/readers", views.DocumentReadersView.as_view(), name="document-readers"),
    path("v1/search", views.SearchView.as_view(), name="search"),
    path("v1/answers", views.AnswerCreateView.as_view(), name="answers"),
    path("v1/answers/<uuid:answer_id>", views.AnswerDetailView.as_view(), name="answer-detail"),
    path("v1/answers/<uuid:answer_id>/stream", streaming.answer_stream, name="answer-stream"),
    path("v1/conversations", views.ConversationListView.as_view(), name="conversations"),
    path("v1/conversations/<uuid:conversation_id>", views.ConversationDetailView.as_view(), name="conversation-detail"),
    path("v1/usage", views.UsageView.as_view(), name="usage"),
    re_path(r"^v1/", views.endpoint_not_found),
    path("schema/", SpectacularAPIView.as_view(), name="schema"),
    path("docs/", SpectacularSwaggerSplitView.as_view(url_name="api:schema"), name="docs"),
]
