"""The operator console for generation: providers, upstream keys, routes and canary releases.

- Upstream keys: the secret is write-only (a password input, encrypted on save through
  ``UpstreamKey.set_secret``); pages show the label and the last four characters only.
- Canary releases: every change goes through ``inference.canary`` (row lock + a
  ``CanaryEvent`` naming the operator), whether from the list's actions or from editing the
  percent in the form.
"""

from __future__ import annotations

from datetime import UTC, datetime

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.db import models, transaction
from django.db.models import Count, Q
from django.template.response import TemplateResponse
from django.utils.html import format_html, format_html_join

from inference import canary
from inference.models import (
    SPECULATIVE_K_MAX,
    CanaryEvent,
    CanaryRelease,
    Provider,
    Route,
    RouteFallback,
    UpstreamKey,
)
from inference.secrets import fingerprint


def _https_urls(field, **kwargs):
    # URLs typed without a scheme get https (Django 6's default; silences its warning).
    if isinstance(field, models.URLField):
        kwargs.setdefault("assume_scheme", "https")
    return field.formfield(**kwargs)


class ProviderForm(forms.ModelForm):
    class Meta:
        model = Provider
        formfield_callback = _https_urls
        fields = [
            "name",
            "kind",
            "base_url",
            "devices",
            "model",
            "context_window",
            "enabled",
            "speculative_method",
            "draft_model",
            "speculative_k",
            "speculative_adaptive_k",
            "connect_timeout_s",
            "first_token_timeout_s",
            "total_timeout_s",
            "extra_body",
        ]

    def clean_speculative_k(self):
        # One message on the field (the model's validator and its clean() would give two).
        k = self.cleaned_data.get("speculative_k")
        if k is not None and not 1 <= k <= SPECULATIVE_K_MAX:
            raise forms.ValidationError(f"k must be between 1 and {SPECULATIVE_K_MAX}, got {k}.")
        return k


@admin.register(Provider)
class ProviderAdmin(admin.ModelAdmin):
    form = ProviderForm
    formfield_overrides = {models.URLField: {"assume_scheme": "https"}}
    list_display = ["name", "kind", "model", "speculative_method", "speculative_k", "keys", "enabled"]
    list_filter = ["kind", "speculative_method", "enabled"]
    search_fields = ["name", "model", "base_url"]
    readonly_fields = ["created_at", "updated_at"]
    fieldsets = [
        (None, {"fields": ["name", "kind", "base_url", "devices", "model", "context_window", "enabled"]}),
        (
            "Speculative decoding",
            {"fields": ["speculative_method", "draft_model", "speculative_k", "speculative_adaptive_k"]},
        ),
        ("Timeouts (seconds)", {"fields": ["connect_timeout_s", "first_token_timeout_s", "total_timeout_s"]}),
        (
            "Advanced",
            {
                "fields": ["extra_body", "cut_repetitions", "warming_since", "created_at", "updated_at"],
                "classes": ["collapse"],
            },
        ),
    ]

    def get_queryset(self, request):
        return (
            super()
            .get_queryset(request)
            .annotate(
                key_count=Count("keys"),
                active_key_count=Count("keys", filter=Q(keys__status=UpstreamKey.Status.ACTIVE)),
            )
        )

    @admin.display(description="keys (active / all)")
    def keys(self, obj: Provider) -> str:
        return f"{obj.active_key_count} / {obj.key_count}"


