"""The operator console: providers refuse invalid speculative settings, and a GPU pool without
engine servers (or with a base URL), on the right field; upstream keys are write-only and
stored encrypted, routes keep their fallbacks in order, canary actions go through the
service functions, and the ledger is read-only."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.db import connection
from django.urls import reverse

from billing.models import UsageRecord
from inference import canary
from inference.models import CanaryEvent, CanaryRelease, Provider, Route, UpstreamKey

SECRET = "sk-test-Zq8w4TfR1yV7uN3pXk5LbC2m9aHd"
DEVICE = "http://127.0.0.1:8100/v1"


def url(name: str, *args) -> str:
    return reverse(f"admin:{name}", args=args)


def provider_data(**overrides) -> dict:
    data = {
        "name": "pool",
        "kind": "local",
        "base_url": "",
        "devices": DEVICE,
        "model": "tiny",
        "context_window": "4096",
        "enabled": "on",
        "speculative_method": "off",
        "draft_model": "",
        "speculative_k": "4",
        "connect_timeout_s": "5",
        "first_token_timeout_s": "30",
        "total_timeout_s": "300",
        "extra_body": "{}",
    }
    data.update(overrides)
    return data


def form_errors(response) -> dict:
    return {name: list(errors) for name, errors in response.context["adminform"].form.errors.items()}


def change_form_data(response) -> dict:
    """What a browser would post back from an admin change page, unchanged."""
    data = {}

    def add(form):
        for name, field in form.fields.items():
            value = form[name].value()
            key = form.add_prefix(name)
            if (
                isinstance(value, bool) or field.widget.input_type == "checkbox"
                if hasattr(field.widget, "input_type")
                else False
            ):
                if value:
                    data[key] = "on"
            elif value is not None:
                data[key] = str(value)

    add(response.context["adminform"].form)
    for inline in response.context["inline_admin_formsets"]:
        formset = inline.formset
        add(formset.management_form)
        for form in formset.forms:
            add(form)
    return data


@pytest.fixture
def provider(db):
    return Provider.objects.create(
        name="upstream", kind=Provider.Kind.OPENAI_COMPATIBLE, base_url="http://127.0.0.1:9/v1", model="m"
    )


# -- providers ----------------------------------------------------------------------------


def test_a_valid_provider_is_saved(admin_client):
    response = admin_client.post(
        url("inference_provider_add"), provider_data(devices=f"{DEVICE},http://127.0.0.1:8101/v1")
    )
    assert response.status_code == 302, form_errors(response)
    saved = Provider.objects.get(name="pool")
    assert saved.speculative_method == "off"
    assert (saved.base_url, saved.devices) == ("", [DEVICE, "http://127.0.0.1:8101/v1"])
    listing = admin_client.get(url("inference_provider_changelist")).content.decode()
    assert "pool" in listing and "0 / 0" in listing


@pytest.mark.parametrize(
    ("overrides", "field", "message"),
    [
        pytest.param(
            {"speculative_method": "draft"},
            "draft_model",
            "Speculative method 'draft' needs a draft model.",
        ),
        pytest.param(
            {"speculative_method": "eagle3"},
            "draft_model",
            "Speculative method 'eagle3' needs a draft model.",
        ),
        pytest.param(
            {"speculative_method": "both"},
            "draft_model",
            "Speculative method 'both' needs a draft model.",
        ),
        pytest.param(
            {"speculative_k": "0"},
            "speculative_k",
            "k must be between 1 and 16, got 0.",
        ),
        pytest.param(
            {"speculative_k": "17"},
            "speculative_k",
            "k must be between 1 and 16, got 17.",
        ),
        (
            {
                "kind": "openai-compatible",
                "base_url": "http://localhost:8001/v1",
                "devices": "",
                "speculative_method": "both",
                "draft_model": "d",
            },
            "speculative_method",
            "'N-grams, else the draft model' has no equivalent on a vLLM-style endpoint; choose one proposer.",
        ),
        (
            {"kind": "openai-compatible", "devices": ""},
            "base_url",
            "An OpenAI-compatible provider needs the endpoint's base URL, e.g. https://host/v1.",
        ),
    ],
)
def test_invalid_speculative_settings_are_refused_on_their_field(admin_client, overrides, field, message):
    response = admin_client.post(url("inference_provider_add"), provider_data(**overrides))
    assert response.status_code == 200
    assert form_errors(response) == {field: [message]}
    assert not Provider.objects.exists()


def test_the_provider_form_asks_for_devices(admin_client):
    page = admin_client.get(url("inference_provider_add")).content.decode()
    assert 'name="devices"' in page


@pytest.mark.parametrize(
    ("overrides", "field", "message"),
    [
        (
            {"devices": ""},
            "devices",
            "A GPU pool needs the base URL of at least one engine server, e.g. http://127.0.0.1:8100/v1.",
        ),
        ({"base_url": DEVICE}, "base_url", "A GPU pool has no base URL: list its engine servers under devices."),
        ({"devices": f"{DEVICE},{DEVICE}"}, "devices", "A device is listed twice."),
    ],
)
def test_a_pool_needs_devices_and_no_base_url(admin_client, overrides, field, message):
    response = admin_client.post(url("inference_provider_add"), provider_data(**overrides))
    assert response.status_code == 200
    assert form_errors(response) == {field: [message]}
    assert not Provider.objects.exists()


def test_an_upstream_has_no_devices(admin_client):
    response = admin_client.post(
        url("inference_provider_add"), provider_data(kind="openai-compatible", base_url="http://localhost:8001/v1")
    )
    assert response.status_code == 200
    assert form_errors(response) == {
        "devices": ["Only a GPU pool has devices; an OpenAI-compatible provider has a base URL."]
    }
    assert not Provider.objects.exists()


def test_the_database_refuses_a_pool_without_devices(db):
    from django.db import IntegrityError, transaction

    with pytest.raises(IntegrityError) as refused, transaction.atomic():
        Provider.objects.create(name="bare", kind=Provider.Kind.LOCAL, model="tiny")
    assert "provider_pool_has_devices" in str(refused.value)
    pool = Provider.objects.create(name="pool", kind=Provider.Kind.LOCAL, model="tiny", devices=[DEVICE])
    with pytest.raises(IntegrityError) as refused, transaction.atomic():
        Provider.objects.filter(pk=pool.pk).update(devices=[])
    assert "provider_pool_has_devices" in str(refused.value)
    # An upstream needs none.
    Provider.objects.create(name="upstream", kind=Provider.Kind.OPENAI_COMPATIBLE, base_url=DEVICE, model="m")


# -- upstream keys ------------------------------------------------------------------------


def test_a_key_added_in_the_admin_is_stored_encrypted_and_shown_by_its_last_four_only(admin_client, provider):
    response = admin_client.post(
        url("inference_upstreamkey_add"), {"provider": provider.pk, "label": "team 1", "secret": f"  {SECRET} "}
    )
    assert response.status_code == 302, form_errors(response)
    key = UpstreamKey.objects.get()
    assert (key.label, key.last_four, key.status) == ("team 1", SECRET[-4:], "active")
    assert key.secret() == SECRET

    # No column of the table holds the key, nor does the admin's own log.
    with connection.cursor() as cursor:
        cursor.execute("SELECT * FROM inference_upstreamkey")
        rows = cursor.fetchall()
        cursor.execute("SELECT * FROM django_admin_log")
        rows += cursor.fetchall()
    assert rows
    for row in rows:
        for value in row:
            assert SECRET not in str(value)
            assert SECRET[4:-4] not in str(value)

    listing = admin_client.get(url("inference_upstreamkey_changelist")).content.decode()
    assert f"…{SECRET[-4:]}" in listing
    change = admin_client.get(url("inference_upstreamkey_change", key.pk)).content.decode()
    for page in (listing, change):
        assert SECRET not in page
        assert SECRET[:-4] not in page
        assert key.secret_encrypted not in page
        assert key.fingerprint not in page
    assert 'type="password"' in change


def test_a_key_without_a_secret_or_twice_the_same_is_refused(admin_client, provider):
    response = admin_client.post(url("inference_upstreamkey_add"), {"provider": provider.pk, "label": "k"})
    assert form_errors(response) == {"secret": ["This field is required."]}
    admin_client.post(url("inference_upstreamkey_add"), {"provider": provider.pk, "label": "k", "secret": SECRET})
    response = admin_client.post(
        url("inference_upstreamkey_add"), {"provider": provider.pk, "label": "again", "secret": SECRET}
    )
    assert form_errors(response) == {"secret": [f"This key is already stored for upstream as 'k' (…{SECRET[-4:]})."]}
    assert UpstreamKey.objects.count() == 1


def test_editing_a_key_keeps_its_secret_unless_a_new_one_is_given_and_keeps_the_pools_counters(admin_client, provider):
    key = UpstreamKey(provider=provider, label="k")
    key.set_secret(SECRET)
    key.save()
    change = url("inference_upstreamkey_change", key.pk)
    # The key pool updates the row meanwhile: the admin's save must not undo that.
    UpstreamKey.objects.filter(pk=key.pk).update(failure_count=7, consecutive_failures=3)
    response = admin_client.post(change, {"provider": provider.pk, "label": "renamed", "secret": ""})
    assert response.status_code == 302, form_errors(response)
    key.refresh_from_db()
    assert (key.label, key.secret(), key.failure_count, key.consecutive_failures) == ("renamed", SECRET, 7, 3)

    response = admin_client.post(change, {"provider": provider.pk, "label": "renamed", "secret": "sk-new-key-0042"})
    assert response.status_code == 302
    key.refresh_from_db()
    assert (key.secret(), key.last_four) == ("sk-new-key-0042", "0042")


def test_re_enable_and_disable_actions(admin_client, provider, admin_user):
    key = UpstreamKey(
        provider=provider,
        label="k",
        status=UpstreamKey.Status.DISABLED,
        disabled_reason="401 from upstream: the key was revoked",
        consecutive_failures=4,
        failure_count=9,
    )
    key.set_secret(SECRET)
    key.save()
    listing = admin_client.get(url("inference_upstreamkey_changelist")).content.decode()
    assert "401 from upstream: the key was revoked" in listing

    response = admin_client.post(
        url("inference_upstreamkey_changelist"), {"action": "re_enable", "_selected_action": [key.pk]}
    )
    assert response.status_code == 302
    key.refresh_from_db()
    assert (key.status, key.disabled_reason, key.consecutive_failures, key.failure_count) == ("active", "", 0, 9)

    admin_client.post(url("inference_upstreamkey_changelist"), {"action": "disable", "_selected_action": [key.pk]})
    key.refresh_from_db()
    assert (key.status, key.disabled_reason) == ("disabled", f"disabled by {admin_user} in the admin")


# -- routes -------------------------------------------------------------------------------


def test_a_route_keeps_its_fallbacks_in_order(admin_client, provider):
    first = Route.objects.create(name="first", provider=provider)
    second = Route.objects.create(name="second", provider=provider)
    data = {
        "name": "main",
        "provider": provider.pk,
        "description": "",
        "max_tokens": "512",
        "temperature": "0",
        "top_p": "1",
        "system_prompt": "",
        "max_sources": "8",
        "max_source_tokens": "",
        "citing": "model",
        "stop": "[]",
        "abstains": "on",
        "enabled": "on",
        "fallback_links-TOTAL_FORMS": "2",
        "fallback_links-INITIAL_FORMS": "0",
        "fallback_links-0-position": "2",
        "fallback_links-0-fallback": first.pk,
        "fallback_links-1-position": "1",
        "fallback_links-1-fallback": second.pk,
    }
    response = admin_client.post(url("inference_route_add"), data)
    assert response.status_code == 302, response.context and form_errors(response)
    main = Route.objects.get(name="main")
    assert [route.name for route in main.fallback_routes()] == ["second", "first"]
    assert "second -&gt; first" in admin_client.get(url("inference_route_changelist")).content.decode()

    # A route cannot fall back to itself.
    page = admin_client.get(url("inference_route_change", main.pk))
    data = change_form_data(page)
    data.update({"fallback_links-TOTAL_FORMS": "3", "fallback_links-2-position": "3"})
    data["fallback_links-2-fallback"] = main.pk
    response = admin_client.post(url("inference_route_change", main.pk), data)
    assert response.status_code == 200
    [inline] = response.context["inline_admin_formsets"]
    assert inline.formset.errors[2] == {"fallback": ["A route cannot fall back to itself."]}


# -- canary releases ----------------------------------------------------------------------


@pytest.fixture
def routes(provider):
    other = Provider.objects.create(name="pool", kind=Provider.Kind.LOCAL, devices=[DEVICE], model="tiny")
    return Route.objects.create(name="default", provider=provider), Route.objects.create(name="v2", provider=other)


def release_data(stable, candidate, **overrides) -> dict:
    data = {
        "name": "try v2",
        "stable_route": stable.pk,
        "canary_route": candidate.pk,
        "percent": "5",
        "step_percent": "20",
        "max_error_rate": "0.05",
        "max_p99_latency_ratio": "1.5",
        "max_ttft_ratio": "1.5",
        "min_requests": "20",
        "window_seconds": "300",
        "failing_windows_to_rollback": "2",
    }
    data.update(overrides)
    return data


def events(release) -> list[tuple]:
    return list(release.events.order_by("id").values_list("action", "percent_from", "percent_to", "actor"))


def test_canary_release_lifecycle_in_the_admin(admin_client, admin_user, routes):
    stable, candidate = routes
    response = admin_client.post(url("inference_canaryrelease_add"), release_data(stable, candidate))
    assert response.status_code == 302, form_errors(response)
    release = CanaryRelease.objects.get()
    assert (release.state, release.percent) == ("running", Decimal("5.00"))

    # A second live release on the same stable route is refused on that field.
    response = admin_client.post(url("inference_canaryrelease_add"), release_data(stable, candidate, name="again"))
    assert form_errors(response) == {
        "stable_route": ["Route default already has a live release ('try v2'); promote or roll it back first."]
    }

    # Editing the percent in the form goes through set_percent; other fields are saved as they are.
    change = url("inference_canaryrelease_change", release.pk)
    data = change_form_data(admin_client.get(change))
    data.update({"percent": "15", "min_requests": "30"})
    response = admin_client.post(change, data)
    assert response.status_code == 302, form_errors(response)
    release.refresh_from_db()
    assert (release.percent, release.min_requests) == (Decimal("15.00"), 30)

    # A page opened before a step of the analysis cannot put the old percent back.
    stale = change_form_data(admin_client.get(change))
    canary.canary_release_percent_set(release, 20)
    response = admin_client.post(change, stale)
    assert form_errors(response) == {
        "percent": [
            "The percent changed from 15.00 to 20.00 while this page was open (see the history below); check it "
            "and save again."
        ]
    }
    # Saved again from the page the error shows, the operator's value is applied.
    response = admin_client.post(change, change_form_data(response) | {"percent": "15"})
    assert response.status_code == 302, form_errors(response)
    release.refresh_from_db()
    assert release.percent == Decimal("15.00")

    changelist = url("inference_canaryrelease_changelist")
    for action in ("apply_step", "pause_releases", "resume_releases"):
        response = admin_client.post(changelist, {"action": action, "_selected_action": [release.pk]})
        assert response.status_code == 302
    # Resuming a running release is refused, with the reason shown.
    response = admin_client.post(
        changelist, {"action": "resume_releases", "_selected_action": [release.pk]}, follow=True
    )
    assert "Cannot resume release &#x27;try v2&#x27;: it is running." in response.content.decode()

    # Roll back asks for a reason first, then records it.
    response = admin_client.post(changelist, {"action": "roll_back_releases", "_selected_action": [release.pk]})
    assert response.status_code == 200
    assert "Roll back canary releases" in response.content.decode()
    release.refresh_from_db()
    assert release.state == "running"
    response = admin_client.post(
        changelist,
        {"action": "roll_back_releases", "_selected_action": [release.pk], "apply": "1", "reason": "wrong citations"},
    )
    assert response.status_code == 302
    release.refresh_from_db()
    assert (release.state, release.percent, release.ended_reason) == ("rolled_back", Decimal("0"), "wrong citations")

    Action = CanaryEvent.Action
    assert events(release) == [
        (Action.STARTED, None, Decimal("5.00"), admin_user.pk),
        (Action.PERCENT_SET, Decimal("5.00"), Decimal("15.00"), admin_user.pk),
        (Action.PERCENT_SET, Decimal("15.00"), Decimal("20.00"), None),
        (Action.PERCENT_SET, Decimal("20.00"), Decimal("15.00"), admin_user.pk),
        (Action.STEPPED, Decimal("15.00"), Decimal("35.00"), admin_user.pk),
        (Action.PAUSED, Decimal("35.00"), Decimal("35.00"), admin_user.pk),
        (Action.RESUMED, Decimal("35.00"), Decimal("35.00"), admin_user.pk),
        (Action.ROLLED_BACK, Decimal("35.00"), Decimal("0.00"), admin_user.pk),
    ]
    page = admin_client.get(change).content.decode()
    assert "wrong citations" in page and "Rolled back: why" in page
    listing = admin_client.get(changelist).content.decode()
    assert "try v2" in listing and "Rolled back" in listing


def test_promote_action_and_the_last_analysis_on_the_change_page(admin_client, routes):
    stable, candidate = routes
    release = canary.canary_release_start(name="r", stable_route=stable, canary_route=candidate, percent=Decimal("10"))
    release.last_analysis = {
        "verdict": "healthy",
        "window": {"start": "2026-01-01T00:00:00+00:00", "end": "2026-01-01T00:05:00+00:00", "seconds": 300},
        "percent": "10.00",
        "arms": {
            "stable": {"requests": 90, "errors": 1, "error_rate": 1 / 90, "p99_latency_ms": 1200.4, "p99_ttft_ms": 80},
            "canary": {"requests": 10, "errors": 0, "error_rate": 0.0, "p99_latency_ms": 900.0, "p99_ttft_ms": None},
        },
        "reasons": ["p99 latency and TTFT not compared: stable had 5 requests < 20"],
        "action": "",
    }
    release.save()
    page = admin_client.get(url("inference_canaryrelease_change", release.pk)).content.decode()
    for text in ("healthy", "1.11%", "1200 ms", "900 ms", "p99 time to first token", "stable had 5 requests"):
        assert text in page

    response = admin_client.post(
        url("inference_canaryrelease_changelist"), {"action": "promote_releases", "_selected_action": [release.pk]}
    )
    assert response.status_code == 302
    release.refresh_from_db()
    stable.refresh_from_db()
    assert (release.state, stable.provider_id) == ("promoted", candidate.provider_id)


# -- the ledger ---------------------------------------------------------------------------


def test_the_ledger_is_read_only_and_filterable(admin_client, routes):
    stable, _ = routes
    error = UsageRecord.objects.create(status="error", arm="canary", route=stable, route_name="default")
    UsageRecord.objects.create(status="ok", arm="stable", route=stable, route_name="default")
    changelist = url("billing_usagerecord_changelist")
    response = admin_client.get(changelist, {"status__exact": "error", "arm__exact": "canary"})
    assert response.status_code == 200
    assert list(response.context["cl"].result_list) == [error]
    response = admin_client.get(changelist, {"route__id__exact": stable.pk, "provider__id__exact": stable.provider_id})
    assert response.status_code == 200
    assert admin_client.get(url("billing_usagerecord_add")).status_code == 403
    assert admin_client.get(url("billing_usagerecord_delete", error.pk)).status_code == 403
    view = admin_client.get(url("billing_usagerecord_change", error.pk))
    assert view.status_code == 200 and b"Save" not in view.content
    assert admin_client.post(url("billing_usagerecord_change", error.pk), {"status": "ok"}).status_code == 403
    error.refresh_from_db()
    assert error.status == "error"
