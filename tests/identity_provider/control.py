"""The tests' control door of the test provider: JSON in, JSON out, loopback only."""

import json

from django.conf import settings
from django.contrib.auth.models import Group, User
from django.http import JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST
from oauth2_provider.models import Application

FAULTS = settings.DATA / "faults.json"


@csrf_exempt
@require_POST
def client_set(request):
    """Register (or re-register) the relying party: a confidential client of the code flow."""
    body = json.loads(request.body)
    Application.objects.filter(client_id=body["client_id"]).delete()
    Application.objects.create(
        name="RAG search",
        client_id=body["client_id"],
        client_secret=body["client_secret"],
        client_type=Application.CLIENT_CONFIDENTIAL,
        authorization_grant_type=Application.GRANT_AUTHORIZATION_CODE,
        redirect_uris=" ".join(body["redirect_uris"]),
        post_logout_redirect_uris=" ".join(body.get("post_logout_redirect_uris", [])),
        algorithm=Application.RS256_ALGORITHM,
        skip_authorization=True,
    )
    return JsonResponse({"ok": True})


@csrf_exempt
@require_POST
def user_set(request):
    """Create or change a user: password, e-mail, name, active, and exactly these groups."""
    body = json.loads(request.body)
    user, _ = User.objects.get_or_create(username=body["username"])
    user.set_password(body.get("password", "password"))
    user.email = body.get("email", "")
    user.first_name, _, user.last_name = body.get("name", "").partition(" ")
    user.is_active = body.get("active", True)
    user.save()
    user.groups.set([Group.objects.get_or_create(name=name)[0] for name in body.get("groups", [])])
    return JsonResponse({"subject": str(user.pk)})


@csrf_exempt
@require_POST
def faults_set(request):
    """What the next ID tokens get wrong: {"expired": true}, {"audience": "..."}, {"forged": true}."""
    FAULTS.write_text(request.body.decode())
    return JsonResponse({"ok": True})


def faults() -> dict:
    return json.loads(FAULTS.read_text()) if FAULTS.exists() else {}
