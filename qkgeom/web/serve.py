"""``qkgeom serve``: a live web page over a results database (read-only).

A Starlette app (:func:`create_app`) served by uvicorn. Pages are plain HTML built on the
server from :class:`qkgeom.report.study.Study`; charts are the project's altair charts rendered
to inline SVG by vl-convert, so the page needs no network and no script from anywhere.
Pages reload themselves every few seconds (``<meta http-equiv="refresh">``, ``refresh=0``
turns it off). Verdicts and charts are computed in background threads and kept per
fingerprint of the sweep's data (:meth:`Study.version`): a refresh with nothing new
costs a few small queries, and a page never waits more than ``wait_s`` for a slow
verdict (it shows the previous verdicts, marked, until the new ones are ready).

Routes (``NAME`` a sweep, one path segment: ``quote(NAME, safe="")``, so ``a/b`` is
``a%2Fb``; a name of dots only, which browsers would resolve away, is
``/sweep?name=NAME`` and ``/sweep/trials.csv?name=NAME``; :func:`sweep_url`):

* ``/``: the sweeps, their trials and progress;
* ``/sweeps/NAME``: progress, for a sweep with cells the factor view (``group=FACTOR``,
  ``f.FACTOR=VALUE`` filters the trials), trial table (``sort=COLUMN``, ``desc=1``), trajectories of
  ``metric`` (default PR_Q and PR_K; ``view=mean|trial``), the arms beside their
  baselines, the claims with their verdicts (``unfinished=1`` counts unfinished trials),
  pretrained models;
* ``/sweeps/NAME/trials.csv``, ``trials.parquet``, ``trajectories.csv``, ``chart.svg``,
  ``claims.json``, ``report.html``: what the page shows, to download;
* ``/compare?sweep=A&sweep=B``: the report of several sweeps as cells of one comparison
  (per-cell verdicts, sensitivity, cells at a glance); the index ticks them.

Its security layer is :mod:`qkgeom.web.guard`: without a token the server binds to
loopback only (:func:`check_bind`), with one every request must carry it; a request for
any host name but the server's own is refused before anything else (DNS rebinding), and
every response carries a Content-Security-Policy that allows no script, no frame and only
the page's own stylesheet. Query parameters are read and checked by
:mod:`qkgeom.web.params`. A SQLite database is opened ``mode=ro`` (a read-only file
handle) as well as ``PRAGMA query_only``. docs/serve.md states what is guaranteed, with
the tests.
"""

from __future__ import annotations

import io
import json
import math
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote_to_bytes, urlencode

import polars as pl
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from qkgeom import analysis as A
from qkgeom.errors import QkgeomError
from qkgeom.report.html import cell as _cell
from qkgeom.report.html import escape as _e
from qkgeom.report.html import html_table, page, verdict_cell
from qkgeom.report.study import FINISHED, Study
from qkgeom.web.background import Jobs
from qkgeom.web.guard import (
    GuardedApp,
    HostRule,
    TokenMiddleware,
    check_bind,
    is_loopback,
    listen,
)
from qkgeom.web.params import VIEWS, flag_param, metric_param, name_can_exist, refresh_param
from qkgeom.web.responses import NotFound, download, error_page, pending
from qkgeom.web.sections import (
    FILTER,
    PRQK,
    BadRequest,
    Kept,
    arms_section,
    counts,
    factor_section,
    filter_trials,
    kept_trials,
    reload_note,
    sweep_header,
    sweep_url,
    trajectories_svg,
)

if TYPE_CHECKING:
    from qkgeom.store import Store

# what callers import from here (qkgeom.cli.serve, the tests); the rest lives in guard.py
__all__ = ["check_bind", "create_app", "is_loopback", "listen"]

