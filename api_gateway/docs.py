"""``/docs`` without the internet: Swagger UI's own files, served by the gateway; and
``/openapi.json`` as one of the app's routes.

FastAPI's default page loads Swagger UI from a CDN, so on a machine with no way out (or
behind a strict proxy) ``/docs`` is a blank page. The ``swagger-ui-bundle`` package ships
the same distribution files; the page here points only at them and at ``/openapi.json``.
ReDoc (``/redoc``) has no such package and is left off rather than half working.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from starlette.routing import Route
from swagger_ui_bundle import swagger_ui_path

DOCS_PATH = "/docs"
ASSETS_PATH = "/docs/assets"
OAUTH2_REDIRECT_PATH = "/docs/oauth2-redirect"


def install_docs(app: FastAPI) -> None:
    """Serve ``/docs`` from local assets; ``app`` must be built with ``docs_url=None``.

    FastAPI serves ``/openapi.json`` from a Starlette route of its own, which none of the
    app's dependencies run on: ``/openapi.json%0A`` was served where every other path ending
    in a line break is a ``404``. The same endpoint is made one of the app's routes."""
    own = next(r for r in app.router.routes if isinstance(r, Route) and r.path == app.openapi_url)
    app.router.routes.remove(own)
    app.add_api_route(own.path, own.endpoint, include_in_schema=False)
    app.mount(ASSETS_PATH, StaticFiles(directory=swagger_ui_path), name="swagger-ui")

    @app.get(DOCS_PATH, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "").rstrip("/")  # as FastAPI's own page does
        assets = root + ASSETS_PATH
        return get_swagger_ui_html(
            openapi_url=root + (app.openapi_url or "/openapi.json"),
            title=f"{app.title} - API",
            swagger_js_url=f"{assets}/swagger-ui-bundle.js",
            swagger_css_url=f"{assets}/swagger-ui.css",
            swagger_favicon_url=f"{assets}/favicon-32x32.png",
            oauth2_redirect_url=root + OAUTH2_REDIRECT_PATH,
            # no badge that asks validator.swagger.io about the document
            swagger_ui_parameters={"validatorUrl": None},
        )

    @app.get(OAUTH2_REDIRECT_PATH, include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()
