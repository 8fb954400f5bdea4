"""Where generation goes: providers, their upstream keys, named routes, canary releases.

- ``Provider``: one model behind one backend: ``local`` (a GPU pool: an engine server per
  device, ``devices``, dispatched to by the ``gpu`` queue's workers) or ``openai-compatible``
  (any HTTP endpoint with keys, queue ``remote``). Both speak the OpenAI protocol; the
  speculative fields say how the endpoint decodes (they select among pools, and are never
  sent upstream).
- ``UpstreamKey``: a provider's API keys, encrypted at rest (``inference.secrets``), with
  the state the key pool keeps (cooling down until, disabled and why, failures).
- ``Route``: what callers name (``default``, ``cheap``...): a provider plus generation
  defaults, with an ordered list of fallback routes.
- ``CanaryRelease``: a sticky share of one route's traffic sent to another, analysed every
  minute and rolled back by itself; ``CanaryEvent`` is its history.
"""

from __future__ import annotations

from decimal import Decimal
from urllib.parse import urlsplit

from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.db.models import F, Q

from inference.secrets import decrypt, encrypt, fingerprint
from ragsite.celery import Queue

SPECULATIVE_K_MAX = 16


def validate_device_url(value: str) -> None:
    """An engine server's base URL: http(s) and a host. Not Django's URLValidator, which
    refuses host names without a dot, such as compose's service names (``vllm-gpu0``)."""
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValidationError(f"{value!r} is not an http(s) URL with a host, such as http://127.0.0.1:8100/v1.")
    try:
        parts.port  # noqa: B018 (raises on a malformed port)
    except ValueError:
        raise ValidationError(f"{value!r} has a malformed port.") from None


