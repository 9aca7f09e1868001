"""The dashboard's web app (FastAPI, already a dependency of Flower).

Pages are one HTML shell (``static/index.html``) whose script draws the runs
table, a run's page, the comparison and the launch form from the JSON API
below; live updates come as Server-Sent Events (``/api/events``), pushed
when a run's ``metrics.jsonl`` or ``status.json`` changes. Plotly's
JavaScript is served from the installed ``plotly`` package: nothing is
fetched from the internet.

Safety: every POST needs the header ``X-Fedaccel: 1`` (a page of another
site cannot send it without the browser asking first), the ``Host`` header
must name this server (no DNS rebinding), and when a token is set (required
off localhost) every request needs it (``?token=`` once sets a cookie).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from importlib.resources import files
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response, StreamingResponse

from fedaccel.compare import (assign_run_labels, group_by_seed, grouping_notes, groups_table, load_runs,
                              runs_table, target_note)
from fedaccel.dashboard import runs as runs_mod, studies as studies_mod
from fedaccel.dashboard.flower_runs import flower_runs
from fedaccel.dashboard.launcher import ENGINES, Launcher, flower_connections
from fedaccel.dashboard.schema import FormError, form_schema, run_config_tokens, validate
from fedaccel.local_run import project_dir
from fedaccel.results import cumulative_mb

STATIC = files("fedaccel.dashboard") / "static"
POLL_SECONDS = 0.5
TOKEN_COOKIE = "fedaccel_token"


def _plotly_js() -> Path:
    """plotly.min.js of the installed plotly package (the ``dashboard`` extra)."""
    import plotly

    return Path(plotly.__file__).parent / "package_data" / "plotly.min.js"


def _error(message: str, status: int = 400, key: str | None = None) -> JSONResponse:
    return JSONResponse({"error": message, "key": key}, status_code=status)


def create_app(roots: list[Path], token: str | None = None, allowed_hosts: tuple[str, ...] = (),
               poll_seconds: float = POLL_SECONDS) -> FastAPI:
    """The dashboard over the run folders under ``roots`` (launched runs go
    to the first). ``token``: required on every request when set."""
    roots = [Path(r).resolve() for r in roots]
    launcher = Launcher(roots[0])
    app = FastAPI(title="fedaccel dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.launcher = launcher
    app.state.roots = roots
    hosts = {"127.0.0.1", "localhost", "::1", "testserver", *allowed_hosts}

    @app.middleware("http")
    async def guard(request: Request, call_next):  # noqa: ANN001
        given_host = request.headers.get("host", "")
        host = given_host[1:].split("]")[0] if given_host.startswith("[") else given_host.split(":")[0]
        if host not in hosts:
            return _error(f"unexpected Host header {host!r}; start fedaccel-dashboard with --host {host}", 403)
        if token:
            given = (request.query_params.get("token") or request.cookies.get(TOKEN_COOKIE)
                     or request.headers.get("authorization", "").removeprefix("Bearer ").strip())
            if not given or not hmac.compare_digest(given, token):
                return _error("this dashboard needs its token: open the URL fedaccel-dashboard printed "
                              "(…/?token=…)", 401)
        if request.method == "POST" and request.headers.get("x-fedaccel") != "1":
            return _error("POST requests need the header X-Fedaccel: 1", 403)
        response = await call_next(request)
        if token and request.query_params.get("token"):
            response.set_cookie(TOKEN_COOKIE, token, httponly=True, samesite="strict")
        return response

    # ------------------------------------------------------------------ pages
    @app.get("/", response_class=HTMLResponse)
    def index() -> HTMLResponse:
        return HTMLResponse((STATIC / "index.html").read_text(encoding="utf-8"))

    @app.get("/static/{name}")
    def static(name: str) -> Response:
        if name == "plotly.min.js":
            return FileResponse(_plotly_js(), media_type="text/javascript",
                                headers={"Cache-Control": "max-age=86400"})
        if name not in ("app.js", "style.css"):
            return _error(f"no static file {name!r}", 404)
        media = "text/javascript" if name.endswith(".js") else "text/css"
        return Response((STATIC / name).read_text(encoding="utf-8"), media_type=media)

    # ------------------------------------------------------------------- runs
    @app.get("/api/runs")
    def list_runs() -> dict[str, Any]:
        return {"runs": runs_mod.snapshot(roots), "roots": [str(r) for r in roots]}

    @app.get("/api/run/{run_id:path}")
    def run_page(run_id: str) -> Response:
        path = runs_mod.resolve(roots, run_id)
        if path is None:
            return _error(f"no run {run_id!r} under {', '.join(map(str, roots))}", 404)
        ref = runs_mod.RunRef(int(run_id.split("/", 1)[0]), run_id.split("/", 1)[1])
        detail = runs_mod.run_detail(ref, path)
        if detail.get("rows"):
            detail["cumulative_mb"] = cumulative_mb(detail["rows"])
        return JSONResponse(detail)

    @app.get("/api/events")
    async def events(request: Request) -> StreamingResponse:
        """Server-Sent Events: a ``runs`` event with every run's overview and
        a ``studies`` event with every study's, whenever a run's or a study's
        files change (and at once on connecting)."""

        def changes() -> tuple:
            return runs_mod.fingerprint(roots), studies_mod.fingerprint(roots)

        async def stream():
            last = None
            while not await request.is_disconnected():
                current = await asyncio.to_thread(changes)
                if current != last:
                    last = current
                    payload = await asyncio.to_thread(runs_mod.snapshot, roots)
                    yield f"event: runs\ndata: {json.dumps(payload)}\n\n"
                    payload = await asyncio.to_thread(studies_mod.snapshot, roots)
                    yield f"event: studies\ndata: {json.dumps(payload)}\n\n"
                await asyncio.sleep(poll_seconds)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.post("/api/stop")
    async def stop(request: Request) -> Response:
        body = await _json(request)
        path = runs_mod.resolve(roots, str(body.get("id", "")))
        if path is None:
            return _error(f"no run {body.get('id')!r}", 404)
        try:
            done = await asyncio.to_thread(launcher.stop, path)
        except FormError as err:
            return _error(str(err), 409)
        return JSONResponse({"ok": True, "message": done})

    # ---------------------------------------------------------------- studies
    @app.get("/api/studies")
    def list_studies() -> dict[str, Any]:
        return {"studies": studies_mod.snapshot(roots),
                "files": studies_mod.study_files(project_dir()), "results_dir": str(roots[0] / "sweeps")}

    @app.get("/api/study/{study_id:path}")
    def study_page(study_id: str) -> Response:
        path = studies_mod.resolve_study(roots, study_id)
        if path is None:
            return _error(f"no study {study_id!r} under {', '.join(map(str, roots))}", 404)
        head, _, rel = study_id.partition("/")
        return JSONResponse(studies_mod.study_detail(runs_mod.RunRef(int(head), rel), path))

    def _study_request(body: dict) -> tuple[str, int | None, Path | None]:
        """(study file, workers, folder): a new study from ``file``, or the
        rest of the study ``id`` (its own file, into its own folder)."""
        folder = None
        study_file = str(body.get("file") or "")
        if body.get("id"):
            folder = studies_mod.resolve_study(roots, str(body["id"]))
            if folder is None:
                raise FormError(f"no study {body['id']!r}", "study")
            study_file = studies_mod.study_file_of(folder) or ""
            if not study_file:
                raise FormError("this study does not say which study file made it: launch the file", "study")
        workers = body.get("workers")
        if workers in (None, ""):
            return study_file, None, folder
        try:
            return study_file, int(workers), folder
        except (TypeError, ValueError):
            raise FormError(f"workers={workers!r}: must be a whole number >= 1", "workers") from None

    @app.post("/api/study/validate")
    async def check_study(request: Request) -> Response:
        body = await _json(request)
        try:
            argv, folder, cells = await asyncio.to_thread(lambda: launcher.study_command(*_study_request(body)))
        except FormError as err:
            return _error(str(err), 400, err.key)
        return JSONResponse({"ok": True, "argv": argv, "folder": str(folder), "cells": cells})

    @app.post("/api/study/launch")
    async def launch_study(request: Request) -> Response:
        body = await _json(request)
        try:
            folder, argv = await asyncio.to_thread(lambda: launcher.launch_study(*_study_request(body)))
        except FormError as err:
            return _error(str(err), 400, err.key)
        return JSONResponse({"ok": True, "id": f"0/{folder.relative_to(roots[0]).as_posix()}", "argv": argv})

    @app.post("/api/study/stop")
    async def stop_study(request: Request) -> Response:
        body = await _json(request)
        path = studies_mod.resolve_study(roots, str(body.get("id", "")))
        if path is None:
            return _error(f"no study {body.get('id')!r}", 404)
        try:
            done = await asyncio.to_thread(launcher.stop_study, path)
        except FormError as err:
            return _error(str(err), 409)
        return JSONResponse({"ok": True, "message": done})

    # ---------------------------------------------------------------- compare
    @app.post("/api/compare")
    async def compare(request: Request) -> Response:
        """The tables fedaccel-compare prints (same code) and every run's curves."""
        body = await _json(request)
        ids = body.get("ids") or []
        paths = [runs_mod.resolve(roots, str(i)) for i in ids]
        if len(ids) < 1 or None in paths:
            return _error("pick one or more recorded runs to compare", 400)
        try:
            runs = load_runs(paths)
        except (OSError, ValueError) as err:
            return _error(str(err), 400)
        assign_run_labels(runs, None)
        out: dict[str, Any] = {"runs_table": runs_table(runs), "note": target_note(runs, None)}
        if body.get("group_seeds"):  # each seed once, finished runs only: the lines say who is left out
            groups = group_by_seed(runs)
            out["groups_table"] = groups_table(groups)
            out["note"] = " ".join([out["note"], *(f"{n}." for n in grouping_notes(runs, groups))])
        out["series"] = [{"id": i, "label": r.label, "rows": r.rows, "cumulative_mb": cumulative_mb(r.rows)}
                         for i, r in zip(ids, runs)]
        return JSONResponse(out)

    # ----------------------------------------------------------------- launch
    @app.get("/api/schema")
    def schema() -> dict[str, Any]:
        names, default = flower_connections()
        return {**form_schema(), "engines": list(ENGINES), "connections": names,
                "default_connection": default, "results_dir": str(roots[0])}

    def _checked(body: dict, data: bool = False) -> tuple[dict, str, int, str | None]:
        engine = str(body.get("engine", "fast"))
        if engine not in ENGINES:
            raise FormError(f"engine={engine!r}: allowed: {', '.join(ENGINES)}", "engine")
        try:
            num_clients = int(body.get("num_clients") or 20)
        except (TypeError, ValueError):
            raise FormError(f"clients={body.get('num_clients')!r}: must be a whole number >= 1",
                            "num_clients") from None
        if num_clients < 1:
            raise FormError(f"clients={num_clients}: must be a whole number >= 1", "num_clients")
        values = body.get("values") or {}
        if not isinstance(values, dict):
            raise FormError("values must be an object of run-config keys")
        overrides = validate(values, num_clients, engine, data=data)
        return overrides, engine, num_clients, body.get("connection") or None

    @app.post("/api/validate")
    async def check(request: Request) -> Response:
        body = await _json(request)
        try:
            # Check: also the data and the model, as fedaccel-run --check (Launch leaves them to the run)
            overrides, engine, num_clients, connection = await asyncio.to_thread(_checked, body, True)
            argv, run_dir, _ = launcher.command(overrides, engine, num_clients, connection)
        except FormError as err:
            return _error(str(err), 400, err.key)
        return JSONResponse({"ok": True, "overrides": overrides, "tokens": run_config_tokens(overrides),
                             "argv": argv, "run_dir": str(run_dir)})

    @app.post("/api/launch")
    async def launch(request: Request) -> Response:
        body = await _json(request)
        try:
            overrides, engine, num_clients, connection = await asyncio.to_thread(_checked, body)
            launched = launcher.launch(overrides, engine, num_clients, connection)
        except FormError as err:
            return _error(str(err), 400, err.key)
        rel = launched.run_dir.relative_to(roots[0]).as_posix()
        return JSONResponse({"ok": True, "id": f"0/{rel}", "argv": launched.argv})

    # ----------------------------------------------------------------- flower
    @app.get("/api/flower")
    def flower(connection: str | None = None) -> Response:
        return JSONResponse(flower_runs(connection))

    return app


async def _json(request: Request) -> dict:
    try:
        body = await request.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}
