"""The playground over HTTP: the page and its assets, the KV cache snapshot endpoint (contents, auth), and
``--disable-frontend``. The real-browser test is in test_playground_browser.py."""

from __future__ import annotations

import json
import re
import signal
import time

import httpx
import pytest

from pagedllm.entrypoints.cli.main import main
from pagedllm.entrypoints.openai.playground import ASSETS

KEY = "playground-key"
PROMPT = "Tell me about the history of paged memory in operating systems. "


def snapshot(url: str, **headers: str) -> dict:
    r = httpx.get(f"{url}/v1/kv_cache/snapshot", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def decode(snap: dict) -> tuple[str, list[int]]:
    states, owners = [], []
    for state, owner, count in snap["runs"]:
        states.append(state * count)
        owners.extend([owner] * count)
    return "".join(states), owners


def wait_for(predicate, url: str, timeout: float = 15.0, **headers: str) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        snap = snapshot(url, **headers)
        if predicate(snap) or time.monotonic() > deadline:
            return snap
        time.sleep(0.1)


@pytest.mark.slow  # a server on the default model, like each test marked slow below
def test_index_page_and_assets(server):
    r = httpx.get(f"{server.url}/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert '<script type="module" src="/playground/app.js">' in r.text
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert r.headers["x-content-type-options"] == "nosniff"
    for name, media_type in ASSETS.items():
        a = httpx.get(f"{server.url}/playground/{name}")
        assert a.status_code == 200, name
        assert a.headers["content-type"] == media_type
        assert len(a.content) > 100
    # Every file the page and its scripts load is served.
    for name in ("app.js", "style.css"):
        assert f"/playground/{name}" in r.text
    for script in (n for n in ASSETS if n.endswith(".js")):
        source = httpx.get(f"{server.url}/playground/{script}").text
        for imported in re.findall(r'from "\./([\w.]+)"', source):
            assert imported in ASSETS, f"{script} imports {imported}, which is not served"
    assert {"app.js", "api.js", "chat.js", "kvmap.js", "markdown.js", "sse.js", "style.css"} <= set(ASSETS)
    for bad in ("nope.js", "..%2Fplayground.py", "index.html"):
        missing = httpx.get(f"{server.url}/playground/{bad}")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == 404


@pytest.mark.slow
def test_snapshot_shape_when_idle(server):
    snap = wait_for(lambda s: s["scheduler"]["running"] == 0 and not s["owners"], server.url)
    states, _ = decode(snap)
    assert snap["object"] == "kv_cache.snapshot" and snap["encoding"] == "runs"
    assert len(states) == snap["num_blocks"] > 10 and snap["block_size"] > 0
    assert states[0] == "n" and set(states[1:]) <= {"f", "c"}
    assert snap["counts"]["used"] == snap["counts"]["shared"] == 0
    assert snap["counts"]["free"] + snap["counts"]["cached"] == snap["num_blocks"] - 1
    assert snap["kv_cache_usage"] == 0.0
    for key in ("running", "waiting", "preemptions", "steps"):
        assert isinstance(snap["scheduler"][key], int)
    assert set(snap["prefix_cache"]) == {"queries", "hits", "hit_rate"}
    assert set(snap["step_time_ms"]) == {"last", "mean", "max", "num_steps"}


@pytest.mark.slow
def test_snapshot_follows_a_streaming_request_and_its_abort(server, model_name):
    with httpx.Client(timeout=60) as http, http.stream(
            "POST", f"{server.url}/v1/chat/completions",
            json={"model": model_name, "messages": [{"role": "user", "content": PROMPT * 8}],
                  "max_tokens": 1500, "temperature": 0, "ignore_eos": True, "stream": True}) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        request_id = first["id"]
        snap = wait_for(lambda s: any(o["id"] == request_id for o in s["owners"]), server.url)
        owner = next(i for i, o in enumerate(snap["owners"]) if o["id"] == request_id)
        info = snap["owners"][owner]
        states, owners = decode(snap)
        held = [i for i, o in enumerate(owners) if o == owner]
        assert info["status"] == "running" and snap["scheduler"]["running"] >= 1
        assert len(held) >= 1 and all(states[i] in "us" for i in held)
        assert info["num_tokens"] > 8 * 10 and info["num_blocks"] >= len(held)
        assert snap["counts"]["used"] + snap["counts"]["shared"] > 0 and snap["kv_cache_usage"] > 0
        # Live: the request keeps growing while we watch.
        later = wait_for(lambda s: any(o["id"] == request_id and o["num_tokens"] > info["num_tokens"]
                                       for o in s["owners"]), server.url)
        assert later["seq"] > snap["seq"]
        # While watched, snapshots are published after steps: step_time_ms covers the steps since the
        # previous snapshot, at least one, and no more than the steps since `snap`.
        steps = later["scheduler"]["steps"] - snap["scheduler"]["steps"]
        assert 1 <= later["step_time_ms"]["num_steps"] <= steps and later["step_time_ms"]["mean"] > 0
    # The client left: the server aborts the request and its blocks go back (full ones stay cached).
    done = wait_for(lambda s: not s["owners"] and s["scheduler"]["running"] == 0, server.url)
    states, _ = decode(done)
    assert not done["owners"] and "u" not in states and "s" not in states
    assert done["counts"]["cached"] > 0  # full prompt blocks stay findable by the prefix cache


@pytest.mark.slow
def test_prefix_hit_shows_in_hit_rate(server, model_name):
    client = server.client()
    before = snapshot(server.url)["prefix_cache"]
    system = "You are a careful assistant who answers about block tables. " * 8
    for _ in range(2):
        client.chat.completions.create(model=model_name, max_tokens=2, temperature=0,
                                       messages=[{"role": "system", "content": system},
                                                 {"role": "user", "content": "Hi"}])
    after = wait_for(lambda s: s["prefix_cache"]["hits"] > before["hits"], server.url)["prefix_cache"]
    assert after["queries"] > before["queries"] and after["hits"] > before["hits"]
    assert 0 < after["hit_rate"] <= 1


def test_disable_frontend_flag_in_help(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--disable-frontend" in out and "playground" in out


@pytest.fixture(scope="module")
def keyed_server(remote_server_cls):
    srv = remote_server_cls(["--disable-frontend"], env={"PAGEDLLM_API_KEY": KEY})
    try:
        yield srv
    finally:
        srv.stop(signal.SIGKILL)


@pytest.mark.slow
def test_disable_frontend_and_snapshot_auth(keyed_server):
    url = keyed_server.url
    assert httpx.get(f"{url}/").status_code == 404
    assert httpx.get(f"{url}/playground/app.js").status_code == 404
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(f"{url}/v1/kv_cache/snapshot", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
    snap = snapshot(url, Authorization=f"Bearer {KEY}")
    assert snap["num_blocks"] > 0 and snap["runs"][0][0] == "n"
    assert httpx.get(f"{url}/health").status_code == 200


def test_every_frontend_file_ships_in_the_wheel():
    """pyproject's package-data must cover each kind of file in frontend/, or a non-editable install
    serves a broken page."""
    from pagedllm.entrypoints.openai.playground import FRONTEND_DIR

    pyproject = (FRONTEND_DIR.parents[3] / "pyproject.toml").read_text()
    for suffix in {p.suffix for p in FRONTEND_DIR.iterdir() if p.is_file()}:
        assert f'"frontend/*{suffix}"' in pyproject, suffix
