"""HTTP hygiene before any route runs: header limits, API key, CORS, body size, content type.

Auth is decided on the ASGI scope path, deny by default: every path needs the key except a fixed set of open
endpoints, so no `..`, double slash, case or Host-header trick reaches a protected route without it.
"""

from __future__ import annotations

import hmac
import os

from ray.exceptions import RayError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from configs.app_config import ServeConfig
from serve_app.protocol import error_body

OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})
# Ray Serve's proxy (uvicorn + httptools) takes header blocks of any size; past these a request is refused here,
# before any route runs (Apache allows 100 fields by default; 32 KiB holds big cookies and tokens).
MAX_HEADER_COUNT = 100
MAX_HEADER_BYTES = 32 * 1024
# The rest of an oversized body is unwanted: closing the connection stops the proxy from reading (and buffering) it.
CLOSE_CONNECTION = {"Connection": "close"}


class GuardError(Exception):
    def __init__(self, status: int, message: str, error_type: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.error_type, self.headers = status, message, error_type, headers or {}

    def response(self) -> Response:
        from starlette.responses import JSONResponse

        return JSONResponse(
            error_body(self.message, self.error_type, self.status), status_code=self.status, headers=self.headers
        )


class HttpGuard:
    def __init__(self, settings: ServeConfig):
        self.settings = settings
        api_key = settings.api_key or os.environ.get("PAGEDSERVE_API_KEY") or None
        self.expected_authorization = f"Bearer {api_key}".encode() if api_key else None
        self.allow_any_origin = "*" in settings.cors_allow_origins
        self.allowed_origins = frozenset(settings.cors_allow_origins)

    def check_headers(self, request: Request) -> None:
        headers = request.scope.get("headers", [])
        if len(headers) > MAX_HEADER_COUNT:
            raise GuardError(
                431,
                f"Request has {len(headers)} header fields; at most {MAX_HEADER_COUNT} are accepted.",
                "RequestHeaderFieldsTooLarge",
            )
        size = sum(len(name) + len(value) for name, value in headers)
        if size > MAX_HEADER_BYTES:
            raise GuardError(
                431,
                f"Request headers take {size} bytes; at most {MAX_HEADER_BYTES} are accepted.",
                "RequestHeaderFieldsTooLarge",
            )

    def check_auth(self, route_path: str, request: Request) -> None:
        if self.expected_authorization is None or route_path in OPEN_PATHS:
            return
        given = request.headers.get("authorization", "").encode()
        # compare_digest takes the same time wherever the first wrong byte is.
        if not hmac.compare_digest(given, self.expected_authorization):
            raise GuardError(401, "Invalid or missing API key.", "AuthenticationError", {"WWW-Authenticate": "Bearer"})

    async def read_json_body(self, request: Request) -> bytes:
        """The body, refused with 413 past the limit (declared or streamed) and 400 unless it is JSON."""
        content_type = request.headers.get("content-type", "")
        if content_type.split(";")[0].strip().lower() != "application/json":
            raise GuardError(400, f"Content-Type must be application/json, got {content_type!r}.", "BadRequestError")
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise GuardError(
                413,
                f"Request body of {declared} bytes exceeds the {limit}-byte limit.",
                "PayloadTooLarge",
                CLOSE_CONNECTION,
            )
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise GuardError(
                        413, f"Request body exceeds the {limit}-byte limit.", "PayloadTooLarge", CLOSE_CONNECTION
                    )
        except (ClientDisconnect, RayError) as error:
            # The client left mid-body (Serve's proxy then fails the read): an incomplete request, not a server error.
            raise GuardError(400, f"The request body was not received in full: {error!r}", "BadRequestError") from None
        return bytes(body)

    def cors_headers(self, request: Request) -> dict[str, str]:
        origin = request.headers.get("origin")
        if origin is None or not (self.allow_any_origin or origin in self.allowed_origins):
            return {}
        return {"Access-Control-Allow-Origin": "*" if self.allow_any_origin else origin, "Vary": "Origin"}

    def preflight(self, request: Request) -> Response:
        headers = self.cors_headers(request)
        if headers:
            headers.update(
                {
                    "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                    "Access-Control-Allow-Headers": "Authorization, Content-Type, X-Request-Id",
                    "Access-Control-Max-Age": "600",
                }
            )
        return Response(status_code=204 if headers else 400, headers=headers)
