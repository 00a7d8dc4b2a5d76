"""The chat page at ``/`` in a real headless Chromium against a real server on the bundled model.

What a user does: load the page, ask a text question (``12``), attach ``sample.png`` and ask about it
(``green``, the README's quick start), stop a long generation (the server's metrics count the
cancel), see a validation error, and the same behind an API key (the page asks for it). Model output
is untrusted: hostile markdown streamed through the page's own SSE path must render as inert text.
Skipped, with the reason, where chromium / chromedriver / selenium are missing (``.ci/run`` installs
them). Screenshots of each run go to ``webui-screenshots/`` (ignored); ``DS4SERVE_WEBUI_DOC_SHOT=1``
also refreshes ``docs/webui.png``, the README's picture.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from webui_driver import Page, cancellations, missing_browser, start_chromium, wait_for

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "models" / "ds4v-tiny"
SHOTS = ROOT / "webui-screenshots"
KEY = "webui-test-key"

pytestmark = [pytest.mark.skipif(missing_browser() is not None, reason=str(missing_browser())),
              pytest.mark.skipif(not (BUNDLED / "model.safetensors").exists(), reason="bundled model absent"),
              pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def driver():
    d = start_chromium()
    try:
        yield d
    finally:
        d.quit()


def _serve(api_key: str | None):
    from server_harness import serve

    return serve(BUNDLED, name="ds4v-tiny", random_weights=False, api_key=api_key,
                 settings={"max_seqs": 4, "max_model_len": 1024})


@pytest.fixture(scope="module")
def server():
    with _serve(None) as srv:
        yield srv


@pytest.fixture(scope="module")
def keyed_server():
    with _serve(KEY) as srv:
        yield srv


@pytest.fixture()
def page(driver, server) -> Page:
    p = Page(driver, server.base)
    p.open()
    _defaults(p)
    return p


def _defaults(p: Page) -> None:
    p.click("new-chat")
    for field, value in (("temperature", "0"), ("max-tokens", "32"), ("thinking", False), ("ignore-eos", False),
                         ("system", "")):
        p.set(field, value)


def test_text_and_image_questions(page: Page):
    r = page.ask("What is 7 + 5?")
    assert (r["state"], r["content"].strip(), r["error"]) == ("done", "12", "")
    assert "TTFT" in r["stats"] and "tokens" in r["stats"], r["stats"]
    page.click("new-chat")
    page.attach(BUNDLED / "sample.png")
    r = page.ask("What colour is the triangle?")
    assert (r["state"], r["content"].strip()) == ("done", (BUNDLED / "sample_answer.txt").read_text().strip())
    assert page.js("return document.querySelectorAll('.msg.user .images img').length") == 1
    assert page.js("return document.querySelectorAll('#attachments .thumb').length") == 0  # sent, cleared
    page.shot(SHOTS / "image-answer.png")
    if os.environ.get("DS4SERVE_WEBUI_DOC_SHOT") == "1":
        shutil.copyfile(SHOTS / "image-answer.png", ROOT / "docs" / "webui.png")


def _stop_long_generation(page: Page, base: str, key: str | None) -> None:
    """Start a generation that would run ~900 tokens, stop it once text streams, and check the server
    counted the client leaving."""
    before = cancellations(base, key)
    page.set("max-tokens", "900")
    page.set("ignore-eos", True)
    i = page.send("What is 7 + 5?")
    page.wait(lambda: page.reply(i)["state"] == "streaming" and len(page.reply(i)["content"]) >= 3,
              "the long generation never streamed")
    page.click("stop")
    page.wait(lambda: page.reply(i)["state"] == "stopped", "stop did not end the reply")
    assert "stopped" in page.reply(i)["stats"]
    wait_for(lambda: cancellations(base, key) == before + 1, 15, "the server to count the cancel")
    assert not page.js("return document.getElementById('send').hidden")  # ready for the next message


def test_stop_cancels_on_the_server(page: Page, server):
    _stop_long_generation(page, server.base, None)
    page.set("ignore-eos", False)
    page.set("max-tokens", "16")
    r = page.ask("What is 7 + 5?")  # the conversation goes on after a stop
    assert r["state"] == "done"


def test_validation_error_is_shown(page: Page):
    page.set("temperature", "5")
    r = page.ask("What is 7 + 5?")
    assert r["state"] == "error"
    assert r["error"].startswith("Error 400") and "temperature" in r["error"], r["error"]
    page.set("temperature", "0")


_HOSTILE = [
    "<script>window.__xss = 'script'</script>\n\n",
    "<img src=x onerror=\"window.__xss = 'img'\">\n\n",
    "[click me](javascript:window.__xss='link') and [ok](https://example.com/a_b)\n\n",
    "<a href=\"javascript:window.__xss='a'\">raw</a> **bold** `<b>code</b>`\n\n",
    "```html\n<script>window.__xss = 'fence'</script>\n```\n",
    "<svg onload=\"window.__xss='svg'\"></svg> <iframe src=\"javascript:window.__xss='frame'\"></iframe>",
]


def _stream_stub(driver) -> None:
    """Replace the page's fetch of /v1/chat/completions with a canned SSE stream of hostile text
    (reasoning and answer), so the output goes through the page's real stream parser and renderer."""
    driver.execute_script("""
        const pieces = arguments[0];
        const real = window.__realFetch || (window.__realFetch = window.fetch);
        window.fetch = async (url, init) => {
            if (!String(url).endsWith('/v1/chat/completions')) return real(url, init);
            const frame = (delta) =>
                'data: ' + JSON.stringify({choices: [{index: 0, delta, finish_reason: null}]}) + '\\n\\n';
            const frames = [frame({reasoning_content: pieces[0]})].concat(pieces.map((t) => frame({content: t})));
            frames.push('data: [DONE]\\n\\n');
            const enc = new TextEncoder();
            const body = new ReadableStream({start(c) { frames.forEach((f) => c.enqueue(enc.encode(f))); c.close(); }});
            return new Response(body, {status: 200, headers: {'Content-Type': 'text/event-stream'}});
        };""", _HOSTILE)


