"""``qkgeom serve`` against a hostile browser and hostile inputs (issue 40, item 5): it
answers only its own host names (DNS rebinding), every response carries a
Content-Security-Policy the page's own content works under and the anti-sniffing,
anti-framing and referrer headers, the SQLite file is opened read-only at the file level,
no query parameter gives a 5xx, and sweep names with URL-special characters work."""

from __future__ import annotations

import hashlib
import http.client
import re
import socket
import sqlite3
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from stats_fixtures import write_trials

pytest.importorskip("starlette")
from starlette.testclient import TestClient  # noqa: E402

from qkgeom.web.serve import create_app  # noqa: E402

BASE = "http://127.0.0.1:8765"
# names an old database may hold (today's commands refuse most of them at creation)
ODD_NAMES = ["a/b", "x/trials.csv", "q?x=1&y=2", "h#frag", "pct%41%2F", "sp ace",
             "ünï-名前", "..", "<script>alert(1)</script>", "it's \"quoted\""]


def _values(step: int, layer: int) -> dict[str, float]:
    return {"pr_q": 10.0 + step / 100, "pr_k": 9.0, "entropy": 2.0 - step / 1000}


def plant(url: str, name: str, *, status: str = "terminated") -> None:
    write_trials(url, name, [
        {"depth": 2, "init": "gaussian", "arm": "none", "seed": s, "status": status,
         "values": _values} for s in (0, 1)], steps=[0, 10, 20], max_steps=20)


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    path = tmp_path_factory.mktemp("hard") / "hard.db"
    url = "sqlite:///" + str(path)
    plant(url, "plain")
    for n in ODD_NAMES:
        plant(url, n)
    return url, path


@pytest.fixture(scope="module")
def client(db):
    with TestClient(create_app(db[0], n_boot=200, wait_s=0, update_every_s=0),
                    base_url=BASE) as c:
        yield c


# --------------------------------------------------------------------------- Host


@pytest.mark.parametrize("host", ["attacker.example:8765", "attacker.example",
                                  "127.0.0.1.attacker.example", "localhost.attacker.example",
                                  "evil.localhost:8765", "[::2]:8765", "10.0.0.1:8765",
                                  "127.0.0.1:80@evil", "localhost:notaport"])
def test_other_hosts_are_refused(client, host: str) -> None:
    r = client.get("/sweeps/plain/trials.csv", headers={"Host": host})
    assert r.status_code == 421, (host, r.status_code)
    assert "trial_key" not in r.text
    lines = r.text.strip().splitlines()
    assert len(lines) == 1 and r.headers["content-type"].startswith("text/plain")
    assert "answers only the hosts 127.0.0.1, localhost, [::1]" in lines[0]
    assert "--host" in lines[0] and "--allow-host" in lines[0]


@pytest.mark.parametrize("host", ["127.0.0.1:8765", "127.0.0.1", "localhost:8765",
                                  "localhost", "LOCALHOST:9000", "[::1]:8765", "[::1]",
                                  "localhost."])
def test_own_hosts_are_answered_with_any_port(client, host: str) -> None:
    # any port: behind `ssh -L 9000:127.0.0.1:8765` the browser sends localhost:9000
    r = client.get("/sweeps/plain/trials.csv", headers={"Host": host})
    assert r.status_code == 200 and r.text.startswith("trial_id")


def test_the_host_check_comes_before_the_token(db) -> None:
    app = create_app(db[0], token="tok", n_boot=200, wait_s=0)
    with TestClient(app, base_url=BASE) as c:
        r = c.get("/?token=tok", headers={"Host": "attacker.example"})
        assert r.status_code == 421 and "set-cookie" not in r.headers
        assert c.get("/?token=tok").status_code == 200


