"""The web UI: login and logout, the pages, their static files and Plotly.js.

Pages are HTML shells from ``frontend/`` filled with the signed-in user; their ES modules
(``frontend/static/``) fetch everything else from the REST API with the session cookie.
The cookie holds the API token itself (HttpOnly, SameSite=Strict): ``server.api.gate`` reads
it when a request has no Authorization header, so the API's role checks apply unchanged, and
refuses a cookie's write (and any ``/login`` or ``/logout``) whose Origin is not this server.
Anonymous visitors are sent to ``/login``; the API answers them 401 as always.

Plotly.js comes from the ``plotly`` Python package, so the dashboard works offline.
"""

from __future__ import annotations

import gzip
import hashlib
import html
import string
from functools import cache
from pathlib import Path as FsPath
from urllib.parse import parse_qs, quote

import plotly
from fastapi import APIRouter, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

import frontend
from server.api.bodies import JSONRoute
from server.api.deps import PathId
from server.api.gate import SESSION_COOKIE, authenticate
from server.api.routes import series as series_routes
from server.api.routes import stream as stream_routes
from server.context import context_of
from server.errors import Unauthorized
from server.services.tokens import Principal

COOKIE = SESSION_COOKIE
COOKIE_MAX_AGE_S = 12 * 3600
FRONTEND_DIR = FsPath(frontend.__file__).parent
PLOTLY_JS = FsPath(plotly.__file__).parent / "package_data" / "plotly.min.js"
MAX_LOGIN_BODY = 4096
SECURITY_HEADERS = {
    # Plotly sets inline styles on the elements it draws; scripts come only from this server.
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data: blob:; connect-src 'self'; frame-ancestors 'none'; "
        "base-uri 'none'; form-action 'self'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}
PAGES = {
    "cluster": "Cluster",
    "jobs": "Jobs",
    "audit": "Audit log",
}

CHARTED = {"job", "compare"}

router = APIRouter(include_in_schema=False, route_class=JSONRoute)


def mount_dashboard(app: FastAPI, *, api_prefix: str) -> None:
    """Add the dashboard to ``app``: its API routes (chart series, live stream), the pages,
    the login routes and the static files."""
    for module in (series_routes, stream_routes):
        app.include_router(module.router, prefix=api_prefix)
    app.include_router(router)
    app.mount("/static", StaticFiles(directory=FRONTEND_DIR / "static"), name="static")


# --------------------------------------------------------------------------- sessions


async def signed_in(request: Request) -> Principal | None:
    """The principal of the session cookie, or None for an anonymous visitor."""
    secret = request.cookies.get(COOKIE)
    if not secret:
        return None
    try:
        return await authenticate(context_of(request.app), secret)
    except Unauthorized:
        return None


def _safe_next(target: str | None) -> str:
    """Only same-site paths: never an open redirect to another host."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/jobs"
    return target


def _to_login(request: Request) -> RedirectResponse:
    here = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return RedirectResponse(f"/login?next={quote(here, safe='/')}", status_code=303)


# --------------------------------------------------------------------------- rendering


@cache
def _template(name: str) -> string.Template:
    return string.Template((FRONTEND_DIR / name).read_text(encoding="utf-8"))


def _page(
    page: str, title: str, principal: Principal, *, main_attrs: str = "", status: int = 200
) -> HTMLResponse:
    nav = "".join(
        f'<a href="/{key}"{" aria-current=page" if key == page else ""}>{label}</a>'
        for key, label in PAGES.items()
    )
    body = _template(f"{page}.html").substitute()
    text = _template("layout.html").substitute(
        title=html.escape(title),
        page=page,
        user=html.escape(principal.name),
        role=principal.role.value,
        nav=nav,
        main_attrs=main_attrs,
        body=body,
        script=f"/static/{page}.js",
        # Only these pages draw charts; Plotly runs before their module (deferred, in order).
        vendor='<script src="/vendor/plotly.min.js" defer></script>\n' if page in CHARTED else "",
    )
    return HTMLResponse(text, status_code=status, headers=SECURITY_HEADERS)


def _login_page(next_path: str, error: str | None = None, status: int = 200) -> HTMLResponse:
    text = _template("login.html").substitute(
        next=html.escape(next_path, quote=True),
        error=f'<p class="form-error" role="alert">{html.escape(error)}</p>' if error else "",
    )
    return HTMLResponse(text, status_code=status, headers=SECURITY_HEADERS)


# --------------------------------------------------------------------------- routes


@router.get("/")
async def home(request: Request) -> Response:
    if await signed_in(request) is None:
        return _to_login(request)
    return RedirectResponse("/jobs", status_code=303)


@router.get("/login")
async def login_form(request: Request) -> Response:
    return _login_page(_safe_next(request.query_params.get("next")))


@router.post("/login")
async def login(request: Request) -> Response:
    """Check the token and keep it in an HttpOnly, SameSite=Strict cookie. The body is read
    up to ``MAX_LOGIN_BODY`` bytes (413 past it), and only from this server's own pages: both
    checked by ``server.api.gate``."""
    raw = await request.body()
    form = parse_qs(raw.decode("utf-8", "replace"), max_num_fields=4)
    secret = (form.get("token") or [""])[0].strip()
    next_path = _safe_next((form.get("next") or [""])[0])
    if not secret:
        return _login_page(next_path, "Enter an API token.", status=401)
    context = context_of(request.app)
    try:
        await authenticate(context, secret)
    except Unauthorized as exc:
        address = request.client.host if request.client else "unknown"
        retry_after = context.auth_failures.fail(address)
        if retry_after is not None:
            message = context.auth_failures.message(address, retry_after)
            page = _login_page(next_path, f"Not signed in: {message}.", status=429)
            page.headers["Retry-After"] = str(retry_after)
            return page
        return _login_page(next_path, f"Not signed in: {exc.message}.", status=401)
    response = RedirectResponse(next_path, status_code=303)
    response.set_cookie(
        COOKIE,
        secret,
        max_age=COOKIE_MAX_AGE_S,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return response


@router.post("/logout")
async def logout() -> Response:
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(COOKIE, httponly=True, samesite="strict")
    return response


@router.get("/cluster")
async def cluster_page(request: Request) -> Response:
    return await _simple_page(request, "cluster")


@router.get("/jobs")
async def jobs_page(request: Request) -> Response:
    return await _simple_page(request, "jobs")


@router.get("/audit")
async def audit_page(request: Request) -> Response:
    return await _simple_page(request, "audit")


@router.get("/jobs/{job_id}")
async def job_page(request: Request, job_id: PathId) -> Response:
    principal = await signed_in(request)
    if principal is None:
        return _to_login(request)
    return _page("job", f"Job {job_id}", principal, main_attrs=f'data-job-id="{job_id}"')


@router.get("/compare")
async def compare_page(request: Request) -> Response:
    """Jobs side by side; the page reads ``?jobs=3,4`` itself and asks the API for each."""
    principal = await signed_in(request)
    if principal is None:
        return _to_login(request)
    return _page("compare", "Compare jobs", principal)


async def _simple_page(request: Request, page: str) -> Response:
    principal = await signed_in(request)
    if principal is None:
        return _to_login(request)
    return _page(page, PAGES[page], principal)


@cache
def _plotly_bundle() -> tuple[bytes, bytes, str]:
    raw = PLOTLY_JS.read_bytes()
    return raw, gzip.compress(raw, compresslevel=6), hashlib.sha256(raw).hexdigest()[:16]


@router.get("/vendor/plotly.min.js")
async def plotly_js(request: Request) -> Response:
    """Plotly.js from the installed ``plotly`` package, compressed once and cached by browsers."""
    raw, packed, etag = await run_in_threadpool(_plotly_bundle)
    headers = {
        "ETag": f'"{etag}"',
        "Cache-Control": "public, max-age=86400",
        "Vary": "Accept-Encoding",
    }
    if request.headers.get("if-none-match") == f'"{etag}"':
        return Response(status_code=304, headers=headers)
    if "gzip" in request.headers.get("accept-encoding", ""):
        headers["Content-Encoding"] = "gzip"
        return Response(packed, media_type="text/javascript", headers=headers)
    return Response(raw, media_type="text/javascript", headers=headers)
