"""A real browser's view of a report page: Debian's chromium, driven headless by Playwright, opens
the page from disk and says what went wrong (console errors, script errors, any request for
something other than the page itself) and where every chart's marks and labels landed, as boxes
in page pixels, so a test can check that nothing overlaps. It never downloads a browser
(``playwright install`` is not used): the chromium is the system's, installed by
``bash bench/anchors/setup.sh chromium``."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from playwright.sync_api import Browser

CHROMIUM = Path("/usr/bin/chromium")
# no sandbox: CI and these machines run as root; the rest keeps chromium from calling home
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]
VIEWPORT = {"width": 1300, "height": 1400}
INSTALL = ("run `bash bench/anchors/setup.sh chromium` (Debian's chromium, with apt-get) and "
           "`.venv/bin/pip install -e '.[dev]'` (the playwright package; never `playwright install`)")


class BrowserMissing(RuntimeError):
    """Chromium or the playwright package is not installed: the message says how to install both."""


@dataclass(frozen=True)
class Box:
    """An element's bounding box in page pixels (getBoundingClientRect plus the page's scroll)."""
    variant: str | None
    x: float
    y: float
    width: float
    height: float

    def intersects(self, other: Box) -> bool:
        """True when the two boxes share some area (touching edges do not count)."""
        return (self.x < other.x + other.width and other.x < self.x + self.width
                and self.y < other.y + other.height and other.y < self.y + self.height)

    def within(self, other: Box, slack: float = 0.5) -> bool:
        return (other.x - slack <= self.x and self.x + self.width <= other.x + other.width + slack
                and other.y - slack <= self.y and self.y + self.height <= other.y + other.height + slack)


@dataclass
class ChartCheck:
    """One ``svg.chart`` as rendered."""
    kind: str  # data-chart
    task: str | None  # data-task (task-accuracy charts)
    variant: str | None  # data-variant of the svg itself (heat maps)
    box: Box
    marks: list[Box]  # each .mark, with its data-variant
    labels: list[Box]  # each .label, with its data-variant
    cells: list[str]  # each .cell's data-module (heat maps)

    @property
    def variants(self) -> list[str | None]:
        """The marks' data-variant values, in document order."""
        return [m.variant for m in self.marks]


@dataclass
class PageCheck:
    url: str
    console_errors: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)
    failed_requests: list[str] = field(default_factory=list)  # anything asked for but the page itself
    scripts: int = 0  # <script> elements on the page (a report has none)
    charts: list[ChartCheck] = field(default_factory=list)
    screenshot: Path | None = None

    def chart(self, kind: str, task: str | None = None, variant: str | None = None) -> ChartCheck:
        """The one chart of ``kind`` (and ``task`` / ``variant`` where given); fails if not exactly one."""
        found = [c for c in self.charts if c.kind == kind and (task is None or c.task == task)
                 and (variant is None or c.variant == variant)]
        assert len(found) == 1, f"{len(found)} charts {kind!r} {task or ''} {variant or ''} on {self.url}"
        return found[0]


@contextlib.contextmanager
def launch() -> Iterator[Browser]:
    """Headless chromium (the system's), closed on exit; ``BrowserMissing`` when it cannot start."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as e:
        raise BrowserMissing(f"the playwright package is not installed ({e}): {INSTALL}") from e
    executable = str(CHROMIUM) if CHROMIUM.exists() else shutil.which("chromium")
    if executable is None:
        raise BrowserMissing(f"no chromium ({CHROMIUM} is missing and none is on PATH): {INSTALL}")
    with sync_playwright() as p:
        try:
            browser = p.chromium.launch(executable_path=executable, args=ARGS)
        except Exception as e:  # a broken install: say so, with the way out
            raise BrowserMissing(f"chromium did not start ({e}): {INSTALL}") from e
        try:
            yield browser
        finally:
            browser.close()


_CHARTS_JS = """() => {
  const box = e => { const r = e.getBoundingClientRect();
    return {variant: e.getAttribute('data-variant'), x: r.x + window.scrollX, y: r.y + window.scrollY,
            width: r.width, height: r.height}; };
  return [...document.querySelectorAll('svg.chart')].map(svg => ({
    kind: svg.getAttribute('data-chart'), task: svg.getAttribute('data-task'),
    variant: svg.getAttribute('data-variant'), box: box(svg),
    marks: [...svg.querySelectorAll('.mark')].map(box), labels: [...svg.querySelectorAll('.label')].map(box),
    cells: [...svg.querySelectorAll('.cell')].map(e => e.getAttribute('data-module'))}));
}"""


def check_page(html_path: Path, screenshot: Path, browser: Browser | None = None) -> PageCheck:
    """Open ``html_path`` (file://) in headless chromium, with every request but the page's own
    refused and recorded, and report errors, charts and boxes; save a full-page PNG screenshot at
    ``screenshot``. Pass ``browser`` to reuse one (a launch costs about a second)."""
    if browser is None:
        with launch() as own:
            return check_page(html_path, screenshot, own)
    url = Path(html_path).resolve().as_uri()
    check = PageCheck(url=url)
    context = browser.new_context(viewport=VIEWPORT, device_scale_factor=1, service_workers="block")
    try:
        requested: list[str] = []

        def refuse_others(r) -> None:  # nothing outside the page may load, even if something asks
            if r.request.url == url:
                r.continue_()
            else:
                r.abort()

        context.route("**/*", refuse_others)
        page = context.new_page()
        page.on("console", lambda m: check.console_errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: check.page_errors.append(str(e)))
        page.on("request", lambda r: requested.append(r.url))
        page.on("requestfailed", lambda r: check.failed_requests.append(f"{r.url} ({r.failure})")
                if r.url == url else None)
        page.goto(url, wait_until="load")
        page.wait_for_load_state("networkidle")
        # the page must be self-contained: any request but its own is a failure, even data: URLs
        check.failed_requests += [u for u in dict.fromkeys(requested) if u != url]
        check.scripts = page.locator("script").count()
        check.charts = [ChartCheck(kind=c["kind"], task=c["task"], variant=c["variant"], box=Box(**c["box"]),
                                   marks=[Box(**b) for b in c["marks"]], labels=[Box(**b) for b in c["labels"]],
                                   cells=c["cells"]) for c in page.evaluate(_CHARTS_JS)]
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(screenshot), full_page=True)
        check.screenshot = screenshot
    finally:
        context.close()
    return check


def overlaps(chart: ChartCheck) -> list[str]:
    """What collides in ``chart``: a label with another label, or a label with any mark."""
    out = []
    for i, a in enumerate(chart.labels):
        out += [f"label {a.variant!r} overlaps label {b.variant!r}" for b in chart.labels[i + 1:] if a.intersects(b)]
        out += [f"label {a.variant!r} overlaps mark {m.variant!r}" for m in chart.marks if a.intersects(m)]
    return out