DEFAULT_PORT = 8765
DEFAULT_REFRESH_S = 5
TRIAL_HEADERS = [("trial_key", "trial"), ("depth", "depth"), ("init", "init"), ("arm", "arm"),
                 ("seed", "seed"), ("status", "status"), ("attempts", "tries"),
                 ("step", "step / max"), ("val_loss", "val loss"), ("test_loss", "test loss"),
                 ("host", "host"), ("device", "device"), ("code_version", "code"),
                 ("error", "error")]


# --------------------------------------------------------------------------- the app


class Server:
    """The state behind the routes: one read-only store shared by every request."""

    def __init__(self, store: Store, *, refresh: int = DEFAULT_REFRESH_S, seed: int = 0,
                 n_boot: int = 10_000, wait_s: float = 1.0,
                 update_every_s: float = 30.0) -> None:
        self.store = store
        self.refresh = refresh
        self.seed = seed
        self.n_boot = n_boot
        self.jobs = Jobs(wait_s, update_every_s)

    # ------------------------------------------------------------------ helpers
    def study(self, name: str) -> Study:
        if not name_can_exist(name) or self.store.sweep_id(name) is None:
            have = ", ".join(self.store.sweep_names()) or "(none yet)"
            raise NotFound(f"no sweep named {name!r} in this database; sweeps: {have}")
        return Study(self.store, name)

    def chart_svg(self, st: Study, version: Any, metric: str, view: str, *,
                  wait_s: float | None = None, kept: Kept | None = None
                  ) -> tuple[Any, bool]:
        """((svg, note), fresh): the chart as inline SVG, or an empty string and why there
        is none; (None, False) while the first one is being drawn. ``kept``: the trials a
        factor filter keeps (the filters, their trial ids); None: every trial."""
        filters, ids = kept if kept is not None else ({}, None)
        key = (st.name, "chart", metric, view, tuple(sorted(filters.items())))
        return self.jobs.get(key, version, lambda: trajectories_svg(st, metric, view, ids),
                             wait_s=wait_s)

    def claims(self, st: Study, version: Any, unfinished: bool, *,
               wait_s: float | None = None) -> tuple[Any, bool]:
        return self.jobs.get((st.name, "claims", unfinished), version, lambda: st.claims(
            seed=self.seed, n_boot=self.n_boot, finished_only=not unfinished), wait_s=wait_s)

    def trends(self, st: Study, version: Any, *, wait_s: float | None = None
               ) -> tuple[Any, bool]:
        """(table rows, chart SVG, note) of the pretrained models' checkpoint trends, from
        one :meth:`Study.checkpoint_trends` pass; the SVG is '' when no checkpoint has a
        step, or when drawing failed (the note says why)."""
        from qkgeom.report import plots

        def make() -> tuple[list[dict[str, Any]], str, str]:
            trends = st.checkpoint_trends()
            rows = []
            for r in st.pretrained().iter_rows(named=True):
                row, rep = dict(r), trends.get(r["model"])
                if isinstance(rep, A.CheckpointTrendReport):
                    o = rep.overall
                    row.update(rho=o.rho, peak_step=o.peak_step,
                               rises_then_decays=o.rises_then_decays)
                else:
                    row["note"] = str(rep)
                rows.append(row)
            df = st.checkpoint_frame(trends)
            try:  # a failed drawing (e.g. vl_convert) loses the chart, never the table
                svg = plots.to_svg(plots.checkpoint_trends(df)) if df.height else ""
            except Exception as e:  # shown as one line under the table
                return rows, "", f"the checkpoint chart could not be drawn: {e}"
            return rows, svg[svg.find("<svg"):], ""

        return self.jobs.get(("pretrained", "trends"), version[-1], make, wait_s=wait_s)

    # ------------------------------------------------------------------ routes
    def index(self, req: Request) -> Response:
        refresh = refresh_param(req, self.refresh)
        rows = []
        for name in self.store.sweep_names():
            p = Study(self.store, name).progress()
            rows.append(f"<tr><td><input type='checkbox' name='sweep' value='{_e(name)}' "
                        f"form='compare'></td>"
                        f"<td><a href='{_e(sweep_url(name))}'>{_e(name)}</a></td>"
                        f"<td class='num'>{p['n_trials']}</td>"
                        f"<td>{_e(counts(p['status']))}</td>"
                        f"<td><progress value='{p['fraction']:.4f}' max='1'></progress> "
                        f"{p['fraction']:.0%}</td></tr>")
        table = ("<table id='sweeps'><thead><tr><th></th><th>sweep</th><th>trials</th>"
                 "<th>status</th><th>progress</th></tr></thead><tbody>" + "".join(rows)
                 + "</tbody></table><form id='compare' method='get' action='/compare'>"
                 "<button type='submit'>compare the ticked sweeps</button> <span class="
                 "'note'>(every claim decided per sweep, with the sensitivity table)</span>"
                 "</form>" if rows else "<p class='note'>No sweeps in this database yet.</p>")
        body = (f"<h1>qkgeom: {_e(self.store.safe_url)}</h1>{table}"
                f"<p class='note'>{reload_note(refresh)}</p>")
        return HTMLResponse(page("qkgeom sweeps", body, refresh=refresh))

    def sweep_page(self, req: Request, name: str) -> Response:
        st = self.study(name)
        refresh = refresh_param(req, self.refresh)
        metric, view = metric_param(st, req)
        unfinished = flag_param(req, "unfinished")
        sort = req.query_params.get("sort") or "trial_id"
        desc = flag_param(req, "desc")
        trials, filters, group = filter_trials(st, st.trials(), req.query_params)
        if sort not in trials.columns:
            raise BadRequest(f"sort={sort!r}: sort by one of {', '.join(trials.columns)}")
        version = st.version()
        # start the slow parts now, in parallel; the page waits for them at most wait_s in
        # all (a budget shared by the chart, the verdicts and the pretrained trends)
        kept = kept_trials(trials, filters)
        self.chart_svg(st, version, metric, view, wait_s=0, kept=kept)
        self.claims(st, version, unfinished, wait_s=0)
        self.trends(st, version, wait_s=0)
        deadline = time.monotonic() + self.jobs.wait_s

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        prog = st.progress()
        q = dict(req.query_params)
        q.pop("token", None)

        def link(**kw: Any) -> str:
            return "?" + urlencode({**q, **{k: v for k, v in kw.items()}})

        out = [sweep_header(st, prog), factor_section(st, trials, filters, group, q),
               "<h2>Trials</h2>", self._trial_table(trials, sort, desc, link),
               self._chart_section(st, version, metric, view, q, wait_s=left(), kept=kept),
               arms_section(st.arms()),
               self._claims_section(st, version, unfinished, not prog["finished"], link,
                                    wait_s=left()),
               self._pretrained_section(st, version, wait_s=left()),
               f"<p class='note'>{reload_note(refresh)}</p>"]
        return HTMLResponse(page(f"qkgeom: {st.name}", "".join(out), refresh=refresh))

    def _chart_section(self, st: Study, version: Any, metric: str, view: str,
                       query: dict[str, str], *, wait_s: float, kept: Kept | None) -> str:
        """The trajectories: a metric/view form, the chart (or why there is none yet) and
        the download links."""
        opts = "".join(f"<option value='{_e(m)}'{' selected' if m == metric else ''}>"
                       f"{_e('PR_Q and PR_K' if m == PRQK else m)}</option>"
                       for m in [PRQK, *st.metrics()])
        vopts = "".join(f"<option value='{v}'{' selected' if v == view else ''}>"
                        f"{'mean over seeds' if v == 'mean' else 'per trial (seed)'}</option>"
                        for v in VIEWS)
        keep = "".join(f"<input type='hidden' name='{_e(k)}' value='{_e(v)}'>"
                       for k, v in query.items() if k not in ("metric", "view"))
        got, fresh = self.chart_svg(st, version, metric, view, wait_s=wait_s, kept=kept)
        svg, note = got if isinstance(got, tuple) else ("", pending(got))
        filters = kept[0] if kept is not None else {}
        data_q = urlencode({"metric": metric, "view": view,
                            **{FILTER + k: v for k, v in filters.items()}})
        which = ("Baseline arm, every trial (finished or not)" if not filters else
                 "Baseline arm, the trials with " + ", ".join(
                     f"{k} = {v}" for k, v in sorted(filters.items()))
                 + " (finished or not)")
        return "".join([
            "<h2>Trajectories</h2>",
            f"<form method='get' id='chart-form'>{keep}<label>metric <select name='metric'>"
            f"{opts}</select></label> <label>view <select name='view'>{vopts}</select>"
            "</label> <button type='submit'>show</button></form>",
            (f"<figure id='chart'>{svg}</figure>" if svg else
             f"<p class='note' id='chart-note'>No chart yet: {_e(note)}</p>")
            + ("" if fresh else "<p class='note updating' id='chart-stale'>Drawn from an "
               "earlier state of the database; redrawn at most every "
               f"{self.jobs.min_interval_s:g} s.</p>"),
            f"<p class='note' id='chart-which'>{_e(which)}. Download: "
            f"<a href='{_e(sweep_url(st.name, 'trajectories.csv', data_q))}'>data (CSV)</a>, "
            f"<a href='{_e(sweep_url(st.name, 'chart.svg', data_q))}'>chart (SVG)</a></p>"])

    def _claims_section(self, st: Study, version: Any, unfinished: bool, provisional: bool,
                        link: Callable[..., str], *, wait_s: float) -> str:
        """The claims with their verdicts (marked provisional or earlier), or a note."""
        claims, fresh = self.claims(st, version, unfinished, wait_s=wait_s)
        mark = " <span class='provisional'>(provisional)</span>" if provisional else ""
        if not fresh:  # computed on an earlier state of the data
            mark += " <span class='provisional'>(earlier data)</span>"
        which = ("all trials, finished or not" if unfinished else "finished trials only")
        out = ["<h2>Claims and verdicts</h2>",
               f"<p class='note'>Computed on {which} (the code of <code>qkgeom report"
               f"</code>). <a href='{_e(link(unfinished=0 if unfinished else 1))}'>"
               f"{'finished trials only' if unfinished else 'include unfinished trials'}"
               "</a></p>"]
        if not isinstance(claims, list):
            return "".join(out) + f"<p class='note' id='claims-note'>{_e(pending(claims))}</p>"
        rows = "".join(
            f"<tr><td>{_e(c.key)}</td><td>{_e(c.paper)}</td><td>{_e(c.measured)}</td>"
            f"{verdict_cell(c.verdict, mark)}</tr>"
            for c in claims)
        out.append("<table id='claims'><thead><tr><th>claim</th><th>paper</th>"
                   f"<th>measured</th><th>verdict</th></tr></thead><tbody>{rows}</tbody>"
                   "</table>")
        if not fresh:
            out.append("<p class='note updating' id='claims-stale'>These verdicts are "
                       "from an earlier state of the database; they are recomputed at "
                       f"most every {self.jobs.min_interval_s:g} s (--update-every).</p>")
        return "".join(out)

    def _pretrained_section(self, st: Study, version: Any, *, wait_s: float) -> str:
        got, _ = self.trends(st, version, wait_s=wait_s)
        if not (isinstance(got, tuple) and got[0]):
            return ""
        pre, chart, note = got
        fig = f"<figure id='checkpoint-chart'>{chart}</figure>" if chart else ""
        if note:
            fig += f"<p class='note' id='checkpoint-chart-note'>{_e(note)}</p>"
        return ("<h2>Pretrained models</h2><p class='note'>Trend of PR_Q - PR_K over each "
                "model's checkpoints (Spearman vs step, peak).</p>" + fig
                + html_table(pre, table_id="pretrained"))

    def _trial_table(self, trials: pl.DataFrame, sort: str, desc: bool,
                     link: Callable[..., str]) -> str:
        t = trials.sort(sort, descending=desc, nulls_last=True)
        head = []
        cell = "cell" in t.columns  # a sweep with cells
        for col, label in TRIAL_HEADERS[:1] + [("cell", "cell")] * cell + TRIAL_HEADERS[1:]:
            arrow = (" ▼" if desc else " ▲") if col == sort else ""
            nd = 0 if col == sort and desc else (1 if col == sort else 0)
            head.append(f"<th><a href='{_e(link(sort=col, desc=nd))}'>{_e(label)}{arrow}</a>"
                        "</th>")
        body = []
        for r in t.iter_rows(named=True):
            step = "-" if r["step"] is None else f"{r['step']}/{r['max_steps'] or '?'}"
            cells = [f"<td>{_e(r['trial_key'])}</td>", *([_cell(r["cell"])] if cell else []),
                     _cell(r["depth"]), _cell(r["init"]),
                     _cell(r["arm"]), _cell(r["seed"]),
                     _status_cell(r["status"], r["stale_s"]),
                     _cell(r["attempts"]), f"<td class='num'>{_e(step)}</td>",
                     _cell(r["val_loss"]), _cell(r["test_loss"]), _cell(r["host"]),
                     _cell(r["device"]), _code_cell(r),
                     _cell(r["error"] if r["status"] != FINISHED else "")]
            body.append("<tr>" + "".join(cells) + "</tr>")
        return ("<table id='trials'><thead><tr>" + "".join(head) + "</tr></thead><tbody>"
                + "".join(body) + "</tbody></table>")

    def trials_csv(self, req: Request, name: str) -> Response:
        st = self.study(name)
        return download(st.trials().write_csv(), "text/csv", f"{st.name}-trials.csv")

    def trials_parquet(self, req: Request, name: str) -> Response:
        st = self.study(name)
        buf = io.BytesIO()
        st.trials().write_parquet(buf)
        return download(buf.getvalue(), "application/vnd.apache.parquet",
                         f"{st.name}-trials.parquet")

    def trajectories_csv(self, req: Request, name: str) -> Response:
        st = self.study(name)
        metric, view = metric_param(st, req)
        _, ids = kept_trials(*filter_trials(st, st.trials(), req.query_params)[:2])
        ms = ["pr_q", "pr_k"] if metric == PRQK else [metric]
        frames = [st.trajectories(m, per_trial=view == "trial", trials=ids).with_columns(
            pl.lit(m).alias("metric")) for m in ms]
        df = pl.concat(frames)
        return download(df.write_csv(), "text/csv",
                         f"{st.name}-{'-'.join(ms)}-{view}.csv")

    def chart(self, req: Request, name: str) -> Response:
        st = self.study(name)
        metric, view = metric_param(st, req)
        kept = kept_trials(*filter_trials(st, st.trials(), req.query_params)[:2])
        got, _ = self.chart_svg(st, st.version(), metric, view, wait_s=math.inf, kept=kept)
        svg, note = got if isinstance(got, tuple) else ("", pending(got))
        if not svg:
            raise NotFound(f"no chart for {metric} yet: {note}")
        return Response(svg, media_type="image/svg+xml")

    def claims_json(self, req: Request, name: str) -> Response:
        st = self.study(name)
        unfinished = flag_param(req, "unfinished")
        prog = st.progress()
        claims, _ = self.claims(st, st.version(), unfinished, wait_s=math.inf)
        if not isinstance(claims, list):
            raise QkgeomError(pending(claims))
        data = {"sweep": st.name, "provisional": not prog["finished"],
                "finished_only": not unfinished, "progress": prog,
                "claims": [{"key": c.key, "paper": c.paper, "measured": c.measured,
                            "verdict": c.verdict} for c in claims]}
        return JSONResponse(json.loads(json.dumps(data, default=str)))

    def report_html(self, req: Request, name: str) -> Response:
        st = self.study(name)
        unfinished = flag_param(req, "unfinished")
        with tempfile.TemporaryDirectory(prefix="qkgeom-serve-") as d:
            st.report(d, seed=self.seed, n_boot=self.n_boot, finished_only=not unfinished)
            text = (Path(d) / "report.html").read_text(encoding="utf-8")
        return HTMLResponse(text)


    PAGES = {"": "sweep_page", "trials.csv": "trials_csv", "trials.parquet": "trials_parquet",
             "trajectories.csv": "trajectories_csv", "chart.svg": "chart",
             "claims.json": "claims_json", "report.html": "report_html"}

    def by_path(self, req: Request) -> Response:
        """``/sweeps/NAME[/PAGE]``, NAME one segment of the raw (still quoted) path: a
        name with ``/`` (``a%2Fb``) is never read as a name and a page."""
        raw = req.scope.get("raw_path") or quote(req.scope["path"]).encode()
        rest = raw.split(b"?", 1)[0][len(b"/sweeps/"):]
        seg, _, sub = rest.partition(b"/")
        name = unquote_to_bytes(seg).decode("utf-8", "replace")
        page = unquote_to_bytes(sub).decode("utf-8", "replace")
        whole = unquote_to_bytes(rest).decode("utf-8", "replace")
        if page not in self.PAGES or not self._known(name):
            if whole != name and self._known(whole):  # /sweeps/a/b for the sweep "a/b"
                raise NotFound(f"no page at {req.url.path}; the sweep {whole!r} is at "
                               f"{sweep_url(whole)} (a '/' in a name is written %2F)")
            if page not in self.PAGES:
                raise NotFound(f"no page at {req.url.path}; start from /")
        return getattr(self, self.PAGES[page])(req, name)

    def by_query(self, req: Request) -> Response:
        """``/sweep[/PAGE]?name=NAME``: any sweep, the address of a name of dots only."""
        name = req.query_params.get("name")
        if name is None:
            raise BadRequest("give the sweep as ?name=NAME (or open /sweeps/NAME)")
        page = req.path_params.get("page", "")
        if page not in self.PAGES:
            raise NotFound(f"no page at {req.url.path}; start from /")
        return getattr(self, self.PAGES[page])(req, name)

    def _known(self, name: str) -> bool:
        return name_can_exist(name) and self.store.sweep_id(name) is not None

    def compare_html(self, req: Request) -> Response:
        """The report of several sweeps as cells of one comparison (``?sweep=A&sweep=B``)."""
        names = list(dict.fromkeys(req.query_params.getlist("sweep")))
        if len(names) < 2:
            raise BadRequest("compare: tick two or more sweeps, e.g. /compare?sweep=A&sweep=B")
        for n in names:
            self.study(n)  # an unknown sweep: 404 with the names
        from qkgeom.report.render import build_report

        with tempfile.TemporaryDirectory(prefix="qkgeom-serve-") as d:
            build_report(self.store, names[0], d, compare=names[1:], seed=self.seed,
                         n_boot=self.n_boot, finished_only=not flag_param(req, "unfinished"))
            text = (Path(d) / "report.html").read_text(encoding="utf-8")
        return HTMLResponse(text)

