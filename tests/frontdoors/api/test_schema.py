"""The OpenAPI schema and the interactive docs: valid OpenAPI 3, every endpoint described with
its errors, generated without warnings, and the docs page served with our own files (no CDN)."""

from __future__ import annotations

import json
import re

import pytest
from django.core.management import call_command
from drf_spectacular.validation import validate_schema

pytestmark = pytest.mark.django_db

ENDPOINTS = {
    "/api/v1/collections": {"get", "post"},
    "/api/v1/collections/{collection_id}": {"get"},
    "/api/v1/documents": {"get", "post"},
    "/api/v1/documents/{document_id}": {"get", "delete"},
    "/api/v1/documents/{document_id}/file": {"get"},
    "/api/v1/documents/{document_id}/retry": {"post"},
    "/api/v1/documents/{document_id}/readers": {"post"},
    "/api/v1/search": {"get", "post"},
    "/api/v1/answers": {"post"},
    "/api/v1/answers/{answer_id}": {"get"},
    "/api/v1/answers/{answer_id}/stream": {"get"},
    "/api/v1/conversations": {"get", "post"},
    "/api/v1/conversations/{conversation_id}": {"get", "patch", "delete"},
    "/api/v1/usage": {"get"},
}


@pytest.fixture(scope="module")
def schema(django_db_blocker):
    from django.test import Client

    with django_db_blocker.unblock():
        response = Client().get("/api/schema/", {"format": "json"})
    assert response.status_code == 200
    return json.loads(response.content)


def test_the_schema_is_valid_openapi_3_and_describes_every_endpoint(schema):
    validate_schema(schema)
    assert schema["openapi"].startswith("3.")
    assert {path: set(operations) for path, operations in schema["paths"].items()} == ENDPOINTS
    assert set(schema["components"]["securitySchemes"]) == {"apiKey", "cookieAuth"}
    assert schema["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"


def test_every_operation_documents_its_errors_in_the_one_shape(schema):
    error_ref = {"$ref": "#/components/schemas/Error"}
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            statuses = set(operation["responses"])
            assert {"400", "401", "403", "404"} <= statuses, (method, path)
            for status, response in operation["responses"].items():
                if status.startswith(("4", "5")):
                    assert response["content"]["application/json"]["schema"] == error_ref, (method, path, status)
            assert any(parameter["name"] == "workspace" for parameter in operation["parameters"]), (method, path)
    error = schema["components"]["schemas"]["ErrorDetail"]
    assert set(error["properties"]) == {"code", "message", "field"} and error["required"] == ["code", "message"]
    answers = schema["paths"]["/api/v1/answers"]["post"]["responses"]
    assert {"200", "202", "402", "429", "503"} <= set(answers)
    stream = schema["paths"]["/api/v1/answers/{answer_id}/stream"]["get"]
    assert "text/event-stream" in stream["responses"]["200"]["content"]
    upload = schema["paths"]["/api/v1/documents"]["post"]["requestBody"]["content"]
    assert set(upload) == {"multipart/form-data"}


def test_the_schema_is_generated_without_warnings(tmp_path):
    # --fail-on-warn: a field whose type drf-spectacular had to guess fails here.
    call_command("spectacular", "--validate", "--fail-on-warn", "--file", str(tmp_path / "schema.yaml"))


def test_the_docs_page_uses_only_files_we_serve(client):
    page = client.get("/api/docs/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "cdn" not in html.lower() and "https://" not in html
    assets = re.findall(r'(?:src|href)="(/static/[^"]+)"', html)
    assert any(asset.endswith("swagger-ui-bundle.js") for asset in assets), assets
    for asset in assets:
        assert client.get(asset).status_code == 200, asset
