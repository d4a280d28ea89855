"""The KV cache view of a server with two engines (--data-parallel-size 2) in a real browser: one map per engine.

Same browser set-up as test_playground_browser.py (whose `browser` fixture this module shares); a module of its
own so that its two-engine server never runs beside that module's server.
"""

from __future__ import annotations

import json
import queue
import signal
import threading

import httpx
import pytest
from test_playground_browser import CACHED_RGB, FREE_RGB, browser, shot, wait_js  # noqa: F401 - a fixture

MODEL = "playground-dp-model"
NULL_RGB = (0x1F, 0x29, 0x37)  # kvmap.js STATE_COLOURS
# Shorter than a block: no prefix to route by, so round-robin alone decides (one request per engine).
PROMPTS = ["The capital of France is", "Three primes:"]


@pytest.fixture(scope="module")
def dp_server(remote_server_cls):
    srv = remote_server_cls(["--served-model-name", MODEL, "--data-parallel-size", "2",
                             "--data-parallel-routing", "round-robin"])
    try:
        yield srv
    finally:
        srv.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def page(browser, dp_server):  # noqa: F811 - the imported fixture
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    pg.set_default_timeout(20_000)
    pg.goto(dp_server.url + "/#kv")
    yield pg
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def canvas_pixel(page, canvas_id: str, block: int) -> tuple[int, int, int]:
    return tuple(page.evaluate("""([id, block]) => {
        const c = document.getElementById(id);
        const cell = +c.dataset.cell, cols = +c.dataset.cols, dpr = window.devicePixelRatio || 1;
        const x = (block % cols) * cell + cell / 2, y = Math.floor(block / cols) * cell + cell / 2;
        return [...c.getContext('2d').getImageData(Math.floor(x * dpr), Math.floor(y * dpr), 1, 1).data]
            .slice(0, 3);
    }""", [canvas_id, block]))


def sfx(i: int) -> str:
    """The id suffix of engine i's elements (engine 0 keeps the single-engine ids)."""
    return f"-{i}" if i else ""


def section(i: int) -> str:
    return f"document.getElementById('kv-engine{sfx(i)}')"


def blocks_of(page, engine: int, request_id: str) -> list[int]:
    """Block ids the request holds on the engine, from the endpoint's `engines` list (what the page reads)."""
    return page.evaluate("""async ([engine, rid]) => {
        const s = (await (await fetch('/v1/kv_cache/snapshot')).json()).engines[engine];
        const owner = s.owners.findIndex(o => o.id === rid);
        const out = []; let i = 0;
        for (const [state, o, n] of s.runs) { for (let k = 0; k < n; k++, i++) if (o === owner) out.push(i); }
        return owner < 0 ? [] : out;
    }""", [engine, request_id])


def test_one_labelled_map_per_engine(page):
    wait_js(page, f"+{section(0)}?.dataset.seq > 0 && +{section(1)}?.dataset.seq > 0")
    assert "multi" in page.locator("#kv-view").get_attribute("class")
    sections = page.locator("#kv-engines > section.kv-engine")
    assert sections.count() == 2
    for i, suffix in enumerate(map(sfx, (0, 1))):
        label = page.locator(f"#kv-engine-label{suffix}")
        assert label.is_visible() and label.inner_text() == f"engine {i}"
        assert sections.nth(i).get_attribute("aria-labelledby") == f"kv-engine-label{suffix}"
        assert sections.nth(i).get_attribute("data-engine") == str(i)
        assert page.get_by_role("region", name=f"engine {i}").count() == 1
        canvas = page.locator(f"#kv-canvas{suffix}")
        assert canvas.is_visible() and f"engine {i}," in canvas.get_attribute("aria-label")
        assert int(canvas.get_attribute("data-cell")) >= 3
        # Drawn: block 0 is the null block, the next one free (or cached after the engine's warm-up).
        assert canvas_pixel(page, f"kv-canvas{suffix}", 0) == NULL_RGB
        assert canvas_pixel(page, f"kv-canvas{suffix}", 1) in {FREE_RGB, CACHED_RGB}
        assert page.locator(f"#kv-blocks{suffix}").inner_text().endswith("free")
        assert page.locator(f"#kv-owners-caption{suffix}").inner_text() == f"Requests holding blocks on engine {i}"
    # The two maps sit side by side at this width, and the legend is drawn once, above both.
    box0, box1 = (page.locator(f"#kv-canvas{s}").bounding_box() for s in map(sfx, (0, 1)))
    assert box1["x"] > box0["x"] + box0["width"] and abs(box1["y"] - box0["y"]) < 2
    assert page.locator(".legend").count() == 1
    assert page.evaluate('''() => { const legend = document.querySelector('.legend');
        return legend.parentElement.id === 'kv-view' && !!(legend.compareDocumentPosition(
            document.getElementById('kv-engines')) & Node.DOCUMENT_POSITION_FOLLOWING); }''')
    # No id is used twice (each clone's ids end in -<engine>).
    assert page.evaluate("""() => { const ids = [...document.querySelectorAll('[id]')].map(e => e.id);
                                   return ids.length === new Set(ids).size; }""")
    shot(page, "kv-two-engines-idle")


