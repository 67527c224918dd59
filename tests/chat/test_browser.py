"""The chat page in headless Chromium (Debian's package, driven by Playwright): log in, ask, watch the answer
grow, stop it, ask again. A screenshot lands in test-output/chat/."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from .conftest import ADMIN

CHROMIUM = "/usr/bin/chromium"
OUTPUT = Path(__file__).resolve().parents[2] / "test-output" / "chat"
LAUNCH_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="no Chromium: see scripts/install-browser"),
]


def test_chat_in_the_browser(stack) -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    OUTPUT.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 760})
            page.set_default_timeout(30_000)
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))

            page.goto(stack.base_url + "/chat/")  # → the login page first
            page.fill("#id_username", ADMIN[0])
            page.fill("#id_password", ADMIN[1])
            page.click("button[type=submit]")
            page.wait_for_url("**/chat/")
            sync_api.expect(page.locator("#model option")).to_have_text([stack.model])

            page.click(".settings summary")
            page.fill("#max_tokens", "300")
            page.fill("#prompt", "Write a long story about a lighthouse keeper.")
            page.keyboard.press("Enter")
            answer = page.locator(".msg.assistant .body").first
            lengths = _growing_lengths(answer)
            assert len(lengths) >= 2, lengths  # seen at two different partial lengths while streaming
            page.click("#stop")
            sync_api.expect(page.locator(".msg.assistant .stats").first).to_contain_text("stopped")
            assert page.locator("#send").is_visible()

            page.fill("#max_tokens", "24")
            page.fill("#prompt", "Show a Python hello world in a ``` code block, then say <b>bye</b>.")
            page.click("#send")
            second = page.locator(".msg.assistant").nth(1)
            sync_api.expect(second.locator(".stats")).to_contain_text("tokens/s", timeout=90_000)
            sync_api.expect(second.locator(".stats")).to_contain_text("TTFT")
            assert second.locator(".body").inner_text().strip()
            assert page.locator(".msg.user").count() == 2
            assert page.locator(".msg b").count() == 0  # model or user text never becomes markup
            page.screenshot(path=str(OUTPUT / "chat.png"), full_page=True)

            page.click("#new-chat")
            assert page.locator(".msg").count() == 0
            assert not errors, errors
        finally:
            browser.close()


def _growing_lengths(answer, limit: float = 60.0) -> list[int]:
    """Distinct non-empty lengths of the streaming answer, sampled until two are seen."""
    seen: list[int] = []
    deadline = time.monotonic() + limit
    while len(seen) < 2 and time.monotonic() < deadline:
        length = len(answer.inner_text())
        if length and (not seen or length != seen[-1]):
            seen.append(length)
        time.sleep(0.05)
    return seen