class UpstreamKeyForm(forms.ModelForm):
    secret = forms.CharField(
        required=False,
        strip=True,
        widget=forms.PasswordInput(render_value=False, attrs={"autocomplete": "new-password"}),
        help_text="Write-only: stored encrypted and never shown again. Leave empty to keep the stored key.",
    )

    class Meta:
        model = UpstreamKey
        fields = ["provider", "label"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.instance.pk is None:
            self.fields["secret"].required = True
            self.fields["secret"].help_text = "Write-only: stored encrypted and never shown again."

    def clean(self):
        cleaned = super().clean()
        secret = cleaned.get("secret") or ""
        provider = cleaned.get("provider")
        fp = fingerprint(secret) if secret else self.instance.fingerprint
        if provider is not None and fp:
            duplicate = UpstreamKey.objects.filter(provider=provider, fingerprint=fp).exclude(pk=self.instance.pk)
            if (other := duplicate.first()) is not None:
                self.add_error(
                    "secret" if secret else "provider",
                    f"This key is already stored for {provider} as '{other.label}' (…{other.last_four}).",
                )
        if secret and not self.errors:
            self.instance.set_secret(secret)
        return cleaned


@admin.register(UpstreamKey)
class UpstreamKeyAdmin(admin.ModelAdmin):
    form = UpstreamKeyForm
    list_display = [
        "label",
        "provider",
        "key",
        "status",
        "cooldown_until",
        "disabled_reason",
        "consecutive_failures",
        "failure_count",
        "success_count",
        "last_used_at",
    ]
    list_filter = ["status", "provider"]
    list_select_related = ["provider"]
    search_fields = ["label", "provider__name", "last_four"]
    actions = ["re_enable", "disable"]
    # Everything but provider, label and the write-only secret is the key pool's state.
    readonly_fields = [
        "key",
        "status",
        "cooldown_until",
        "disabled_reason",
        "last_error",
        "consecutive_failures",
        "failure_count",
        "success_count",
        "last_failure_at",
        "last_used_at",
        "created_at",
    ]

    def get_fieldsets(self, request, obj=None):
        if obj is None:
            return [(None, {"fields": ["provider", "label", "secret"]})]
        return [
            (None, {"fields": ["provider", "label", "key", "secret"]}),
            ("State", {"fields": ["status", "cooldown_until", "disabled_reason", "last_error"]}),
            (
                "Use",
                {
                    "fields": [
                        "consecutive_failures",
                        "failure_count",
                        "success_count",
                        "last_failure_at",
                        "last_used_at",
                        "created_at",
                    ]
                },
            ),
        ]

    @admin.display(description="key", ordering="last_four")
    def key(self, obj: UpstreamKey) -> str:
        return f"…{obj.last_four}" if obj.last_four else "-"

    def save_model(self, request, obj, form, change):
        if not change:
            obj.save()
            return
        # Save only what the operator changed: the key pool updates the counters and the
        # status of this row concurrently, and the form's copy of those may be stale.
        fields = {name for name in form.changed_data if name != "secret"}
        if "secret" in form.changed_data:
            fields |= {"secret_encrypted", "fingerprint", "last_four"}
        if fields:
            obj.save(update_fields=sorted(fields))

    @admin.action(description="Re-enable: active, no cooldown, failures reset")
    def re_enable(self, request, queryset):
        count = queryset.update(
            status=UpstreamKey.Status.ACTIVE, cooldown_until=None, disabled_reason="", consecutive_failures=0
        )
        self.message_user(request, f"Re-enabled {count} key{'s' if count != 1 else ''}.", messages.SUCCESS)

    @admin.action(description="Disable")
    def disable(self, request, queryset):
        count = queryset.update(
            status=UpstreamKey.Status.DISABLED, disabled_reason=f"disabled by {request.user} in the admin"
        )
        self.message_user(request, f"Disabled {count} key{'s' if count != 1 else ''}.", messages.SUCCESS)


class RouteFallbackForm(forms.ModelForm):
    class Meta:
        model = RouteFallback
        fields = ["position", "fallback"]

    def clean(self):
        cleaned = super().clean()
        fallback = cleaned.get("fallback")
        if fallback is not None and self.instance.route_id and fallback.pk == self.instance.route_id:
            self.add_error("fallback", "A route cannot fall back to itself.")
        return cleaned


class RouteFallbackInline(admin.TabularInline):
    model = RouteFallback
    form = RouteFallbackForm
    fk_name = "route"
    extra = 0
    ordering = ["position"]
    verbose_name = "fallback (tried in order of position)"
    verbose_name_plural = "fallbacks (tried in order of position, after every key of this route failed)"


@admin.register(Route)
class RouteAdmin(admin.ModelAdmin):
    list_display = ["name", "provider", "is_default", "enabled", "max_tokens", "temperature", "fallback_list"]
    list_filter = ["enabled", "is_default", "provider"]
    list_select_related = ["provider"]
    search_fields = ["name", "description"]
    readonly_fields = ["created_at", "updated_at"]
    inlines = [RouteFallbackInline]
    fields = [
        "name",
        "provider",
        "description",
        "is_default",
        "enabled",
        "max_tokens",
        "temperature",
        "top_p",
        "system_prompt",
        "max_sources",
        "max_source_tokens",
        "citing",
        "stop",
        "abstains",
        "languages",
        "created_at",
        "updated_at",
    ]

    def get_queryset(self, request):
        return super().get_queryset(request).prefetch_related("fallback_links__fallback")

    @admin.display(description="fallbacks")
    def fallback_list(self, obj: Route) -> str:
        links = sorted(obj.fallback_links.all(), key=lambda link: link.position)
        return " -> ".join(link.fallback.name for link in links) or "-"


class CanaryEventInline(admin.TabularInline):
    model = CanaryEvent
    extra = 0
    can_delete = False
    ordering = ["-created_at", "-id"]
    fields = ["created_at", "action", "percent_from", "percent_to", "reason", "actor"]
    readonly_fields = fields
    verbose_name = "event"
    verbose_name_plural = "history"

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


THRESHOLD_FIELDS = [
    "max_error_rate",
    "max_p99_latency_ratio",
    "max_ttft_ratio",
    "min_requests",
    "window_seconds",
    "failing_windows_to_rollback",
]


TRAFFIC_FIELDS = ["name", "stable_route", "canary_route", "percent", "step_percent", "auto_promote"]


class CanaryReleaseForm(forms.ModelForm):
    # The percent the page showed: a save refuses to put back a percent that the analysis
    # (a step, a rollback) or another operator changed while the page was open.
    percent_seen = forms.DecimalField(required=False, widget=forms.HiddenInput, max_digits=5, decimal_places=2)

    class Meta:
        model = CanaryRelease
        fields = [*TRAFFIC_FIELDS, *THRESHOLD_FIELDS]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.instance.pk is not None:
            self.fields["percent_seen"].initial = self.instance.percent

    def clean(self):
        cleaned = super().clean()
        seen = cleaned.get("percent_seen")
        if self.instance.pk is not None and seen is not None and seen != self.instance.percent:
            self.add_error(
                "percent",
                f"The percent changed from {seen} to {self.instance.percent} while this page was open (see the "
                "history below); check it and save again.",
            )
            self.data = self.data.copy()
            self.data[self.add_prefix("percent_seen")] = str(self.instance.percent)
        stable = cleaned.get("stable_route")
        if self.instance.pk is None and stable is not None:
            other = CanaryRelease.objects.filter(stable_route=stable, state__in=CanaryRelease.LIVE_STATES).first()
            if other is not None:
                self.add_error(
                    "stable_route",
                    f"Route {stable} already has a live release ('{other.name}'); promote or roll it back first.",
                )
        return cleaned


class RollBackForm(forms.Form):
    reason = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 3, "cols": 80}),
        help_text="Recorded as the release's ended reason and in its history.",
    )


