"""`rl ui`'s server (rl/ui/server.py) over a real run directory and SQLite store, through HTTP: the token and the
Host allow-list guard every route, the headers forbid inline script, the JSON carries values as they are (the page
puts them in as text: tests/integration/test_ui_browser.py), filters, sorts and pages answer, and serving reads only:
the run directory's bytes are the same after."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import urllib.error
import urllib.request

import pytest

from rl.ui.data import Dashboard, UIError
from rl.ui.server import COOKIE, CSP, UIServer
from tests.ui_run import XSS, make_run


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    run = make_run(tmp_path_factory.mktemp("ui") / "run")
    before = _digests(run)
    server = UIServer(Dashboard([run]), port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server, run, before
    server.shutdown()
    server.server_close()
    server.dashboard.close()


def _digests(d):
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()}


def _get(server, path, token=True, host=None, cookie=None, method="GET"):
    port = server.server_address[1]
    sep = "&" if "?" in path else "?"
    url = f"http://127.0.0.1:{port}{path}" + (f"{sep}token={server.token}" if token else "")
    req = urllib.request.Request(url, method=method)
    if host:
        req.add_header("Host", host)
    if cookie:
        req.add_header("Cookie", cookie)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_every_route_needs_the_token_or_its_cookie_and_an_allowed_host(served):
    server, _, _ = served
    for path in ("/", "/app.js", "/api/runs", "/api/samples?run=0"):
        status, _, body = _get(server, path, token=False)
        assert status == 403 and b"token" in body, path
    status, headers, _ = _get(server, "/")  # the token in the URL: the page, and a cookie for what follows
    assert status == 200 and headers["Set-Cookie"].startswith(f"{COOKIE}={server.token};")
    assert "HttpOnly" in headers["Set-Cookie"] and "SameSite=Strict" in headers["Set-Cookie"]
    status, _, _ = _get(server, "/api/runs", token=False, cookie=f"{COOKIE}={server.token}")
    assert status == 200
    assert _get(server, "/api/runs", token=False, cookie=f"{COOKIE}=guess")[0] == 403
    port = server.server_address[1]
    for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1:{port + 1}"):  # DNS rebinding: another name
        status, _, body = _get(server, "/api/runs", host=host)
        assert status == 403 and b"Host header" in body, host
    assert _get(server, "/api/runs", host=f"localhost:{port}")[0] == 200
    assert _get(server, "/api/runs", method="POST")[0] == 405  # read-only


def test_pages_forbid_inline_script_and_the_json_carries_values_as_they_are(served):
    server, _, _ = served
    status, headers, body = _get(server, "/")
    assert headers["Content-Security-Policy"] == CSP and "script-src 'self'" in CSP and "unsafe-inline" not in CSP
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert b"<script>" not in body and b"onerror" not in body and b"https://" not in body  # no inline code, no CDN
    runs = json.loads(_get(server, "/api/runs")[2])["runs"]
    assert runs[0]["name"] == f"run {XSS}" and runs[0]["stages"] == ["sft", "grpo"]
    assert (runs[0]["steps"], runs[0]["heldout"], runs[0]["status"]) == (300, 0.625, "stopped")
    s = json.loads(_get(server, "/api/sample?run=0&id=s009")[2])
    assert s["reason"] == f"expected 42 {XSS}" and s["prompt"].endswith(XSS) and s["turns"][1]["text"] == f"42 {XSS}\n"
    assert [t["trained"] for t in s["tokens"]][16:21] == [True, False, False, False, True]  # the tool's output: untrained
    assert "".join(t["text"] for t in s["tokens"][:17]) == "call: print(6*7)\n"
    two = json.loads(_get(server, "/api/sample?run=0&id=s003")[2])
    assert [v for _, _, v in two["segments"]] == [1, 2] and {t["version"] for t in two["tokens"]} == {1, 2}
    status, _, body = _get(server, "/api/sample?run=0&id=nope")
    assert status == 400 and json.loads(body)["error"] == "no sample 'nope' in run 0"


@pytest.mark.parametrize(("query", "expected"), [
    ("limit=5", ["s000", "s001", "s002", "s003", "s004"]),
    ("limit=3&offset=117", ["s117", "s118", "s119"]),
    ("limit=4&sort=-seq", ["s119", "s118", "s117", "s116"]),
    ("step=2&min_reward=1&limit=50", ["s062", "s067", "s072", "s077", "s082", "s087", "s092", "s097"]),
    ("effort=50&dataset=arith&limit=50", []),  # i % 6 == 0 are gsm (i % 3 == 0)
    ("min_lag=1", ["s003", "s061"]),
])
def test_the_samples_table_filters_sorts_and_pages(served, query, expected):
    server, _, _ = served
    rows = json.loads(_get(server, f"/api/samples?run=0&{query}")[2])["rows"]
    assert [r["sample_id"] for r in rows] == expected


FILTER_CASES = [{}, {"dataset": "arith"}, {"step": "2"}, {"min_reward": "1"}, {"max_reward": "0"}, {"effort": "50"},
                {"teacher": f"t0 {XSS}"}, {"finish_reason": "eos"}, {"status": "finished"}, {"correct": "1"},
                {"min_lag": "1"}, {"dataset": "arith", "min_reward": "1", "step": "1"}]


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_every_filter_and_sort_pages_as_python_orders_the_rows_walking_only_a_covering_index(request, tmp_path, backend):
    """Each page equals the run's rows filtered and ordered in Python (by the key, NULL where the database puts it,
    then seq), on SQLite and PostgreSQL. On SQLite the page's query is one walk of a covering browse index
    (rl/store/schema.py BROWSE_INDEXES) in the page's order: no temporary B-tree (a sort of every match) and no read
    of the table, whatever the filter (BENCHMARKS.md, issue 45: a sort of the matches costs ~320 ms at 1M samples, a
    walk of the whole run ~100 ms)."""
    from sqlalchemy import create_engine, event, text

    url = None if backend == "sqlite" else str(request.getfixturevalue("postgres_url"))
    run = make_run(tmp_path / "run", url=url)
    engine = create_engine(url or f"sqlite:///{run / 'trajectories.db'}")
    with engine.connect() as c:
        rows = [dict(r._mapping) for r in c.execute(text("select * from samples"))]
    engine.dispose()
    keys = {"seq": "seq", "reward": "reward", "step": "train_step", "length": "num_response_tokens", "lag": None}
    tests = {"dataset": lambda r, v: r["dataset"] == v, "step": lambda r, v: r["train_step"] == int(v),
             "min_reward": lambda r, v: r["reward"] >= float(v), "max_reward": lambda r, v: r["reward"] <= float(v),
             "effort": lambda r, v: r["effort"] == int(v), "teacher": lambda r, v: r["teacher"] == v,
             "finish_reason": lambda r, v: r["finish_reason"] == v, "status": lambda r, v: r["status"] == v,
             "correct": lambda r, v: bool(r["correct"]) == (v == "1"),
             "min_lag": lambda r, v: r["max_version"] - r["min_version"] >= int(v)}
    null_first = backend == "sqlite"  # ascending; PostgreSQL puts NULL last
    d = Dashboard([run])
    statements: list[tuple[str, tuple]] = []
    event.listen(d.run("0").store()._engine, "before_cursor_execute",
                 lambda conn, cursor, sql, params, context, many: statements.append((sql, params)))
    plans = sqlite3.connect(f"file:{run / 'trajectories.db'}?immutable=1", uri=True) if backend == "sqlite" else None
    try:
        for f in FILTER_CASES:
            matching = [r for r in rows if all(tests[k](r, v) for k, v in f.items())]
            assert matching, f
            for sort, col in keys.items():
                def key(r, col=col):
                    v = r["max_version"] - r["min_version"] if col is None else r[col]
                    return ((v is not None) == null_first, v if v is not None else 0, r["seq"])

                for desc in (False, True):
                    expected = [r["sample_id"] for r in sorted(matching, key=key, reverse=desc)]
                    for offset in (0, 7):
                        statements.clear()
                        page = d.samples("0", {**f, "sort": ("-" if desc else "") + sort, "offset": str(offset), "limit": "9"})
                        assert [r["sample_id"] for r in page["rows"]] == expected[offset:offset + 9], (f, sort, desc)
                        if plans is None:
                            continue
                        sql, params = next((s, p) for s, p in statements if "OFFSET" in s)
                        plan = " | ".join(r[3] for r in plans.execute("EXPLAIN QUERY PLAN " + sql, params))
                        # one covering index walk, in the page's order: no temporary B-tree
                        assert plan.startswith("SEARCH samples USING COVERING INDEX ix_samples_browse_"), (f, sort, plan)
                        assert " | " not in plan and "TEMP B-TREE" not in plan, (f, sort, plan)
    finally:
        if plans is not None:
            plans.close()
        d.close()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_store_url_serves_each_of_its_runs_from_the_store_alone(request, tmp_path, backend):
    """`rl ui URL`: every run of a shared store (two here), named and described from its `runs` row, curves from the
    train steps it recorded, samples as for a run directory; nothing of a run directory is read (it is gone)."""
    import shutil

    url = (f"sqlite:///{tmp_path / 'shared.db'}" if backend == "sqlite"
           else str(request.getfixturevalue("postgres_url")))
    make_run(tmp_path / "a", url=url, name="first")
    make_run(tmp_path / "b", n=5, url=url, name="second")
    shutil.rmtree(tmp_path / "a")
    shutil.rmtree(tmp_path / "b")
    d = Dashboard([url])
    try:
        runs = sorted(d.runs_page()["runs"], key=lambda r: r["name"])
        assert [(r["name"], r["stages"], r["steps"], r["heldout"]) for r in runs] == [
            ("first", ["sft", "grpo"], 3, 0.5), ("second", ["sft", "grpo"], 3, 0.5)]
        first = runs[0]["key"]
        curve = d.curve(first, "rollout/reward")
        assert (curve["x"], curve["y"]) == ([1, 2, 3], [0.25, 0.5, 0.75])
        assert len(d.samples(first, {"limit": "200"})["rows"]) == 120
        assert d.sample(first, "s009")["turns"][1]["text"] == f"42 {XSS}\n"
        assert "grpo" in d.run_page(first)["recipe"]
    finally:
        d.close()
    with pytest.raises(UIError, match="no trajectory store at"):
        Dashboard([f"sqlite:///{tmp_path / 'nope.db'}"])


def test_warming_walks_every_browse_index_of_each_run_and_writes_nothing(tmp_path):
    """`rl ui` reads each SQLite run's browse indexes once as it starts (`Dashboard.warm`): from a disk-cold page
    cache the first walk of each costs ~1 s at 1M samples (BENCHMARKS.md, issue 45)."""
    from sqlalchemy import event

    from rl.store.schema import BROWSE_INDEXES, LAG_INDEX

    runs = [make_run(tmp_path / "a", n=5), make_run(tmp_path / "b", n=5)]
    before = [_digests(r) for r in runs]
    d = Dashboard(runs)
    walked = []
    for key in d.runs:
        event.listen(d.run(key).store()._engine, "before_cursor_execute",
                     lambda conn, cursor, sql, params, context, many, key=key: walked.append((key, sql.split()[6])))
    lock = threading.Lock()
    assert d.warm(lock) >= 0 and not lock.locked()
    d.close()
    assert sorted(walked) == sorted((k, ix) for k in ("0", "1") for ix in (*BROWSE_INDEXES, LAG_INDEX))
    assert [_digests(r) for r in runs] == before


def test_the_timeline_has_each_steps_wall_time_and_every_config_version(served):
    server, _, _ = served
    t = json.loads(_get(server, "/api/timeline?run=0")[2])
    assert t["steps"][:3] == [1, 2, 3] and t["minutes"][0] == 0 and t["minutes"][2] == pytest.approx(2 / 60)
    assert len(t["steps"]) == 300  # the evaluation row is not a step
    assert [(v["version"], v["status"], v["train_step"]) for v in t["config_versions"]] == [(1, "applied", 2),
                                                                                           (None, "refused", 2)]
    assert t["config_versions"][1]["reason"] == f"unknown dataset {XSS}" and t["restarts"] == []


def test_each_token_carries_the_staleness_mask_its_train_step_applied(served):
    server, _, _ = served
    s = json.loads(_get(server, "/api/sample?run=0&id=s061")[2])  # step 2 trained version 1; max_staleness 0
    assert [t["stale"] for t in s["tokens"]][:5] == [True, True, True, False, False] and s["train_step"] == 2
    assert s["stale_note"] == "3 of 9 trained tokens stale (weights v1, max_staleness 0)"
    fresh = json.loads(_get(server, "/api/sample?run=0&id=s003")[2])  # step 1: versions 1 and 2 are not behind v0
    assert not any(t["stale"] for t in fresh["tokens"])
    untrained = json.loads(_get(server, "/api/sample?run=0&id=s110")[2])
    assert {t["stale"] for t in untrained["tokens"]} == {None} and untrained["stale_note"] == "not trained"


def test_a_filter_the_data_cannot_answer_is_one_line_and_a_400(served):
    server, _, _ = served
    for query, message in (("step=two", "step='two': expected an integer"), ("sort=name", "sort 'name'"),
                           ("limit=100000", "limit"), ("min_reward=nan", "finite"),
                           ("datset=arith", "unknown filter 'datset'")):
        status, _, body = _get(server, f"/api/samples?run=0&{query}")
        assert status == 400 and message in json.loads(body)["error"], query


def test_a_curve_is_downsampled_keeping_its_extremes_and_serving_changes_nothing(served):
    server, run, before = served
    c = json.loads(_get(server, "/api/curve?run=0&metric=rollout/reward")[2])
    assert c["points"] == 300 and c["x"][:3] == [1, 2, 3] and len(c["y"]) == 300
    d = Dashboard([run])
    small = d.curve("0", "rl/entropy", points=20)
    assert len(small["x"]) <= 22 and max(small["y"]) == pytest.approx(2.0 - 1 / 300) and min(small["y"]) == 1.0
    assert "rl/entropy" in d.keys("0") and "step" not in d.keys("0")
    assert _digests(run) == before  # every request above read; none wrote


def test_a_curve_reads_each_value_of_its_metric_and_only_its_own(tmp_path):
    """The curve reader scans lines with a regex, not a JSON parse: it must agree with json.loads on every line
    shape a metrics file holds (key order, exponents, negative values, NaN, a key that extends another, a line the
    job is still writing)."""
    run = make_run(tmp_path / "run", n=3)
    rows = [{"step": 1, "rl/loss": 1e-05}, {"rl/loss": -0.5, "step": 2, "time": 3.0}, {"step": 3, "rl/loss_x": 9.0},
            {"step": 4, "rl/loss": float("nan")}, {"step": 5, "rl/loss": 2}, {"step": 6.5, "rl/loss": 3.25e3},
            {"step": 7, "note": "rl/loss"}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 8, "rl/loss": 4')
    c = Dashboard([run]).curve("0", "rl/loss")
    assert (c["x"], c["y"]) == ([1, 2, 5, 6.5], [1e-05, -0.5, 2.0, 3250.0])


def test_a_run_without_a_store_lists_and_its_samples_page_says_why_in_one_line(tmp_path):
    """A run directory whose job has not written its store yet: the runs page lists it, the samples route answers 400
    with the store's one line, and the server goes on serving."""
    run = tmp_path / "new"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "time": 1.0, "rollout/reward": 0.5}\n')
    server = UIServer(Dashboard([run]), port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        status, _, body = _get(server, "/api/samples?run=0")
        assert status == 400 and "\n" not in json.loads(body)["error"] and "trajectories.db" in json.loads(body)["error"]
        assert json.loads(_get(server, "/api/runs")[2])["runs"][0]["steps"] == 1
    finally:
        server.shutdown()
        server.server_close()


def test_rl_ui_refuses_a_missing_run_directory_or_a_taken_port_in_one_line(tmp_path, capsys, served):
    from rl.cli.commands import main

    assert main(["ui", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == f"rl ui: {tmp_path / 'nope'}: not a run directory"
    server, run, _ = served
    assert main(["ui", str(run), "--port", str(server.server_address[1])]) == 2  # the fixture's server holds it
    err = capsys.readouterr().err
    assert err.startswith("rl ui: ") and len(err.strip().splitlines()) == 1