def _inert(page: Page) -> dict:
    return page.js("""
        const box = document.getElementById('messages');
        const all = Array.from(box.querySelectorAll('*'));
        return {
            scripts: box.querySelectorAll('script, iframe, svg, object, embed').length,
            imgs: Array.from(box.querySelectorAll('.msg.assistant img')).length,
            handlers: all.filter((e) => Array.from(e.attributes).some((a) => a.name.startsWith('on'))).length,
            badLinks: Array.from(box.querySelectorAll('a')).filter((a) => !/^https?:|^mailto:/.test(a.href)).length,
            links: Array.from(box.querySelectorAll('a')).map((a) => a.href),
            xss: window.__xss === undefined ? null : String(window.__xss),
            text: box.querySelector('.msg.assistant .content').textContent,
            reasoning: box.querySelector('.msg.assistant details.reasoning').textContent,
            reasoningOpen: box.querySelector('.msg.assistant details.reasoning').open,
            strong: box.querySelectorAll('.msg.assistant strong').length,
        };""")


def test_untrusted_output_is_inert(page: Page, driver):
    _stream_stub(driver)
    try:
        r = page.ask("anything")
        page.js("document.querySelector('.msg.assistant details.reasoning').open = true")  # render it too
        out = _inert(page)
    finally:
        driver.execute_script("if (window.__realFetch) window.fetch = window.__realFetch")
    assert r["state"] == "done"
    assert (out["scripts"], out["imgs"], out["handlers"], out["badLinks"], out["xss"]) == (0, 0, 0, 0, None), out
    assert out["links"] == ["https://example.com/a_b"]
    for shown in ("<script>window.__xss = 'script'</script>", "<img src=x onerror=", "[click me](javascript:",
                  "<b>code</b>", "<svg onload="):
        assert shown in out["text"], (shown, out["text"])
    assert "<script>window.__xss = 'script'</script>" in out["reasoning"]
    assert out["strong"] == 1


def test_renderer_edge_cases(page: Page):
    """ds4md.render straight: only its fixed elements, links only to http(s)/mailto."""
    cases = ["[x](JaVaScRiPt:alert(1))", "[x](data:text/html,<script>alert(1)</script>)", "**[x](vbscript:1)**",
             "<style>*{display:none}</style>", "`` <img src=x onerror=alert(1)> ``", "| a | <b>b</b> |\n|---|---|\n| "
             "<i onclick=x>1</i> | 2 |", "> <script>1</script>\n- <script>2</script>\n  - nested",
             "[a](https://ok.example/x) https://bare.example/y."]
    out = page.js("""
        const allowed = new Set(['DIV','P','H1','H2','H3','H4','H5','H6','UL','OL','LI','BLOCKQUOTE','PRE','CODE',
            'SPAN','STRONG','EM','DEL','A','BR','HR','TABLE','THEAD','TBODY','TR','TH','TD']);
        return arguments[0].map((src) => {
            const root = ds4md.render(src);
            const els = [root, ...root.querySelectorAll('*')];
            return {tags: els.filter((e) => !allowed.has(e.tagName)).map((e) => e.tagName),
                    attrs: els.flatMap((e) => Array.from(e.attributes).map((a) => a.name))
                              .filter((n) => !['class', 'href', 'target', 'rel', 'start', 'referrerpolicy']
                                                 .includes(n)),
                    links: Array.from(root.querySelectorAll('a')).map((a) => a.href), text: root.textContent};
        });""", cases)
    for src, o in zip(cases, out):
        assert o["tags"] == [] and o["attrs"] == [], (src, o)
    assert [o["links"] for o in out[:3]] == [[], [], []]
    assert out[7]["links"] == ["https://ok.example/x", "https://bare.example/y"]
    assert "<style>" in out[3]["text"] and "<img src=x onerror=alert(1)>" in out[4]["text"]


