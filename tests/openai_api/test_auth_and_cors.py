"""The guard: auth on every protected route (path and host tricks included) and CORS."""

from __future__ import annotations

import pytest

from tests.openai_api.common import API_KEY, AUTH, ORIGIN, assert_openai_error, chat_body, completion, raw_request

pytestmark = pytest.mark.serve


def test_auth_on_every_protected_route(root, anonymous):
    protected = [
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", completion()),
        ("POST", "/v1/chat/completions", chat_body()),
        ("POST", "/tokenize", {"prompt": "hi"}),
        ("POST", "/detokenize", {"tokens": [1, 2]}),
        ("GET", "/v1/does-not-exist", None),
    ]
    for method, path, body in protected:
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": API_KEY}, {"Authorization": ""}):
            response = anonymous.request(method, path, json=body, headers=headers)
            error = assert_openai_error(response, 401)
            assert error["type"] == "AuthenticationError"
            assert response.headers.get("www-authenticate") == "Bearer"
        with_key = anonymous.request(method, path, json=body, headers=AUTH)
        assert with_key.status_code == (404 if "does-not-exist" in path else 200), (path, with_key.text)
    for path in ("/health", "/metrics", "/version"):
        assert anonymous.get(path).status_code == 200, path


@pytest.mark.parametrize(
    "target",
    [
        "/conf/v1/../v1/models",
        "/conf//v1/models",
        "/conf/v1/models/",
        "/conf/V1/models",
        "/conf/health/../v1/models",
        "/conf/metrics/../v1/models",
        "/conf/./v1/models",
        "/conf/v1/models?x=/health",
        "/conf/v1%2fmodels",
        "/conf/%2e%2e/conf/v1/models",
        "/conf/health/%2e%2e/v1/models",
        "/conf/v1/models#/health",
        "/conf/health%00/../v1/models",
        "http://127.0.0.1/conf/v1/models",
    ],
)
def test_path_tricks_do_not_skip_auth(serve_port, root, target):
    status, reply = raw_request(serve_port, "GET", target)
    assert status in (400, 401, 404), reply[:400]
    assert b'"object": "list"' not in reply and b'"object":"list"' not in reply


def test_spoofed_host_does_not_skip_auth(serve_port, root):
    for host in ("localhost", "evil.example", "127.0.0.1:1", "internal"):
        status, reply = raw_request(serve_port, "GET", "/conf/v1/models", {"Host": host})
        assert status in (400, 401, 404), (host, reply[:400])
    for forwarded in (
        {"X-Forwarded-For": "127.0.0.1"},
        {"X-Original-URL": "/conf/health"},
        {"X-Forwarded-Prefix": "/x"},
    ):
        status, reply = raw_request(serve_port, "GET", "/conf/v1/models", forwarded)
        assert status == 401, (forwarded, reply[:400])
    status, _ = raw_request(serve_port, "GET", "/conf/v1/models", AUTH)
    assert status == 200


# ---------------------------------------------------------------------------------------------------------------------
# CORS


def test_cors(anonymous, http):
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    allowed = anonymous.options("/v1/chat/completions", headers={"Origin": ORIGIN, **preflight})
    assert allowed.status_code in (200, 204)
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in allowed.headers["access-control-allow-methods"]
    assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
    denied = anonymous.options("/v1/chat/completions", headers={"Origin": "https://evil.example", **preflight})
    assert "access-control-allow-origin" not in denied.headers
    assert "access-control-allow-methods" not in denied.headers
    # Actual requests: the allowed origin can read the answer (errors included), another origin cannot.
    ok = http.get("/v1/models", headers={"Origin": ORIGIN})
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == ORIGIN
    unauthorized = anonymous.get("/v1/models", headers={"Origin": ORIGIN})
    assert unauthorized.status_code == 401
    assert unauthorized.headers["access-control-allow-origin"] == ORIGIN
    other = http.get("/v1/models", headers={"Origin": "https://evil.example"})
    assert other.status_code == 200
    assert "access-control-allow-origin" not in other.headers
    assert "access-control-allow-origin" not in http.get("/v1/models").headers