class Provider(models.Model):
    class Kind(models.TextChoices):
        LOCAL = "local", "GPU pool (an engine server per device)"
        OPENAI_COMPATIBLE = "openai-compatible", "OpenAI-compatible HTTP endpoint"

    class Speculative(models.TextChoices):
        OFF = "off", "Off"
        DRAFT = "draft", "Draft model"
        NGRAM = "ngram", "N-grams from the prompt"
        BOTH = "both", "N-grams, else the draft model"
        EAGLE3 = "eagle3", "EAGLE-3 head"
        MTP = "mtp", "The model's multi-token-prediction layers"

    name = models.SlugField(max_length=100, unique=True)
    kind = models.CharField(max_length=32, choices=Kind.choices)
    base_url = models.URLField(
        max_length=500, blank=True, help_text="For OpenAI-compatible endpoints, e.g. https://api.example.com/v1."
    )
    devices = ArrayField(
        models.CharField(max_length=500, validators=[validate_device_url]),
        default=list,
        blank=True,
        help_text="A GPU pool's engine servers, one per device, e.g. http://127.0.0.1:8100/v1 (comma-separated).",
    )
    model = models.CharField(max_length=300, help_text="The model name the endpoint serves (its --served-model-name).")
    draft_model = models.CharField(
        max_length=300, blank=True, help_text="The endpoint's draft model or EAGLE head (same tokenizer as the model)."
    )
    context_window = models.PositiveIntegerField(
        default=4096, validators=[MinValueValidator(256)], help_text="Tokens of prompt plus answer the model takes."
    )
    connect_timeout_s = models.FloatField(default=5.0, validators=[MinValueValidator(0.1)])
    first_token_timeout_s = models.FloatField(default=30.0, validators=[MinValueValidator(0.1)])
    total_timeout_s = models.FloatField(default=300.0, validators=[MinValueValidator(1)])
    # How the endpoint decodes (its servers' --speculative-config): declared, never sent.
    speculative_method = models.CharField(max_length=16, choices=Speculative.choices, default=Speculative.OFF)
    speculative_k = models.PositiveSmallIntegerField(
        default=4, validators=[MinValueValidator(1), MaxValueValidator(SPECULATIVE_K_MAX)]
    )
    speculative_adaptive_k = models.BooleanField(default=False)
    extra_body = models.JSONField(
        default=dict, blank=True, help_text="Extra JSON fields sent with every request to this endpoint."
    )
    cut_repetitions = models.BooleanField(
        default=True,
        help_text="End a generation that repeats itself, bill what it generated (docs/routing.md). Off for "
        "outputs that repeat on purpose, and for exactness tests of untrained models.",
    )
    enabled = models.BooleanField(default=True)
    # A GPU pool whose engine servers are starting (manage.py up sets it until one answers and
    # its first-token timeout is measured): answers are extractive meanwhile, and /readyz says
    # the pool is warming instead of not ready.
    warming_since = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                condition=Q(speculative_k__gte=1, speculative_k__lte=SPECULATIVE_K_MAX), name="provider_k_in_range"
            ),
            models.CheckConstraint(
                condition=Q(connect_timeout_s__gt=0, first_token_timeout_s__gt=0, total_timeout_s__gt=0),
                name="provider_timeouts_positive",
            ),
            models.CheckConstraint(
                condition=~Q(kind="openai-compatible") | ~Q(base_url=""), name="provider_remote_has_base_url"
            ),
            models.CheckConstraint(condition=~Q(kind="local") | ~Q(devices=[]), name="provider_pool_has_devices"),
        ]

    # Methods that need draft_model (a draft model, or the EAGLE head).
    DRAFTED = (Speculative.DRAFT, Speculative.BOTH, Speculative.EAGLE3)

    def __str__(self) -> str:
        return self.name

    @property
    def is_local(self) -> bool:
        return self.kind == self.Kind.LOCAL

    @property
    def queue(self) -> str:
        """The Celery queue whose workers call this provider: ``gpu`` for a pool, ``remote`` else."""
        return Queue.GPU.value if self.is_local else Queue.REMOTE.value

    def speculation_mismatch(self, wanted: dict) -> tuple[str, str] | None:
        """Why this endpoint cannot serve a request's speculative options, as (the request's
        field, the reason), or None when it can. ``wanted``: ``{"enabled", "draft_model",
        "k"}``, each None when the request left it out; a draft model or k asks for speculation."""
        method = self.speculative_method
        enabled = wanted.get("enabled")
        if enabled is None and (wanted.get("draft_model") is not None or wanted.get("k") is not None):
            enabled = True
        if enabled is False and method != self.Speculative.OFF:
            return "enable_speculative", f"{self.name} decodes speculatively ({method})"
        if enabled and method == self.Speculative.OFF:
            return "enable_speculative", f"{self.name} does not decode speculatively"
        draft = wanted.get("draft_model")
        if draft is not None and (method not in self.DRAFTED or draft != self.draft_model):
            served = f"serves the draft {self.draft_model!r}" if method in self.DRAFTED else "has no draft model"
            return "draft_model", f"{self.name} {served}, not {draft!r}"
        k = wanted.get("k")
        if k is not None and k != self.speculative_k:
            return (
                "speculative_decoding.draft_tokens",
                f"{self.name} proposes {self.speculative_k} tokens a step, not {k}",
            )
        return None

    def clean(self) -> None:
        errors: dict[str, str] = {}
        if self.kind == self.Kind.OPENAI_COMPATIBLE:
            if not self.base_url:
                errors["base_url"] = (
                    "An OpenAI-compatible provider needs the endpoint's base URL, e.g. https://host/v1."
                )
            if self.speculative_method == self.Speculative.BOTH:
                errors["speculative_method"] = (
                    "'N-grams, else the draft model' has no equivalent on a vLLM-style endpoint; choose one proposer."
                )
            if self.devices:
                errors["devices"] = "Only a GPU pool has devices; an OpenAI-compatible provider has a base URL."
        else:
            if self.base_url:
                errors["base_url"] = "A GPU pool has no base URL: list its engine servers under devices."
            if not self.devices:
                errors["devices"] = (
                    "A GPU pool needs the base URL of at least one engine server, e.g. http://127.0.0.1:8100/v1."
                )
            elif len(set(self.devices)) != len(self.devices):
                errors["devices"] = "A device is listed twice."
        if self.speculative_method in self.DRAFTED and not self.draft_model:
            errors["draft_model"] = f"Speculative method '{self.speculative_method}' needs a draft model."
        if self.speculative_k is not None and not 1 <= self.speculative_k <= SPECULATIVE_K_MAX:
            errors["speculative_k"] = f"k must be between 1 and {SPECULATIVE_K_MAX}, got {self.speculative_k}."
        if self.first_token_timeout_s and self.total_timeout_s and self.first_token_timeout_s > self.total_timeout_s:
            errors["first_token_timeout_s"] = "The first-token timeout cannot exceed the total timeout."  # noqa: S105
        if not isinstance(self.extra_body, dict):
            errors["extra_body"] = "Must be a JSON object."
        if errors:
            raise ValidationError(errors)