def _code_cell(r: dict[str, Any]) -> str:
    """The latest attempt's code: ``0.1.0+h1a2b3c4d @ 5e6f7a8`` (``*``: the checkout had
    uncommitted changes), the versions and host in its title."""
    if not r.get("code_version"):
        return "<td></td>"
    commit = r.get("git_commit")
    text = r["code_version"] + (f" @ {commit[:7]}{'*' if r.get('git_dirty') else ''}"
                                if commit else "")
    title = "; ".join(x for x in (r["code_version"], commit and f"git {commit}" + (
        " (uncommitted changes)" if r.get("git_dirty") else ""), r.get("versions")) if x)
    return f"<td class='code' title='{_e(title)}'>{_e(text)}</td>"


def _status_cell(status: str, stale_s: float | None) -> str:
    if stale_s is not None:  # running in the database, but its driver is gone
        return f"<td class='s-stale'>{_e(status)} (stale)</td>"
    return f"<td class='s-{_e(status)}'>{_e(status)}</td>"


def create_app(db: str | None = None, *, token: str | None = None,
               refresh: int = DEFAULT_REFRESH_S, n_boot: int = 10_000,
               seed: int = 0, wait_s: float = 1.0, update_every_s: float = 30.0,
               host: str = "127.0.0.1", allow_hosts: Iterable[str] = ()) -> Starlette:
    """The web app over database ``db``, opened read-only now (a bad URL or a database
    without qkgeom's schema fails here, with the usual one-line message). It answers the
    host names of :class:`HostRule` for a server bound to ``host``, plus ``allow_hosts``
    (pass the address it listens on: a test client's ``http://testserver`` is refused;
    use ``base_url="http://127.0.0.1"``). A page waits
    up to ``wait_s`` for verdicts and charts computed in the background, then shows the
    previous ones (or a note) and picks up the new ones on a later reload; each is
    recomputed at most every ``update_every_s`` seconds."""
    from contextlib import asynccontextmanager

    hosts = HostRule(host, allow_hosts)
    store = open_page_store(db)
    srv = Server(store, refresh=refresh, seed=seed, n_boot=n_boot, wait_s=wait_s,
                 update_every_s=update_every_s)

    def wrap(fn: Callable[[Request], Response]) -> Callable[[Request], Response]:
        def endpoint(req: Request) -> Response:  # sync: Starlette runs it in a thread
            try:
                return fn(req)
            except NotFound as e:
                return error_page(404, str(e))
            except BadRequest as e:
                return error_page(400, str(e))
            except QkgeomError as e:  # e.g. a database error: one line, no traceback
                return error_page(500, str(e))
            except Exception as e:  # never a traceback on the page; the log has it
                import logging

                logging.getLogger("qkgeom.serve").exception("%s", req.url.path)
                return error_page(500, f"internal error ({type(e).__name__}); see the "
                                       "server's log")

        return endpoint

    routes = [
        Route("/", wrap(srv.index)),
        Route("/sweeps/{rest:path}", wrap(srv.by_path)),
        Route("/sweep", wrap(srv.by_query)),
        Route("/sweep/{page}", wrap(srv.by_query)),
        Route("/compare", wrap(srv.compare_html)),
    ]

    async def http_error(req: Request, exc: Exception) -> Response:
        code = getattr(exc, "status_code", 500)
        return error_page(code, f"no page at {req.url.path}; start from /" if code == 404
                          else str(getattr(exc, "detail", exc)))

    async def server_error(req: Request, exc: Exception) -> Response:
        return error_page(500, f"internal error ({type(exc).__name__}); see the server's log")

    @asynccontextmanager
    async def lifespan(app: Starlette) -> Any:
        yield
        srv.jobs.close()
        store.close()

    app = GuardedApp(routes=routes, lifespan=lifespan, hosts=hosts,
               exception_handlers={HTTPException: http_error, Exception: server_error})
    if token:
        app.add_middleware(TokenMiddleware, token=token)
    app.state.server = srv
    return app


def open_page_store(db: str | None) -> Store:
    """The page's store: :func:`qkgeom.store.open_store` read-only (schema checks and
    one-line errors), and for a SQLite file an engine whose every connection opens the
    file ``mode=ro`` (``file_readonly``): a read-only file handle, so no write reaches the
    file even with ``PRAGMA query_only`` switched off."""
    from qkgeom.store import Store, open_store
    from qkgeom.store.engine import make_engine, sqlite_path

    store = open_store(db, create=False, readonly=True)
    if store.dialect != "sqlite" or sqlite_path(store.url) is None:
        return store
    url, revision = store.url, store.revision
    store.close()
    return Store(make_engine(url, create=False, readonly=True, file_readonly=True), url,
                 revision=revision, readonly=True)