def test_a_public_bind_answers_its_names_and_addresses(db) -> None:
    app = create_app(db[0], token="tok", host="0.0.0.0", allow_hosts=["lab.example"],
                     n_boot=200, wait_s=0)
    me = socket.gethostname()
    with TestClient(app, base_url=BASE) as c:
        auth = {"Authorization": "Bearer tok"}
        for host in ("lab.example:8765", "LAB.example", f"{me}:8765", "192.168.1.10:8765",
                     "[fe80::1]:8765", "127.0.0.1:8765", "localhost"):
            assert c.get("/", headers={**auth, "Host": host}).status_code == 200, host
        r = c.get("/", headers={**auth, "Host": "attacker.example:8765"})
        assert r.status_code == 421
        assert "lab.example" in r.text and me in r.text and "any IP address" in r.text
    # a bind to one address: that address and loopback, not the others
    app = create_app(db[0], token="tok", host="192.168.1.10", n_boot=200, wait_s=0)
    with TestClient(app, base_url=BASE) as c:
        auth = {"Authorization": "Bearer tok"}
        assert c.get("/", headers={**auth, "Host": "192.168.1.10:8765"}).status_code == 200
        assert c.get("/", headers={**auth, "Host": "192.168.1.11:8765"}).status_code == 421


def _raw_get(port: int, path: str, host: str) -> tuple[int, dict[str, str], str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.putrequest("GET", path, skip_host=True)
        conn.putheader("Host", host)
        conn.endheaders()
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode()
    finally:
        conn.close()


def test_real_server_refuses_a_rebound_host(db) -> None:
    """`curl -H "Host: attacker.example:PORT" .../sweeps/plain/trials.csv` against a real
    `qkgeom serve` (uvicorn): 421, no data; the same request for 127.0.0.1 gets the CSV."""
    from test_serve import serve_process

    proc, base = serve_process(db[0])
    try:
        port = urlsplit(base).port
        code, headers, body = _raw_get(port, "/sweeps/plain/trials.csv",
                                       f"attacker.example:{port}")
        assert code == 421 and "trial_key" not in body, body
        assert "frame-ancestors 'none'" in headers["content-security-policy"]
        code, headers, body = _raw_get(port, "/sweeps/plain/trials.csv", f"127.0.0.1:{port}")
        assert code == 200 and body.startswith("trial_id")
        assert headers["x-content-type-options"] == "nosniff"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_cli_allow_host_on_a_public_bind(db) -> None:
    """`qkgeom serve --host 0.0.0.0 --token T --allow-host NAME` answers NAME."""
    import subprocess
    import sys

    from test_serve import ROOT

    proc = subprocess.Popen(
        [sys.executable, "-c", "from qkgeom.cli import main; main()", "serve", "--db", db[0],
         "--host", "0.0.0.0", "--port", "0", "--token", "tok", "--allow-host", "lab.example"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        m = re.search(r"http://0\.0\.0\.0:(\d+)/", line)
        assert m, line + (proc.stdout.read() if proc.poll() is not None else "")
        port = int(m.group(1))
        deadline = time.time() + 60
        while True:
            try:
                code, _, _ = _raw_get(port, "/?token=tok", f"lab.example:{port}")
                break
            except OSError:
                assert time.time() < deadline
                time.sleep(0.2)
        assert code == 200
        assert _raw_get(port, "/?token=tok", f"attacker.example:{port}")[0] == 421
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# --------------------------------------------------------------------------- headers

CSP_NEEDED = {"default-src": "'none'", "frame-ancestors": "'none'", "base-uri": "'none'",
              "form-action": "'self'"}


def csp_of(r) -> dict[str, list[str]]:
    out = {}
    for part in r.headers["content-security-policy"].split(";"):
        words = part.split()
        if words:
            out[words[0]] = words[1:]
    return out


def test_every_response_carries_the_security_headers(db, client) -> None:
    paths = ["/", "/sweeps/plain?refresh=0", "/sweeps/plain/trials.csv",
             "/sweeps/plain/trials.parquet", "/sweeps/plain/trajectories.csv",
             "/sweeps/plain/claims.json", "/sweeps/nope", "/no/such/page",
             "/sweeps/plain?view=pie"]
    seen = [client.get(p) for p in paths]
    seen.append(client.get("/", headers={"Host": "attacker.example"}))
    with TestClient(create_app(db[0], token="tok", n_boot=200, wait_s=0),
                    base_url=BASE) as c:
        seen.append(c.get("/"))  # 401
    assert {r.status_code for r in seen} == {200, 400, 401, 404, 421}
    for r in seen:
        csp = csp_of(r)
        for k, v in CSP_NEEDED.items():
            assert csp.get(k) == [v], (r.url, k, csp)
        assert "script-src" not in csp  # no script at all: default-src 'none' applies
        assert not any("unsafe-eval" in v or "*" in v for v in csp.values())
        assert r.headers["x-content-type-options"] == "nosniff"
        assert r.headers["x-frame-options"] == "DENY"
        assert r.headers["referrer-policy"] == "no-referrer"


def test_the_page_works_under_its_policy(db, client) -> None:
    """What the policy allows is what the pages use: one <style> element whose hash the
    policy names, inline SVG (no style attributes, no external references), no script,
    no event handler, forms that submit to this server."""
    with TestClient(create_app(db[0], n_boot=200, wait_s=120, update_every_s=0),
                    base_url=BASE) as c:
        pages = [c.get(p) for p in ("/", "/sweeps/plain?refresh=0",
                                    "/sweeps/plain?metric=entropy&view=trial",
                                    "/sweeps/plain/report.html",
                                    "/compare?sweep=plain&sweep=a%2Fb", "/sweeps/nope")]
    for r in pages:
        html = r.text
        assert "<figure id='chart'><svg" in html or r.url.path != "/sweeps/plain"
        csp = csp_of(r)
        styles = re.findall(r"<style>(.*?)</style>", html, re.S)
        assert len(styles) == 1
        digest = hashlib.sha256(styles[0].encode()).digest()
        import base64

        assert f"'sha256-{base64.b64encode(digest).decode()}'" in csp["style-src"]
        assert "'unsafe-inline'" not in csp["style-src"]
        assert not re.search(r"\sstyle\s*=", html)  # would need 'unsafe-inline'
        assert "<script" not in html.lower()
        assert not re.search(r"\son[a-z]+\s*=", html, re.I)
        assert not re.search(r"""(src|href|action)\s*=\s*["']?(https?:)?//""", html, re.I)
        assert not re.search(r"<(img|image|iframe|object|embed|link|base)\b", html, re.I)
        for action in re.findall(r"<form[^>]*\saction='([^']*)'", html):
            assert action.startswith("/")
    svg = client.get("/sweeps/plain/chart.svg")
    assert svg.status_code == 200 and "image/svg+xml" in svg.headers["content-type"]
    assert "<script" not in svg.text and "default-src 'none'" in \
        svg.headers["content-security-policy"]


# --------------------------------------------------------------------------- read-only


def test_the_database_file_is_opened_read_only(db, tmp_path: Path) -> None:
    """A write through the page's own engine fails at the file level even with
    ``query_only`` switched off, and many requests leave the file's bytes and mtime as
    they were."""
    from test_serve import copy_db

    path = tmp_path / "ro.db"
    copy_db(db[1], path)
    before = (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns)
    app = create_app("sqlite:///" + str(path), n_boot=200, wait_s=120, update_every_s=0)
    with TestClient(app, base_url=BASE) as c:
        for _ in range(5):
            for p in ("/", "/sweeps/plain", "/sweeps/plain/trials.csv",
                      "/sweeps/plain/claims.json", "/sweeps/plain/report.html",
                      "/sweeps/a%2Fb/trajectories.csv?view=trial"):
                assert c.get(p).status_code == 200, p
        raw = app.state.server.store.engine.raw_connection()
        try:
            con = raw.driver_connection
            con.execute("PRAGMA query_only=OFF")
            assert con.execute("PRAGMA query_only").fetchone()[0] == 0
            with pytest.raises(sqlite3.OperationalError, match="readonly database"):
                con.execute("UPDATE sweeps SET name = 'x' WHERE name = 'plain'")
            with pytest.raises(sqlite3.OperationalError, match="readonly database"):
                con.execute("CREATE TABLE planted (x INTEGER)")
        finally:
            raw.close()
    after = (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns)
    assert after == before


def test_a_live_wal_database_is_read_while_another_process_writes(tmp_path: Path) -> None:
    """The page opens a WAL database closed cleanly (no -wal, no -shm: the page, read-only,
    must still read it), then a writer opens it and keeps writing: the page follows every
    new write, the newest rows still only in the -wal, and never answers with an error."""
    from qkgeom.records import ProbeRecord
    from qkgeom.store import open_store

    path = tmp_path / "live.db"
    url = "sqlite:///" + str(path)
    plant(url, "live", status="running")
    assert not Path(str(path) + "-wal").exists() and not Path(str(path) + "-shm").exists()

    def rec(step: int) -> ProbeRecord:
        return ProbeRecord(step=step, progress=step / 100, tokens=step, train_loss=1.0,
                           val_loss=0.5, lr=1e-3, tokens_per_s=1.0,
                           metrics=[(layer, None, k, v) for layer in range(2)
                                    for k, v in _values(step, layer).items()])

    def step_shown(c: TestClient) -> int:
        r = c.get("/sweeps/live/trials.csv")
        assert r.status_code == 200, r.text
        return int(r.text.splitlines()[1].split(",")[8])  # trial 1's latest step

    with TestClient(create_app(url, n_boot=200, wait_s=0, update_every_s=0),
                    base_url=BASE) as c:
        assert step_shown(c) == 20
        writer = open_store(url)
        try:
            tid = int(writer.trials("live")["id"][0])
            writer.write_probes(tid, [rec(30)])
            assert Path(str(path) + "-wal").stat().st_size > 0
            assert step_shown(c) == 30  # read from the writer's -wal
            stop, seen = threading.Event(), set()

            def keep_writing() -> None:
                for step in range(40, 1000, 10):
                    if stop.is_set():
                        return
                    writer.write_probes(tid, [rec(step)])
                    time.sleep(0.01)

            t = threading.Thread(target=keep_writing)
            t.start()
            try:
                for _ in range(30):
                    seen.add(step_shown(c))
                    assert c.get("/sweeps/live?refresh=0").status_code == 200
            finally:
                stop.set()
                t.join()
            assert len(seen) > 2  # the page saw the writer's new rows as they came
            last = writer.last_probes(writer.sweep_id("live"))[tid][0]
            assert step_shown(c) == last
        finally:
            writer.close()


# --------------------------------------------------------------------------- parameters

HOSTILE = ["%C2%B2", "%D9%A1", "-1", "1e3", "99999999999999999999999999", "1" * 5000,
           "%00", "%FF%FE", "%27%22%3E%3Cscript%3E", "..%2F..%2Fetc%2Fpasswd", "+", ""]
PARAMS = ["refresh", "metric", "view", "unfinished", "sort", "desc", "group", "f.cell",
          "f.depth", "f.config.lr", "sweep", "token"]


@pytest.mark.parametrize("param", PARAMS)
def test_no_query_parameter_gives_a_server_error(client, param: str) -> None:
    for value in HOSTILE:
        for path in ("/", "/sweeps/plain", "/sweeps/plain/trajectories.csv",
                     "/sweeps/plain/chart.svg", "/sweeps/plain/claims.json", "/compare"):
            r = client.get(f"{path}?{param}={value}&sweep=plain")
            assert r.status_code < 500, (path, param, value, r.status_code, r.text[-300:])
            if r.status_code >= 400:
                assert "id='message'" in r.text and "Traceback" not in r.text


def test_refresh_takes_ascii_digits_only(client) -> None:
    r = client.get("/sweeps/plain?refresh=%C2%B2")  # '²' is a digit to str.isdigit
    assert r.status_code == 400 and "give whole seconds" in r.text
    r = client.get("/?refresh=" + "9" * 5000)
    assert r.status_code == 400 and "at most 86400" in r.text
    assert "content='7'" in client.get("/?refresh=7").text


def test_hostile_sweep_names_in_the_path_are_404(client) -> None:
    for raw in ("%00", "%FF", "a%00b", "%2E%2E%2F%2E%2E", "x" * 3000, "%0A", "%E2%80%AE"):
        r = client.get(f"/sweeps/{raw}/trials.csv")
        assert r.status_code == 404, (raw, r.status_code)


# --------------------------------------------------------------------------- names


@pytest.mark.parametrize("name", ODD_NAMES)
def test_odd_sweep_names_link_open_and_download(client, name: str) -> None:
    import html as _html

    index = client.get("/").text
    links = re.findall(r"<a href='(/sweeps?[/?][^']*)'>(.*?)</a>", index)
    mine = [_html.unescape(h) for h, text in links if _html.unescape(text) == name]
    assert len(mine) == 1, (name, links)
    page = client.get(mine[0] + ("&" if "?" in mine[0] else "?") + "refresh=0")
    assert page.status_code == 200, (name, page.text[-300:])
    assert f"<h1>sweep {_html.escape(name)}</h1>" in page.text
    # every download the page links to opens, and is this sweep's
    nav = [_html.unescape(h) for h in re.findall(r"href='(/sweeps?[/?][^']*)'", page.text)]
    csv = [h for h in nav if urlsplit(h).path.endswith("/trials.csv")]
    assert len(csv) == 1
    r = client.get(csv[0])
    assert r.status_code == 200 and len(r.text.strip().splitlines()) == 3  # 2 trials
    for suffix in ("/trials.parquet", "/claims.json", "/trajectories.csv"):
        got = [h for h in nav if urlsplit(h).path.endswith(suffix)]
        assert got and client.get(got[0]).status_code == 200, (name, suffix)
    claims = [h for h in nav if urlsplit(h).path.endswith("/claims.json")][0]
    assert client.get(claims).json()["sweep"] == name


def test_a_slash_name_is_not_confused_with_a_download(client) -> None:
    """"x/trials.csv" is a sweep's name here: its page is /sweeps/x%2Ftrials.csv and
    /sweeps/x/trials.csv is the CSV of a sweep "x" (there is none: 404 that says how
    to write the name)."""
    assert "<h1>sweep x/trials.csv</h1>" in client.get("/sweeps/x%2Ftrials.csv").text
    r = client.get("/sweeps/x/trials.csv")
    assert r.status_code == 404 and "/sweeps/x%2Ftrials.csv" in r.text
    r = client.get("/sweeps/a/b")
    assert r.status_code == 404 and "/sweeps/a%2Fb" in r.text


def test_hostile_inputs_on_postgresql(pg_url) -> None:
    """The same answers over PostgreSQL, which refuses NUL in a text parameter: a NUL or
    invalid UTF-8 name is 404, never a database error; a bad refresh 400; a name with
    '/' opens; another Host 421."""
    plant(pg_url, "plain")
    plant(pg_url, "a/b")
    with TestClient(create_app(pg_url, n_boot=200, wait_s=0, update_every_s=0),
                    base_url=BASE) as c:
        for raw in ("%00", "a%00b", "%FF", "x" * 3000):
            r = c.get(f"/sweeps/{raw}/trials.csv")
            assert r.status_code == 404, (raw, r.status_code, r.text[-200:])
        r = c.get("/compare?sweep=plain&sweep=%00")
        assert r.status_code == 404, r.text[-200:]
        assert c.get("/sweeps/plain?refresh=%C2%B2").status_code == 400
        assert c.get("/sweeps/a%2Fb?refresh=0").status_code == 200
        csv = c.get("/sweeps/a%2Fb/trials.csv")
        assert csv.status_code == 200 and len(csv.text.strip().splitlines()) == 3
        for value in HOSTILE:
            for param in ("metric", "sort", "group", "f.cell", "view"):
                r = c.get(f"/sweeps/plain?{param}={value}")
                assert r.status_code < 500, (param, value, r.text[-200:])
        r = c.get("/sweeps/plain/trials.csv", headers={"Host": "attacker.example"})
        assert r.status_code == 421