class UpstreamKey(models.Model):
    class Status(models.TextChoices):
        ACTIVE = "active", "Active"
        COOLING_DOWN = "cooling_down", "Cooling down"
        DISABLED = "disabled", "Disabled"

    provider = models.ForeignKey(Provider, on_delete=models.CASCADE, related_name="keys")
    label = models.CharField(max_length=100, help_text="Which key this is, e.g. 'team account 2'.")
    # Fernet token of the key (inference.secrets); never shown, never logged.
    secret_encrypted = models.TextField(editable=False)
    # SHA-256 of the key: the same key cannot be added twice to a provider.
    fingerprint = models.CharField(max_length=64, editable=False)
    last_four = models.CharField(max_length=4, editable=False)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.ACTIVE)
    cooldown_until = models.DateTimeField(null=True, blank=True)
    disabled_reason = models.TextField(blank=True)
    consecutive_failures = models.PositiveIntegerField(default=0)
    failure_count = models.PositiveIntegerField(default=0)
    success_count = models.PositiveIntegerField(default=0)
    last_error = models.TextField(blank=True)
    last_failure_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["provider", "label"]
        constraints = [
            models.UniqueConstraint(fields=["provider", "fingerprint"], name="upstreamkey_unique_secret"),
            models.CheckConstraint(
                condition=~Q(status="cooling_down") | Q(cooldown_until__isnull=False),
                name="upstreamkey_cooldown_has_end",
            ),
        ]
        indexes = [models.Index(fields=["provider", "status", "last_used_at"], name="upstreamkey_rotation")]

    def __str__(self) -> str:
        return f"{self.label} (…{self.last_four})"

    def set_secret(self, plaintext: str) -> None:
        plaintext = plaintext.strip()
        if not plaintext:
            raise ValidationError({"secret": "The key is empty."})
        self.secret_encrypted = encrypt(plaintext)
        self.fingerprint = fingerprint(plaintext)
        self.last_four = plaintext[-4:]

    def secret(self) -> str:
        return decrypt(self.secret_encrypted)


