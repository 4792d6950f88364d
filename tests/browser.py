"""A real headless browser for the page tests: Playwright for Python driving Debian's chromium (`apt-get install
chromium`, as .ci/run does; Playwright's own browser download is not used), with every request a page makes
recorded, and the accessibility checks the pages are held to (axe-core's rules, from axe-playwright-python)."""

import shutil
from contextlib import contextmanager
from typing import Iterator, List

CHROMIUM = ("chromium", "chromium-browser")


def chromium_path() -> str:
    for name in CHROMIUM:
        path = shutil.which(name)
        if path:
            return path
    raise AssertionError("no chromium on PATH: install Debian's (apt-get install chromium), as .ci/run does")


@contextmanager
def browser() -> Iterator[object]:
    """A headless chromium, closed (with Playwright's driver) on exit."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=chromium_path(), headless=True, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


class Page:
    """A page of `browser`, every request it makes recorded (`requests`: their URLs, in order)."""

    def __init__(self, browser, width: int = 1280, height: int = 900):
        self.page = browser.new_page(viewport={"width": width, "height": height})
        self.requests: List[str] = []
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.errors: List[str] = []
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    def close(self) -> None:
        self.page.close()


def axe_violations(page) -> List[str]:
    """axe-core's WCAG 2 A and AA violations on the page as it is now (labels, contrast, names, keyboard access),
    one line each."""
    from axe_playwright_python.sync_playwright import Axe

    got = Axe().run(page, options={"runOnly": {"type": "tag", "values": ["wcag2a", "wcag2aa", "wcag21a",
                                                                          "wcag21aa"]}})
    assert got.response["passes"], "axe-core checked nothing on the page"
    return [f"{v['id']}: {v['help']} ({len(v['nodes'])} nodes: {'; '.join(str(n['target']) for n in v['nodes'][:3])})"
            for v in got.response["violations"]]


def keyboard_reach(page, selector: str, limit: int = 400) -> List[str]:
    """The elements matching `selector` that Tab never reaches from the top of the page (each named by its id, or
    its text)."""
    want = page.evaluate(f"""() => Array.from(document.querySelectorAll({selector!r}))
        .filter(e => !e.disabled && e.checkVisibility())
        .map((e, i) => {{ e.dataset.reachId = String(i); return String(i); }})""")
    seen = set()
    page.evaluate("() => document.activeElement && document.activeElement.blur()")
    page.locator("body").focus() if page.locator("body").count() else None
    for _ in range(limit):
        page.keyboard.press("Tab")
        got = page.evaluate("() => document.activeElement && document.activeElement.dataset.reachId")
        if got is not None:
            seen.add(got)
        if seen >= set(want):
            break
    return [page.evaluate(f"""() => {{ const e = document.querySelector('[data-reach-id="{i}"]');
        return e.id || e.textContent.trim().slice(0, 40); }}""") for i in want if i not in seen]


def boxes_overlap(a: dict, b: dict) -> bool:
    return (a["x"] < b["x"] + b["width"] and b["x"] < a["x"] + a["width"]
            and a["y"] < b["y"] + b["height"] and b["y"] < a["y"] + a["height"])
