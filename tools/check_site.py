"""Open every page of the built site in a real browser and fail on what a reader would meet.

    python tools/check_site.py [_build/html]

Serves the build on a loopback port (a server thread of this process, stopped when it ends) and
opens every page in headless Chromium (Debian's `chromium` package, driven by Playwright's Python
API pointed at it: nothing downloads a browser). For every page: no JavaScript console error or
uncaught exception, no failed request for a local asset, no request that leaves loopback (the
site works offline: MathJax is served from `_static`), every image and plot loaded with a
non-zero natural size, and all math typeset by MathJax without an error. Then across pages:
every internal link and `#anchor` resolves to a built file and an element id; the search page
finds a term from a chapter; each notebook page's launch (Colab) and download buttons point at
the repository, branch and notebook path in `_config.yml`. First runs tools/check_pages.py (the
static checks of the HTML) on the same folder.

Writes screenshots of three representative pages to `<html>/_screenshots/` and prints the counts
checked. Exits 1 on any problem. A whole-run deadline (--timeout-s) and per-page timeouts keep CI
from hanging; a watchdog ends the process if the browser itself stops answering.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import re
import shutil
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))
import check_pages  # noqa: E402  (tools/ is not a package)

ROOT = Path(__file__).resolve().parents[1]
BROWSER_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
                "--no-first-run", "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--disable-default-apps", "--mute-audio"]
SEARCH = ("busbw", "book/parallelism/collectives")  # a term, and the chapter it must find
SCREENSHOTS = {"intro": "book/intro.html", "chapter": "book/compute/flops.html",
               "appendix": "book/appendix/hardware.html"}
REDIRECT = re.compile(r'<meta http-equiv="refresh" content="\d+;\s*url=([^"]+)"', re.I)
SKIP_DIRS = ("_static", "_sources", "_images", "_screenshots", "_sphinx_design_static")

# Runs in the page after load: wait for MathJax (if the page has math) and for every image to
# decode, then report what the page holds.
PAGE_SCRIPT = """
async () => {
  const imgs = [...document.images];
  imgs.forEach(i => { i.loading = "eager"; });
  await Promise.all(imgs.map(i => i.decode().catch(() => null)));
  const maths = [...document.querySelectorAll(".math")];
  if (maths.length && window.MathJax && MathJax.startup && MathJax.startup.promise) {
    await MathJax.startup.promise;
  }
  const ids = [...document.querySelectorAll("[id]")].map(e => e.id)
    .concat([...document.querySelectorAll("a[name]")].map(e => e.getAttribute("name")));
  return {
    images: imgs.map(i => ({src: i.currentSrc || i.src, ok: i.complete && i.naturalWidth > 0,
                            w: i.naturalWidth, h: i.naturalHeight})),
    math: maths.length,
    mathjax: !!window.MathJax,
    typeset: maths.filter(m => m.querySelector("mjx-container")).length,
    matherrors: document.querySelectorAll("mjx-merror, [data-mjx-error]").length,
    links: [...document.querySelectorAll("a[href]")].map(a => a.getAttribute("href")),
    launch: [...document.querySelectorAll("a[href]")].map(a => a.href)
      .filter(h => /colab\\.research\\.google\\.com|_sources\\/.*\\.ipynb$/.test(h)),
    ids: ids,
    wide: [...document.querySelectorAll("article table")]
      .filter(t => t.getBoundingClientRect().width >
                   document.querySelector("article").getBoundingClientRect().width + 1).length,
  };
}
"""


SCROLL_TO_PLOT = """
() => {
  const img = [...document.querySelectorAll("article img, main img")]
    .find(i => i.offsetParent !== null && i.naturalHeight > 100);
  if (img) { img.scrollIntoView({block: "center"}); return; }
  const table = document.querySelector("article table");  // else its first table
  if (table) table.scrollIntoView({block: "start"});
}
"""


class Problems(list):
    def add(self, page: str, what: str) -> None:
        self.append(f"{page}: {what}")


def serve(html: Path) -> tuple[http.server.ThreadingHTTPServer, threading.Thread, list[str]]:
    """A loopback HTTP server for `html` on a free port, in a daemon thread; returns the server
    (stop it with .shutdown()), its thread and the list of paths it served."""
    served: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, fmt: str, *args: object) -> None:  # quiet; keep what was asked
            served.append(self.path)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             functools.partial(Handler, directory=str(html)))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                              daemon=True)
    thread.start()
    return server, thread, served


def pages_of(html: Path) -> list[str]:
    return sorted(str(p.relative_to(html)) for p in html.rglob("*.html")
                  if not any(part in SKIP_DIRS for part in p.relative_to(html).parts))


def repository(config: Path) -> dict:
    import yaml

    cfg = yaml.safe_load(config.read_text())
    repo, launch = cfg.get("repository") or {}, cfg.get("launch_buttons") or {}
    url = repo["url"].rstrip("/")
    return {"url": url, "branch": repo.get("branch", "main"),
            "path": (repo.get("path_to_book") or ".").strip("/"),
            "colab": (launch.get("colab_url") or "").rstrip("/"),
            "github": urlsplit(url).path.strip("/")}


def find_browser(given: str | None) -> str:
    for candidate in (given, os.environ.get("CHROMIUM"), "/usr/bin/chromium",
                      shutil.which("chromium"), shutil.which("chromium-browser")):
        if candidate and Path(candidate).exists():
            return candidate
    raise SystemExit("no Chromium found: apt-get install -y chromium (or pass --browser PATH)")


def check(html: Path, config: Path, browser_path: str, timeout_s: float,
          shots: Path | None, search: tuple[str, str] | None = SEARCH,
          screenshots: dict[str, str] = SCREENSHOTS) -> tuple[Problems, Counter]:
    """Every page in the browser, then links, anchors and buttons across pages; returns the
    problems found and the counts of what was checked."""
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright

    problems, counts = Problems(), Counter()
    pages = pages_of(html)
    if not pages:
        problems.add(str(html), "no pages: build the book first")
        return problems, counts
    server, thread, served = serve(html)
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    deadline = time.monotonic() + timeout_s
    links: dict[str, list[str]] = {}  # page -> resolved internal hrefs
    ids: dict[str, set[str]] = {}  # page -> element ids
    launch: dict[str, list[str]] = {}
    external_links: set[str] = set()
    wide: dict[str, int] = {}  # page -> tables wider than the text column
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=browser_path, headless=True,
                                         args=BROWSER_ARGS, timeout=60_000)
            context = browser.new_context(viewport={"width": 1280, "height": 900},
                                          service_workers="block")
            page_name = {"current": ""}

            def route(r) -> None:  # only loopback: anything else is reported and refused
                url = r.request.url
                if url.startswith(base) or url.startswith(("data:", "blob:", "about:")):
                    r.continue_()
                else:
                    problems.add(page_name["current"], f"request leaves loopback: {url}")
                    r.abort()

            context.route("**/*", route)
            page = context.new_page()
            page.set_default_timeout(30_000)
            page.on("console", lambda m: m.type == "error" and problems.add(
                page_name["current"], f"console error: {m.text[:300]}"))
            page.on("pageerror", lambda e: problems.add(page_name["current"],
                                                        f"uncaught exception: {e}"))
            page.on("requestfailed", lambda r: r.url.startswith(base) and problems.add(
                page_name["current"], f"request failed: {r.url[len(base):]} ({r.failure})"))
            page.on("response", lambda r: r.url.startswith(base) and r.status >= 400 and
                    problems.add(page_name["current"], f"HTTP {r.status}: {r.url[len(base):]}"))
            for name in pages:
                if time.monotonic() > deadline:
                    problems.add(name, f"not checked: the {timeout_s:g} s deadline passed")
                    break
                page_name["current"] = name
                refresh = REDIRECT.search((html / name).read_text(errors="replace"))
                if refresh:  # the root index.html: a redirect, checked as a link
                    counts["redirects"] += 1
                    links[name] = [urljoin(base + name, refresh[1])[len(base):]]
                    continue
                try:
                    page.goto(base + name, wait_until="load")
                    info = page.evaluate(PAGE_SCRIPT)
                except PlaywrightError as e:
                    problems.add(name, f"did not load: {str(e).splitlines()[0]}")
                    continue
                counts["pages"] += 1
                ids[name] = set(info["ids"])
                launch[name] = info["launch"]
                for img in info["images"]:
                    counts["images"] += 1
                    if not img["ok"]:
                        problems.add(name, f"image did not load: {img['src']}")
                counts["math"] += info["math"]
                if info["wide"]:  # reported, not failed: the reader scrolls sideways
                    wide[name] = info["wide"]
                if info["math"] and (not info["mathjax"] or info["typeset"] < info["math"]):
                    problems.add(name, f"math not rendered: {info['typeset']} of {info['math']} "
                                       f"typeset (MathJax loaded: {info['mathjax']})")
                if info["matherrors"]:
                    problems.add(name, f"{info['matherrors']} MathJax errors")
                page_url = base + name
                for href in info["links"]:
                    url = urljoin(page_url, href)
                    if url.startswith(base):
                        links.setdefault(name, []).append(url[len(base):])
                    elif url.startswith(("http:", "https:")):
                        external_links.add(url)
                if name in screenshots.values() and shots is not None:
                    shot = next(k for k, v in screenshots.items() if v == name)
                    page.evaluate(SCROLL_TO_PLOT)  # the first plot (or table) with the prose
                    shots.mkdir(parents=True, exist_ok=True)
                    page.screenshot(path=str(shots / f"{shot}.png"))
                    counts["screenshots"] += 1
            if search:
                page_name["current"] = "search.html"
                check_search(page, base, search, problems, counts)
            context.close()
            browser.close()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    check_links(html, links, ids, problems, counts)
    check_launch(html, repository(config), launch, problems, counts)
    counts["external links (not followed)"] = len(external_links)
    counts["tables wider than the page (notice)"] = sum(wide.values())
    for name, n in sorted(wide.items()):
        print(f"notice: {name}: {n} table(s) wider than the text column (they scroll sideways)")
    counts["assets served"] = len({u.split("?")[0] for u in served
                                   if not u.split("?")[0].endswith(".html")})
    missing = [s for s in screenshots.values() if s not in pages]
    for s in missing:
        problems.add(s, "representative page for a screenshot is not in the build")
    return problems, counts


def check_search(page: object, base: str, search: tuple[str, str], problems: Problems,
                 counts: Counter) -> None:
    """The search page lists the chapter for a term that only its prose uses."""
    from playwright.sync_api import Error as PlaywrightError

    term, expect = search
    page.goto(f"{base}search.html?q={term}", wait_until="load")
    try:  # Sphinx's search writes its summary line when it has listed every result
        page.wait_for_function("(document.querySelector('#search-results .search-summary')"
                               " || {}).innerText", timeout=20_000)
    except PlaywrightError:
        problems.add("search.html", f"searching {term!r} did not finish in 20 s")
        return
    hrefs = page.eval_on_selector_all("#search-results ul.search li a",
                                      "els => els.map(e => e.getAttribute('href'))")
    counts["search results"] = len(hrefs)
    if not any(expect in (h or "") for h in hrefs):
        problems.add("search.html", f"searching {term!r} did not find {expect}: {hrefs[:5]}")


def check_links(html: Path, links: dict[str, list[str]], ids: dict[str, set[str]],
                problems: Problems, counts: Counter) -> None:
    """Every internal link's file exists, and its #anchor is an id on the target page."""
    seen = set()
    for page, targets in links.items():
        for target in targets:
            counts["internal links"] += 1
            path, _, anchor = target.partition("#")
            path = unquote(path.split("?")[0]) or page
            if (page, target) in seen:
                continue
            seen.add((page, target))
            file = html / path
            if file.is_dir():
                file, path = file / "index.html", path.rstrip("/") + "/index.html"
            if not file.is_file():
                problems.add(page, f"link to a missing file: {target}")
                continue
            if anchor:
                counts["anchors"] += 1
                if path not in ids and path.endswith(".html"):
                    problems.add(page, f"link into a page that was not checked: {target}")
                elif path in ids and unquote(anchor) not in ids[path]:
                    problems.add(page, f"anchor does not exist: {target}")