class Route(models.Model):
    name = models.SlugField(max_length=100, unique=True, help_text="What callers ask for, e.g. 'default'.")
    provider = models.ForeignKey(Provider, on_delete=models.PROTECT, related_name="routes")
    description = models.CharField(max_length=300, blank=True)
    is_default = models.BooleanField(default=False, help_text="The route of requests that name none.")
    max_tokens = models.PositiveIntegerField(default=512, validators=[MinValueValidator(1)])
    temperature = models.FloatField(default=0.0, validators=[MinValueValidator(0.0)])
    top_p = models.FloatField(default=1.0, validators=[MinValueValidator(0.0), MaxValueValidator(1.0)])
    system_prompt = models.TextField(blank=True, help_text="Replaces the built-in answer instructions when set.")
    # What a prompt gives the model: a small model answers better from fewer, shorter sources
    # (docs/answers.md, "Prompts that fit the model"); the window still bounds both.
    max_sources = models.PositiveSmallIntegerField(
        default=8, validators=[MinValueValidator(1), MaxValueValidator(50)], help_text="Most sources in a prompt."
    )
    max_source_tokens = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(16)],
        help_text="Longest source in a prompt, in the model's tokens (a longer one keeps its sentences that best "
        "match the question); empty: whole chunks.",
    )

    class Citing(models.TextChoices):
        MODEL = "model", "The model cites the numbered sources"
        VERIFIER = "verifier", "Verification cites: the model gets the sources as plain text"

    # Who puts the [n] markers in: a model that cites well gets numbered sources; a small one
    # whose own markers are mostly wrong answers better from plain text after its instructions,
    # and verification attributes each sentence (docs/answers.md, "Prompts that fit the model").
    citing = models.CharField(max_length=16, choices=Citing.choices, default=Citing.MODEL)
    stop = models.JSONField(
        default=list,
        blank=True,
        help_text='Stop sequences of a request that sets none, as OpenAI\'s "stop" (at most 4): ["\\n\\n"] ends '
        "an answer with its first paragraph.",
    )
    abstains = models.BooleanField(
        default=True,
        help_text="Decline, with the closest passages, when the retrieved passages do not answer the question; "
        "quote them instead when nothing generated is supported by them (docs/answers.md); off: the model "
        "answers whatever was found.",
    )
    # The languages its model answers in (ISO 639-1 codes, as search.analysis names them): a
    # question in another is answered from the sources' own sentences, saying why; empty: any.
    languages = models.JSONField(
        default=list,
        blank=True,
        help_text='The languages the model answers in, e.g. ["en"] or ["ja", "en"]; a question in another is'
        " answered with the sources' own sentences. Empty: any.",
    )
    enabled = models.BooleanField(default=True)
    fallbacks = models.ManyToManyField(
        "self", through="RouteFallback", through_fields=("route", "fallback"), symmetrical=False, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.UniqueConstraint(fields=["is_default"], condition=Q(is_default=True), name="route_one_default"),
            models.CheckConstraint(condition=Q(temperature__gte=0), name="route_temperature_non_negative"),
            models.CheckConstraint(condition=Q(top_p__gt=0, top_p__lte=1), name="route_top_p_in_range"),
        ]

    def __str__(self) -> str:
        return self.name

    def answers_in(self, language: str) -> bool:
        """Whether its model answers a question in ``language`` (an ISO 639-1 code)."""
        return not self.languages or language in self.languages

    def fallback_routes(self) -> list[Route]:
        """The fallbacks in their order (enabled ones only)."""
        return [
            link.fallback
            for link in self.fallback_links.select_related("fallback__provider").order_by("position")
            if link.fallback.enabled
        ]

    def clean(self) -> None:
        stop = self.stop if self.stop is not None else []
        if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
            raise ValidationError({"stop": 'stop must be a list of at most 4 non-empty strings, like ["\\n\\n"].'})
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValidationError({"top_p": f"top_p must be in (0, 1], got {self.top_p}."})
        if self.provider_id and self.max_tokens and self.max_tokens >= self.provider.context_window:
            raise ValidationError(
                {
                    "max_tokens": f"max_tokens ({self.max_tokens}) leaves no room for a prompt in "
                    f"{self.provider}'s context window of {self.provider.context_window} tokens."
                }
            )


class RouteFallback(models.Model):
    route = models.ForeignKey(Route, on_delete=models.CASCADE, related_name="fallback_links")
    fallback = models.ForeignKey(Route, on_delete=models.CASCADE, related_name="fallback_for")
    position = models.PositiveSmallIntegerField(default=0)

    class Meta:
        ordering = ["route", "position"]
        constraints = [
            models.UniqueConstraint(fields=["route", "fallback"], name="routefallback_unique"),
            models.CheckConstraint(condition=~Q(route=F("fallback")), name="routefallback_not_itself"),
        ]

    def __str__(self) -> str:
        return f"{self.route} -> {self.fallback} (#{self.position})"