def _when(iso: str | None) -> str:
    try:
        return datetime.fromisoformat(iso).astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (TypeError, ValueError):
        return "?"


@admin.register(CanaryRelease)
class CanaryReleaseAdmin(admin.ModelAdmin):
    form = CanaryReleaseForm
    list_display = [
        "name",
        "stable_route",
        "canary_route",
        "percent",
        "state",
        "consecutive_failing_windows",
        "last_analysis_at",
        "last_verdict",
    ]
    list_filter = ["state", "stable_route"]
    list_select_related = ["stable_route", "canary_route"]
    search_fields = ["name", "ended_reason"]
    actions = ["apply_step", "pause_releases", "resume_releases", "promote_releases", "roll_back_releases"]

    def get_inlines(self, request, obj=None):
        return [CanaryEventInline] if obj is not None else []

    def get_fieldsets(self, request, obj=None):
        traffic = TRAFFIC_FIELDS
        if obj is None:
            return [(None, {"fields": traffic}), ("Thresholds", {"fields": THRESHOLD_FIELDS})]
        fieldsets = []
        if obj.ended_reason:
            fieldsets.append((f"{obj.get_state_display()}: why", {"fields": ["ended_reason_display"]}))
        if obj.is_live:
            traffic = [*traffic, "percent_seen"]
        return [
            *fieldsets,
            (None, {"fields": ["state", *traffic]}),
            (
                "Last analysis",
                {
                    "fields": ["last_analysis_at", "consecutive_failing_windows", "last_analysis_display"],
                    "description": "Windows tumble from the release's start; each is analysed once, after it "
                    "has ended, by the beat job every minute. 'Last analysis at' is the end of the last window "
                    "analysed.",
                },
            ),
            ("Thresholds", {"fields": THRESHOLD_FIELDS}),
            ("Dates", {"fields": ["created_at", "updated_at"], "classes": ["collapse"]}),
        ]

    def get_readonly_fields(self, request, obj=None):
        if obj is None:
            return []
        # State changes through the actions; the routes are fixed once traffic was split.
        readonly = [
            "state",
            "stable_route",
            "canary_route",
            "ended_reason_display",
            "last_analysis_at",
            "consecutive_failing_windows",
            "last_analysis_display",
            "created_at",
            "updated_at",
        ]
        if not obj.is_live:
            readonly += ["percent", "step_percent", "auto_promote", *THRESHOLD_FIELDS]
        return readonly

    @admin.display(description="ended because")
    def ended_reason_display(self, obj: CanaryRelease):
        css = "errornote" if obj.state == CanaryRelease.State.ROLLED_BACK else "help"
        return format_html('<p class="{}" style="font-size: 1.1em; margin: 0">{}</p>', css, obj.ended_reason)

    @admin.display(description="verdict")
    def last_verdict(self, obj: CanaryRelease) -> str:
        return (obj.last_analysis or {}).get("verdict", "-")

    @admin.display(description="last window")
    def last_analysis_display(self, obj: CanaryRelease):
        analysis = obj.last_analysis or {}
        if not analysis:
            return "No window analysed yet."
        arms = analysis.get("arms", {})

        def cell(arm: str, key: str) -> str:
            value = arms.get(arm, {}).get(key)
            if value is None:
                return "-"
            if key == "error_rate":
                return f"{value:.2%}"
            if key.endswith("_ms"):
                return f"{value:.0f} ms"
            return str(value)

        rows = format_html_join(
            "",
            "<tr><th>{}</th><td>{}</td><td>{}</td></tr>",
            (
                (label, cell(canary.STABLE, key), cell(canary.CANARY, key))
                for label, key in [
                    ("requests", "requests"),
                    ("errors", "errors"),
                    ("error rate", "error_rate"),
                    ("p99 latency", "p99_latency_ms"),
                    ("p99 time to first token", "p99_ttft_ms"),
                ]
            ),
        )
        window = analysis.get("window", {})
        reasons = format_html_join("", "<li>{}</li>", ((reason,) for reason in analysis.get("reasons", [])))
        return format_html(
            "<p><strong>{}</strong>{} &middot; window {} to {} ({} s) &middot; at {}%</p>"
            "<table><thead><tr><th></th><th>stable</th><th>canary</th></tr></thead><tbody>{}</tbody></table>"
            "<ul>{}</ul>",
            analysis.get("verdict", "?"),
            f" ({analysis['action'].replace('_', ' ')})" if analysis.get("action") else "",
            _when(window.get("start")),
            _when(window.get("end")),
            window.get("seconds", "?"),
            analysis.get("percent", "?"),
            rows,
            reasons,
        )

    def save_model(self, request, obj, form, change):
        if not change:
            canary.canary_release_start(obj, actor=request.user, reason="started in the admin")
            return
        with transaction.atomic():
            # Under the row lock, write only the fields the operator changed, so that the
            # analysis's concurrent writes (counts, last window) are kept.
            fields = [name for name in form.changed_data if name != "percent"]
            if fields:
                locked = CanaryRelease.objects.select_for_update().get(pk=obj.pk)
                for name in fields:
                    setattr(locked, name, getattr(obj, name))
                locked.save(update_fields=[*fields, "updated_at"])
            if "percent" in form.changed_data:
                canary.canary_release_percent_set(obj.pk, obj.percent, actor=request.user, reason="set in the admin")

    def _apply(self, request, queryset, action, done: str, **kwargs) -> None:
        changed, refused = [], []
        for release in queryset:
            try:
                action(release.pk, actor=request.user, **kwargs)
                changed.append(release.name)
            except canary.CanaryActionRefused as exc:
                refused.append(str(exc))
        if changed:
            self.message_user(request, f"{done}: {', '.join(changed)}.", messages.SUCCESS)
        for reason in refused:
            self.message_user(request, reason[:1].upper() + reason[1:] + ".", messages.ERROR)

    @admin.action(description="Apply one step (reaching 100%% promotes)")
    def apply_step(self, request, queryset):
        self._apply(request, queryset, canary.canary_release_step, "Stepped")

    @admin.action(description="Pause automatic promotion")
    def pause_releases(self, request, queryset):
        self._apply(request, queryset, canary.canary_release_pause, "Paused")

    @admin.action(description="Resume")
    def resume_releases(self, request, queryset):
        self._apply(request, queryset, canary.canary_release_resume, "Resumed")

    @admin.action(description="Promote: the stable route takes the canary's target")
    def promote_releases(self, request, queryset):
        self._apply(request, queryset, canary.canary_release_promote, "Promoted")

    @admin.action(description="Roll back: every client to stable, percent 0")
    def roll_back_releases(self, request, queryset):
        form = RollBackForm(request.POST if "apply" in request.POST else None)
        if form.is_valid():
            reason = form.cleaned_data["reason"].strip()
            self._apply(
                request,
                queryset,
                canary.canary_release_roll_back,
                "Rolled back",
                reason=reason or f"rolled back by {request.user} in the admin",
            )
            return None
        context = {
            **self.admin_site.each_context(request),
            "title": "Roll back canary releases",
            "opts": self.model._meta,
            "releases": queryset,
            "form": form,
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            "action": "roll_back_releases",
        }
        return TemplateResponse(request, "admin/inference/canaryrelease/roll_back.html", context)