def check_launch(html: Path, repo: dict, launch: dict[str, list[str]], problems: Problems,
                 counts: Counter) -> None:
    """Notebook pages: a Colab button to this repository, branch and notebook, and a download
    button for the notebook itself."""
    for page, hrefs in launch.items():
        source = html / "_sources" / Path(page).with_suffix(".ipynb")
        if not source.is_file():
            continue  # a Markdown page: nothing to launch
        counts["notebook pages"] += 1
        rel = str(Path(page).with_suffix(".ipynb"))
        nb = rel if repo["path"] in ("", ".") else f"{repo['path']}/{rel}"
        colab = f"{repo['colab']}/github/{repo['github']}/blob/{repo['branch']}/{nb}"
        if colab not in hrefs:
            got = [h for h in hrefs if "colab" in h]
            problems.add(page, f"no launch button to {colab} (found {got})")
        download = [h for h in hrefs if re.search(r"_sources/.*\.ipynb$", h)]
        if not any(h.endswith(f"_sources/{rel}") for h in download):
            problems.add(page, f"no download button for _sources/{rel} (found {download})")
        counts["launch and download buttons"] += 2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("html", nargs="?", default="_build/html", help="the built site")
    p.add_argument("--config", default=str(ROOT / "_config.yml"), help="the book's _config.yml")
    p.add_argument("--browser", help="Chromium executable (default: /usr/bin/chromium)")
    p.add_argument("--timeout-s", type=float, default=600, help="deadline for the whole check")
    p.add_argument("--no-static", action="store_true", help="skip tools/check_pages.py")
    args = p.parse_args(argv)
    html = Path(args.html)
    t0 = time.monotonic()
    status = 0 if args.no_static else check_pages.main(str(html))
    # the watchdog: if the browser stops answering, end the process rather than hang CI
    watchdog = threading.Timer(args.timeout_s + 120, lambda: os._exit(124))
    watchdog.daemon = True
    watchdog.start()
    problems, counts = check(html, Path(args.config), find_browser(args.browser),
                             args.timeout_s, html / "_screenshots")
    watchdog.cancel()
    for line in problems[:200]:
        print(line)
    if len(problems) > 200:
        print(f"... and {len(problems) - 200} more")
    print("browser check: " + ", ".join(f"{v} {k}" for k, v in counts.items()) +
          f"; {len(problems)} problems in {time.monotonic() - t0:.0f} s")
    if counts["screenshots"]:
        names = ", ".join(str(html / "_screenshots" / f"{k}.png") for k in SCREENSHOTS)
        print(f"screenshots: {names}")
    return 1 if problems or status else 0


if __name__ == "__main__":
    sys.exit(main())
