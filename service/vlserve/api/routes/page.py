"""The page at `/`: try the model in a browser and watch this worker (static files in vlserve/static).

Served as files shipped in the package (no CDN, no build step: hosts are often air-gapped), under a
Content-Security-Policy that allows only this origin's own scripts, styles and API, plus images the
page makes from the picked file (blob:). The page talks to the same API as any client: no CORS is
opened for it and nothing it fetches with GET changes state.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

from vlserve.api.errors import APIError

router = APIRouter(include_in_schema=False)

CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' blob: data:",
        "connect-src 'self'",
        "form-action 'none'",
        "base-uri 'none'",
        "frame-ancestors 'none'",
    ]
)
HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
# Every file the page is made of, and its type: nothing else under /static/ is served.
FILES = {
    "index.html": "text/html; charset=utf-8",
    "page.js": "text/javascript; charset=utf-8",
    "page.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}


def _file(name: str) -> Response:
    if name not in FILES:
        raise APIError(404, "no such file: %s" % name, "invalid_request_error", code="not_found")
    body = resources.files("vlserve").joinpath("static", name).read_bytes()
    return Response(body, media_type=FILES[name], headers=HEADERS)


@router.get("/")
async def page() -> Response:
    return _file("index.html")


@router.get("/static/{name}")
async def static(name: str) -> Response:
    return _file(name)