def test_with_an_api_key(driver, keyed_server):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    p = Page(driver, keyed_server.base)
    p.open(expect_key=True)
    p.wait(lambda: p.js("return document.getElementById('key-dialog').open"), "the page did not ask for the key")
    driver.find_element(By.ID, "key-input").send_keys(Keys.ESCAPE)  # declined: the 401 is shown, nothing hangs
    p.wait(lambda: "401" in p.js("return document.querySelector('.msg.notice')?.textContent || ''"),
           "the 401 was not shown after the key prompt was declined")
    assert p.text("model") == "not connected"
    p.click("key-change")
    for key in ("wrong-key", KEY):
        p.wait(lambda: p.js("return document.getElementById('key-dialog').open"), "no key prompt")
        driver.find_element(By.ID, "key-input").send_keys(key)
        p.click("key-save")
        if key == "wrong-key":
            p.wait(lambda: "refused" in p.text("key-reason"), "a wrong key was not refused")
    p.wait(lambda: p.text("model") == "ds4v-tiny", "the model name never showed after the key")
    assert p.js("return sessionStorage.getItem('ds4serve.apiKey')") == KEY
    _defaults(p)
    r = p.ask("What is 7 + 5?")
    assert (r["state"], r["content"].strip()) == ("done", "12")
    _stop_long_generation(p, keyed_server.base, KEY)
    p.set("ignore-eos", False)
    assert KEY not in driver.page_source
    p.shot(SHOTS / "api-key.png")


def test_thinking_toggle_shows_reasoning_collapsed(page: Page):
    page.set("thinking", True)
    page.set("max-tokens", "12")
    r = page.ask("What is 7 + 5?")
    page.set("thinking", False)
    assert r["state"] == "done", r
    box = page.js("""const d = document.querySelector('.msg.assistant details.reasoning');
                     return {hidden: d.hidden, open: d.open, text: d.querySelector('.reasoning-text').textContent};""")
    assert not box["hidden"] and not box["open"] and box["text"], box  # the server streamed reasoning_content


def test_paste_and_drop_attach_thumbnails(page: Page):
    """Paste and drop go through the page's own handlers (synthetic events carrying a real PNG file)."""
    n = page.d.execute_async_script("""
        const done = arguments[arguments.length - 1];
        const c = document.createElement('canvas');
        c.width = c.height = 32;
        c.getContext('2d').fillRect(0, 0, 16, 16);
        c.toBlob(async (blob) => {
            const files = () => { const dt = new DataTransfer();
                                  dt.items.add(new File([blob], 'drawn.png', {type: 'image/png'})); return dt; };
            document.getElementById('prompt').dispatchEvent(
                new ClipboardEvent('paste', {clipboardData: files(), bubbles: true, cancelable: true}));
            document.getElementById('messages').dispatchEvent(
                new DragEvent('drop', {dataTransfer: files(), bubbles: true, cancelable: true}));
            const t0 = Date.now();
            while (document.querySelectorAll('#attachments .thumb').length < 2 && Date.now() - t0 < 5000)
                await new Promise((r) => setTimeout(r, 20));
            done(document.querySelectorAll('#attachments .thumb').length);
        }, 'image/png');""")
    assert n == 2
    assert page.js("return ds4page.state.attachments.every((a) => a.url.startsWith('data:image/png;base64,'))")
    page.js("document.querySelector('#attachments .thumb .remove').click()")
    assert page.js("return document.querySelectorAll('#attachments .thumb').length") == 1
    page.click("new-chat")
    assert page.js("return document.querySelectorAll('#attachments .thumb').length") == 0


def test_queue_full_503_is_shown(page: Page, driver):
    """The server's 503 (queue full) as the server sends it: OpenAI body and Retry-After (canned here:
    filling the real queue would take many slow requests)."""
    driver.execute_script("""
        const real = window.__realFetch || (window.__realFetch = window.fetch);
        window.fetch = async (url, init) => {
            if (!String(url).endsWith('/v1/chat/completions')) return real(url, init);
            const body = {error: {message: 'the queue is full (64 waiting)', type: 'server_error', param: null,
                                  code: 'server_overloaded'}};
            return new Response(JSON.stringify(body), {status: 503, headers: {'Content-Type': 'application/json',
                                                                              'Retry-After': '2'}});
        };""")
    try:
        r = page.ask("What is 7 + 5?")
    finally:
        driver.execute_script("if (window.__realFetch) window.fetch = window.__realFetch")
    assert r["state"] == "error"
    assert r["error"] == "Error 503 (server_overloaded): the queue is full (64 waiting) (retry after 2 s)", r["error"]
