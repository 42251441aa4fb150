"""The built site: `mkdocs build --strict` (the tutorials not executed, to stay
fast: `EPIFIT_DOCS_EXECUTE=0`), every public name's API entry on it, no page
naming an internal path, no broken internal link, and, in headless Chromium
(Debian's `chromium` and `chromium-driver`, which `.ci/run` installs), the
home page rendering and the search box finding `calibrate`. The site is served
from a local `http.server`; nothing needs the network."""

import functools
import html
import http.server
import os
import shutil
import subprocess
import sys
import threading
import urllib.parse
from html.parser import HTMLParser
from pathlib import Path

import pytest
from test_docs import INTERNAL, api

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")

pytest.importorskip("mkdocs", reason="the docs extra (mkdocs) is not installed")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {
        **os.environ,
        "EPIFIT_DOCS_EXECUTE": "0",
        "NO_MKDOCS_2_WARNING": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return out


class _Page(HTMLParser):
    """The ids, the links (`href`/`src`) and the text of one HTML page."""

    def __init__(self):
        super().__init__()
        self.ids, self.links, self.text = set(), [], []
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        if tag == "a" and "name" in attrs:
            self.ids.add(attrs["name"])
        for key in ("href", "src"):
            if attrs.get(key):
                self.links.append(attrs[key])
        if tag in ("script", "style"):
            self._skip += 1

    def handle_endtag(self, tag):
        if tag in ("script", "style"):
            self._skip -= 1

    def handle_data(self, data):
        if not self._skip:
            self.text.append(data)


@functools.cache
def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def _pages(site: Path) -> list[Path]:
    return sorted(site.rglob("*.html"))


def test_every_public_name_is_on_the_site(site):
    ids = set()
    for path in (site / "api").rglob("*.html"):
        ids |= _parse(path).ids
    missing = [
        home
        for (package, name), home in api.homes().items()
        if home == f"{package}.{name}" and home not in ids
    ]
    assert not missing, missing


def test_tutorials_and_cli_are_on_the_site(site):
    for name in ("01_quickstart", "02_metapopulation_neural_beta", "03_scenarios"):
        assert (site / "tutorials" / name / "index.html").is_file(), name
    cli = "".join(_parse(site / "cli" / "index.html").text)
    assert "usage: epifit calibrate" in cli and "usage: epifit data import" in cli


def test_no_built_page_names_internal_paths(site):
    found = []
    for path in _pages(site):
        text = html.unescape("".join(_parse(path).text))
        found += [
            f"{path.relative_to(site)}: {m.group(0)!r}" for m in INTERNAL.finditer(text)
        ]
    assert not found, "\n".join(found)


def _target(site: Path, page: Path, link: str) -> tuple[Path, str] | None:
    """The file and fragment an internal link points to (None: external)."""
    parts = urllib.parse.urlsplit(link)
    if parts.scheme or parts.netloc or link.startswith(("mailto:", "javascript:")):
        return None
    path = urllib.parse.unquote(parts.path)
    if not path:
        target = page
    elif path.startswith("/"):
        target = site / path.lstrip("/")
    else:
        target = (page.parent / path).resolve()
    if target.is_dir():
        target = target / "index.html"
    return target, urllib.parse.unquote(parts.fragment)


def broken_links(site: Path) -> tuple[int, list[str]]:
    """`(links checked, broken ones)` over every page of `site`: a link to a
    file that is not there, or to an anchor its page does not have."""
    broken, checked = [], 0
    for page in _pages(site):
        for link in _parse(page).links:
            hit = _target(site, page, link)
            if hit is None:
                continue
            target, fragment = hit
            checked += 1
            where = f"{page.relative_to(site)}: {link}"
            if not target.is_file():
                broken.append(f"{where} (no file)")
            elif fragment and target.suffix == ".html":
                if fragment not in _parse(target).ids:
                    broken.append(f"{where} (no #{fragment})")
    return checked, broken


def test_no_broken_internal_link(site):
    checked, broken = broken_links(site)
    assert checked > 500, checked  # the check saw the site's links
    assert not broken, "\n".join(broken)


def test_link_check_finds_broken_links(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "index.html").write_text('<h2 id="x">x</h2>')
    (tmp_path / "index.html").write_text(
        '<a href="a/#x">ok</a> <a href="a/">ok</a> <a href="https://x.org/y">ext</a>'
        '<a href="a/#y">no anchor</a> <a href="b/">no file</a> <img src="c.png">'
    )
    checked, broken = broken_links(tmp_path)
    assert checked == 5
    assert broken == [
        "index.html: a/#y (no #y)",
        "index.html: b/ (no file)",
        "index.html: c.png (no file)",
    ]


@pytest.fixture(scope="module")
def served(site):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip(
            "headless Chromium is not installed (Debian: apt-get install chromium "
            "chromium-driver; .ci/run installs them in CI)"
        )
    webdriver = pytest.importorskip(
        "selenium.webdriver", reason="selenium (the test extra) is not installed"
    )
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # a desktop window: the navigation sidebar and the header's search box show
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
    ):
        options.add_argument(flag)
    service = webdriver.ChromeService(executable_path=CHROMEDRIVER)
    driver = webdriver.Chrome(options=options, service=service)
    yield driver
    driver.quit()


def test_home_page_renders(browser, served):
    from selenium.webdriver.common.by import By

    browser.get(served)
    assert browser.title.startswith("epifit")
    h1 = browser.find_element(By.CSS_SELECTOR, "article h1")
    assert h1.text == "epifit"
    nav = browser.find_element(By.CSS_SELECTOR, "nav.md-nav--primary").text
    for section in ("Getting started", "Tutorials", "How-to guides", "Reference"):
        assert section in nav
    # material's JavaScript ran: it sets this class on the root element
    assert "js" in (
        browser.find_element(By.TAG_NAME, "html").get_attribute("class") or ""
    )


def test_search_finds_calibrate(browser, served):
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(served)
    box = WebDriverWait(browser, 30).until(
        ec.element_to_be_clickable((By.CSS_SELECTOR, "input.md-search__input"))
    )
    box.click()
    box.send_keys("calibrate")
    WebDriverWait(browser, 60).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, "li.md-search-result__item")
    )
    # material shows the first results and more as the list scrolls: scroll
    # until no more come, then read every result's links
    items = lambda d: d.find_elements(By.CSS_SELECTOR, "li.md-search-result__item")
    while True:
        seen = len(items(browser))
        browser.execute_script(
            "document.querySelector('.md-search__scrollwrap').scrollTop = 1e9"
        )
        try:  # the next batch, if there is one
            WebDriverWait(browser, 10).until(lambda d, n=seen: len(items(d)) > n)
        except TimeoutException:
            break
    links = [
        a.get_attribute("href") or ""
        for a in browser.find_elements(By.CSS_SELECTOR, "li.md-search-result__item a")
    ]
    pages = {urllib.parse.urlsplit(h).path for h in links}
    # the guide pages and the API entry of calibrate are found
    assert {"/getting-started/", "/calibration/", "/api/fitting/"} <= pages, pages
    # a result opens its page
    browser.get(next(h for h in links if "api/fitting/" in h))
    assert "calibrate" in browser.find_element(By.CSS_SELECTOR, "article").text