def _stream(server, prompt: str, ids: queue.Queue, stop: threading.Event) -> None:
    """A long completion that reports its id and runs until `stop` (then the client leaves: the server aborts)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{server.url}/v1/completions", json=body) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                if ids is not None:
                    ids.put(json.loads(line[6:])["id"])
                    ids = None
                if stop.is_set():
                    return


def test_each_map_shows_its_engines_request(page, dp_server):
    ids: queue.Queue = queue.Queue()
    stop = threading.Event()
    threads = [threading.Thread(target=_stream, args=(dp_server, p, ids, stop), daemon=True) for p in PROMPTS]
    for t in threads:
        t.start()
    try:
        rids = {ids.get(timeout=60), ids.get(timeout=60)}
        owners = [f"({section(i)}.dataset.owners || '')" for i in (0, 1)]
        wait_js(page, f"{owners[0]}.split(' ').length === 1 && {owners[0]} !== '' && "
                      f"{owners[1]}.split(' ').length === 1 && {owners[1]} !== ''")
        on = [page.locator(f"#kv-engine{s}").get_attribute("data-owners") for s in map(sfx, (0, 1))]
        # One request on each engine, each in its own engine's map (the engine's id is "<response id>-<prompt>").
        assert {o.rsplit("-", 1)[0] for o in on} == rids, (on, rids)
        for i, suffix in enumerate(map(sfx, (0, 1))):
            assert page.locator(f"#kv-running{suffix}").inner_text() == "1"
            assert on[i] in page.locator(f"#kv-owners{suffix}").inner_text()
            assert on[1 - i] not in page.locator(f"#kv-owners{suffix}").inner_text()
        # #kv-view keeps engine 0's counts (the single-engine contract).
        assert page.locator("#kv-view").get_attribute("data-owners") == on[0]
        shot(page, "kv-two-engines-running")

        # Each map answers the keyboard on its own, and names its engine.
        page.locator("#kv-canvas-1").focus()
        page.keyboard.press("ArrowRight")
        assert page.locator("#kv-inspector-1").inner_text().startswith("Block 1 of engine 1:")
        assert page.locator("#kv-inspector").inner_text().startswith("Hover")  # engine 0's untouched
        page.locator("#kv-canvas").focus()
        page.keyboard.press("ArrowRight")
        page.keyboard.press("ArrowRight")
        assert page.locator("#kv-inspector").inner_text().startswith("Block 2 of engine 0:")
        assert page.locator("#kv-tip-1").is_hidden()  # left with the focus
        # The tooltip over one of engine 1's request's blocks names that request.
        block = blocks_of(page, 1, on[1])[0]
        cell, cols = (int(page.locator("#kv-canvas-1").get_attribute(a)) for a in ("data-cell", "data-cols"))
        page.locator("#kv-canvas-1").hover(position={"x": (block % cols + 0.5) * cell,
                                                     "y": (block // cols + 0.5) * cell})
        tip = page.locator("#kv-tip-1")
        assert tip.is_visible() and tip.inner_text().startswith(f"Block {block} of engine 1: in use")
        assert on[1] in tip.inner_text()
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    view = [f"{section(i)}.dataset" for i in (0, 1)]
    wait_js(page, " && ".join(f"{v}.used === '0' && {v}.owners === ''" for v in view), timeout=15_000)