class CanaryRelease(models.Model):
    class State(models.TextChoices):
        RUNNING = "running", "Running"
        PAUSED = "paused", "Paused"
        PROMOTED = "promoted", "Promoted"
        ROLLED_BACK = "rolled_back", "Rolled back"

    LIVE_STATES = (State.RUNNING, State.PAUSED)

    name = models.CharField(max_length=200)
    stable_route = models.ForeignKey(Route, on_delete=models.PROTECT, related_name="releases_as_stable")
    canary_route = models.ForeignKey(Route, on_delete=models.PROTECT, related_name="releases_as_canary")
    percent = models.DecimalField(
        max_digits=5,
        decimal_places=2,
        default=Decimal("0"),
        validators=[MinValueValidator(Decimal("0")), MaxValueValidator(Decimal("100"))],
        help_text="Share of the stable route's clients sent to the canary (0.01 steps).",
    )
    step_percent = models.DecimalField(
        max_digits=5,
        decimal_places=2,
        default=Decimal("10"),
        validators=[MinValueValidator(Decimal("0.01")), MaxValueValidator(Decimal("100"))],
        help_text="How much one promotion step adds.",
    )
    auto_promote = models.BooleanField(default=False, help_text="Add a step after each healthy window.")
    state = models.CharField(max_length=16, choices=State.choices, default=State.RUNNING)
    # Thresholds, canary against stable over one window.
    max_error_rate = models.DecimalField(
        max_digits=5,
        decimal_places=4,
        default=Decimal("0.05"),
        validators=[MinValueValidator(Decimal("0")), MaxValueValidator(Decimal("1"))],
    )
    max_p99_latency_ratio = models.DecimalField(
        max_digits=6, decimal_places=3, default=Decimal("1.5"), validators=[MinValueValidator(Decimal("1"))]
    )
    max_ttft_ratio = models.DecimalField(
        max_digits=6,
        decimal_places=3,
        default=Decimal("1.5"),
        validators=[MinValueValidator(Decimal("1"))],
        help_text="Maximum p99 time to first token, canary over stable.",
    )
    min_requests = models.PositiveIntegerField(
        default=20, help_text="Canary requests a window needs before it is judged."
    )
    window_seconds = models.PositiveIntegerField(default=300, validators=[MinValueValidator(10)])
    failing_windows_to_rollback = models.PositiveSmallIntegerField(default=2, validators=[MinValueValidator(1)])
    # What the analysis keeps between runs.
    consecutive_failing_windows = models.PositiveSmallIntegerField(default=0)
    last_analysis_at = models.DateTimeField(null=True, blank=True)
    last_analysis = models.JSONField(default=dict, blank=True)
    ended_reason = models.TextField(blank=True, help_text="Why it was rolled back or promoted.")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["stable_route"], condition=Q(state__in=["running", "paused"]), name="canary_one_live_per_route"
            ),
            models.CheckConstraint(condition=~Q(stable_route=F("canary_route")), name="canary_routes_differ"),
            models.CheckConstraint(condition=Q(percent__gte=0, percent__lte=100), name="canary_percent_in_range"),
        ]

    def __str__(self) -> str:
        return f"{self.name}: {self.stable_route} -> {self.canary_route} at {self.percent}%"

    @property
    def is_live(self) -> bool:
        return self.state in self.LIVE_STATES

    def clean(self) -> None:
        if self.stable_route_id and self.stable_route_id == self.canary_route_id:
            raise ValidationError({"canary_route": "The canary route must differ from the stable route."})


class CanaryEvent(models.Model):
    """One change to a release, by an operator or by the analysis, with the reason."""

    class Action(models.TextChoices):
        STARTED = "started", "Started"
        PERCENT_SET = "percent_set", "Percent set"
        STEPPED = "stepped", "Promoted one step"
        PAUSED = "paused", "Paused"
        RESUMED = "resumed", "Resumed"
        PROMOTED = "promoted", "Promoted to 100%"
        ROLLED_BACK = "rolled_back", "Rolled back"
        WINDOW_FAILED = "window_failed", "Window failed its thresholds"

    release = models.ForeignKey(CanaryRelease, on_delete=models.CASCADE, related_name="events")
    action = models.CharField(max_length=16, choices=Action.choices)
    percent_from = models.DecimalField(max_digits=5, decimal_places=2, null=True, blank=True)
    percent_to = models.DecimalField(max_digits=5, decimal_places=2, null=True, blank=True)
    reason = models.TextField(blank=True)
    metrics = models.JSONField(default=dict, blank=True)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["release", "-created_at"], name="canaryevent_release_time")]

    def __str__(self) -> str:
        return f"{self.release_id} {self.action} at {self.created_at:%Y-%m-%d %H:%M:%S}"


class RoutingVersion(models.Model):
    """One row whose ``version`` changes whenever what a plan reads changes: providers,
    routes and their fallbacks, canary releases, and whether an upstream key can be used
    (its status or cooldown; not the bookkeeping every request writes). PostgreSQL triggers
    set it (migration 0002), so every writer counts: the admin, ``QuerySet.update``, the key
    pool, plain SQL. ``inference.router`` keeps its resolved routes per process and asks only
    for this number on each request. Values come from a sequence: they never repeat, even
    after the table is emptied."""

    id = models.PositiveSmallIntegerField(primary_key=True, default=1)
    version = models.BigIntegerField()

    class Meta:
        db_table = "inference_routingversion"

    def __str__(self) -> str:
        return f"routing version {self.version}"
