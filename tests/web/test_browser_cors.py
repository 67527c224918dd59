"""CORS in a real browser (Debian's Chromium, driven by Playwright as in tests/chat/test_browser.py): a page
from a second local port that the stack's CORS settings list streams a chat completion with ``fetch``; the
same page from a port they do not list is refused by the browser."""

from __future__ import annotations

import functools
import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from inference_engine.bus.redis_server import free_port

CHROMIUM = "/usr/bin/chromium"
LAUNCH_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
]

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="no Chromium: see scripts/install-browser"),
]

# Runs in the page: POST a streamed chat completion, read the body as it arrives.
STREAM_CHAT = """async ([url, key, model]) => {
  try {
    const reply = await fetch(url + "/v1/chat/completions", {
      method: "POST",
      headers: {"Authorization": "Bearer " + key, "Content-Type": "application/json"},
      body: JSON.stringify({model, stream: true, max_tokens: 8, temperature: 0,
                            messages: [{role: "user", content: "Name a colour."}]}),
    });
    const reader = reply.body.getReader();
    const decoder = new TextDecoder();
    let text = "", reads = 0;
    for (;;) {
      const {done, value} = await reader.read();
      if (done) break;
      reads += 1;
      text += decoder.decode(value, {stream: true});
    }
    return {status: reply.status, reads, text};
  } catch (error) {
    return {error: String(error)};
  }
}"""


@contextmanager
def _page_server(port: int, folder: Path) -> Iterator[str]:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}/index.html"
    finally:
        server.shutdown()
        server.server_close()


def test_a_listed_origin_streams_and_another_is_refused(stack, tmp_path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    (tmp_path / "index.html").write_text("<!doctype html><title>another site</title>")
    with (
        _page_server(stack.cors_port, tmp_path) as listed,
        _page_server(free_port(), tmp_path) as unlisted,
        sync_api.sync_playwright() as playwright,
    ):
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        try:
            page = browser.new_page()
            page.goto(listed)
            result = page.evaluate(STREAM_CHAT, [stack.base_url, stack.api_key, stack.model])
            assert result.get("status") == 200, result
            events = [line for line in result["text"].split("\n") if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]" and len(events) >= 3, result
            page.goto(unlisted)
            refused = page.evaluate(STREAM_CHAT, [stack.base_url, stack.api_key, stack.model])
            assert "error" in refused and "fetch" in refused["error"].lower(), refused
        finally:
            browser.close()
