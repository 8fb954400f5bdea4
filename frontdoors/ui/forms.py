"""Forms of the browser UI. Collections are always limited to the current workspace's, so
a collection id from another workspace is an invalid choice, never a leak."""

from __future__ import annotations

from django import forms
from django.conf import settings
from django.contrib.auth.models import Group
from django.utils.translation import gettext, gettext_lazy

from search.access import workspace_groups
from search.answering.answers import QUESTION_MAX_CHARS
from search.answering.conversations import TITLE_MAX_CHARS
from search.models import Collection
from search.scoping import in_workspaces

MODE_CHOICES = [
    ("hybrid", gettext_lazy("Hybrid (meaning and keywords)")),
    ("dense", gettext_lazy("Semantic (meaning)")),
    ("keyword", gettext_lazy("Keyword (BM25)")),
]


class CollectionChoiceField(forms.ModelChoiceField):
    """Collections by name: the form only ever lists one workspace's."""

    def label_from_instance(self, obj) -> str:
        return obj.name


class SearchForm(forms.Form):
    """One box for both searching and asking."""

    q = forms.CharField(label=gettext_lazy("Search or ask a question"), max_length=QUESTION_MAX_CHARS, required=False)
    collection = CollectionChoiceField(
        label=gettext_lazy("Collection"),
        queryset=Collection.objects.none(),
        required=False,
        empty_label=gettext_lazy("All collections"),
    )
    mode = forms.ChoiceField(label=gettext_lazy("Search mode"), choices=MODE_CHOICES, required=False, initial="hybrid")
    # A follow-up: the conversation the question continues (the thread's box under its last answer).
    conversation = forms.UUIDField(required=False, widget=forms.HiddenInput)

    def __init__(self, *args, workspace, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["collection"].queryset = in_workspaces(Collection, workspace).order_by("name")
        self.fields["q"].widget.attrs.update({"type": "search", "autocomplete": "off", "spellcheck": "true"})

    def clean_mode(self) -> str:
        return self.cleaned_data["mode"] or "hybrid"

    def collection_ids(self) -> list[int] | None:
        """The chosen collection, or None for all of the workspace's."""
        collection = self.cleaned_data.get("collection")
        return [collection.pk] if collection is not None else None


class MultipleFileInput(forms.ClearableFileInput):
    allow_multiple_selected = True


class MultipleFileField(forms.FileField):
    """Several files in one field (Django's documented pattern for ``<input multiple>``)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("widget", MultipleFileInput())
        # An empty file is refused by document_create with its own message, beside the others.
        kwargs.setdefault("allow_empty_file", True)
        super().__init__(*args, **kwargs)

    def clean(self, data, initial=None):
        clean_one = super().clean
        if isinstance(data, list | tuple):
            if not data:  # no file chosen: the field's own "required" error, which the loop would skip
                clean_one(None, initial)
            return [clean_one(item, initial) for item in data]
        return [clean_one(data, initial)]


class UploadForm(forms.Form):
    collection = CollectionChoiceField(label=gettext_lazy("Into collection"), queryset=Collection.objects.none())
    files = MultipleFileField(label=gettext_lazy("Files"))
    readers = forms.ModelMultipleChoiceField(
        label=gettext_lazy("Who may read them"),
        queryset=Group.objects.none(),
        required=False,
        help_text=gettext_lazy("None chosen: everyone in the workspace. Chosen: those groups, and you."),
    )

    def __init__(self, *args, workspace, **kwargs):
        super().__init__(*args, **kwargs)
        collections = in_workspaces(Collection, workspace).order_by("name")
        self.fields["collection"].queryset = collections
        megabytes = settings.DOCUMENT_MAX_BYTES / (1024 * 1024)
        self.fields["files"].help_text = gettext(
            "Text, Markdown, HTML, PDF or Word (.docx), up to %(size)s MB each."
        ) % {"size": f"{megabytes:g}"}
        self.fields["files"].widget.attrs["aria-describedby"] = "files-help"  # the help text's element
        if len(collections) == 1:
            self.fields["collection"].initial = collections[0].pk
        self.fields["readers"].queryset = workspace_groups(workspace).order_by("name")


class ReadersForm(forms.Form):
    """Who may read one document, in the browser: groups, or nobody chosen for everyone."""

    groups = forms.ModelMultipleChoiceField(
        label=gettext_lazy("Who may read it"),
        queryset=Group.objects.none(),
        required=False,
        widget=forms.CheckboxSelectMultiple,
        help_text=gettext_lazy("None chosen: everyone in the workspace. Chosen: those groups, and you."),
    )

    def __init__(self, *args, workspace, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["groups"].queryset = workspace_groups(workspace).order_by("name")


class ConversationRenameForm(forms.Form):
    title = forms.CharField(label=gettext_lazy("Title"), max_length=TITLE_MAX_CHARS)
