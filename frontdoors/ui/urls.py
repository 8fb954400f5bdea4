"""URLs of the browser UI, included at the site's root: its search page is the home page."""

from django.urls import path

from frontdoors.ui import languages, views

app_name = "ui"

urlpatterns = [
    path("", views.search_page, name="search"),
    path("ask/", views.ask, name="ask"),
    path("answers/", views.answers, name="answers"),
    path("conversations/<uuid:conversation_id>/rename/", views.conversation_rename_view, name="conversation_rename"),
    path("conversations/<uuid:conversation_id>/delete/", views.conversation_delete_view, name="conversation_delete"),
    path("answers/<uuid:answer_id>/", views.answer_detail, name="answer"),
    path("answers/<uuid:answer_id>/events/", views.answer_event_stream, name="answer_events"),
    path("passages/<int:chunk_id>/", views.passage, name="passage"),
    path("documents/", views.documents, name="documents"),
    path("documents/list/", views.document_list, name="document_list"),
    path("documents/upload/", views.upload, name="upload"),
    path("documents/<int:document_id>/file/", views.document_file, name="document_file"),
    path("documents/<int:document_id>/retry/", views.document_retry_view, name="document_retry"),
    path("documents/<int:document_id>/readers/", views.document_readers_view, name="document_readers"),
    path("documents/<int:document_id>/delete/", views.document_delete_view, name="document_delete"),
    path("workspace/", views.workspace_switch, name="workspace"),
    path("language/", languages.language_choose, name="language"),  # the header's switcher (POST)
]
