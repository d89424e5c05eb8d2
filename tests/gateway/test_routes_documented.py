"""docs/gateway.md's route tables list exactly the routes the gateway serves: a route added without
its row, or a row left behind by a removed route, fails here."""

import re
from pathlib import Path
from typing import Any

from inharness.gateway.app import create_app
from inharness.gateway.settings import GatewaySettings

DOC = Path(__file__).resolve().parents[2] / "docs" / "gateway.md"
KEY_PREFIX = "/t/{token}"


def served_paths() -> dict[str, set[str]]:
    """Path -> methods, from the gateway's own OpenAPI document (every route is in it)."""
    paths = create_app(GatewaySettings(model="unused", admin_token="t" * 8)).openapi()["paths"]
    return {path: {m.upper() for m in ops} for path, ops in paths.items()}


def served() -> set[str]:
    return {
        f"{m} {path}" for path, ms in served_paths().items() if not path.startswith(KEY_PREFIX) for m in ms
    }


def documented() -> set[str]:
    rows = [line for line in DOC.read_text().splitlines() if line.startswith("| `")]
    first_cells = [row.split(" | ")[0] for row in rows]
    return {m for cell in first_cells for m in re.findall(r"`((?:GET|POST|PUT|PATCH|DELETE) /[^` ?]*)", cell)}


def test_every_served_route_has_a_row_and_every_row_a_route() -> None:
    assert served() == documented()


def test_each_harness_route_is_also_served_under_the_key_prefix() -> None:
    paths = set(served_paths())
    harness = {p for p in paths if p.startswith("/v1/")}
    assert harness and {KEY_PREFIX + p for p in harness} <= paths


def test_the_served_openapi_document_validates() -> None:
    """Against the OpenAPI 3.1 specification: a path parameter the document does not declare (the
    `/t/{token}` prefix's, once) makes client generators and fuzzers refuse the route."""
    from openapi_spec_validator import validate

    doc = create_app(GatewaySettings(model="unused", admin_token="t" * 8)).openapi()
    validate(doc)
    for path, ops in doc["paths"].items():
        if path.startswith(KEY_PREFIX):
            for op in ops.values():
                assert {"name": "token", "in": "path"}.items() <= op["parameters"][0].items(), (path, op)


def _bounded(schema: dict[str, Any]) -> bool:
    """A parameter's schema bounds every value it admits: a length, a range, a set, or a boolean."""
    if "anyOf" in schema:
        return all(_bounded(s) for s in schema["anyOf"])
    kind = schema.get("type")
    if "enum" in schema or kind in ("boolean", "null"):
        return True
    if kind == "string":
        return "maxLength" in schema
    if kind == "integer":
        return "maximum" in schema and "minimum" in schema
    return False


def test_every_path_and_query_parameter_is_bounded_in_the_document() -> None:
    """What an outside fuzzer found: an export cursor the schema left unbounded (23 digits) reached the
    store, which could not hold it, after the response had begun. The document now states every bound
    the handlers enforce, so a client generator or fuzzer produces what the gateway accepts."""
    doc = create_app(GatewaySettings(model="unused", admin_token="t" * 8)).openapi()
    params = [
        (path, p["name"], p["schema"])
        for path, ops in doc["paths"].items()
        for op in ops.values()
        for p in op.get("parameters", [])
        if p["in"] in ("path", "query")
    ]
    assert len(params) > 10
    assert [(path, name) for path, name, schema in params if not _bounded(schema)] == []
