"""Screenshots of `rl ui`'s pages for the docs (docs/ui.md), from real run directories, in headless Chromium (Debian's
chromium and chromium-driver, through Selenium: the browser tests' setup, tests/integration/test_ui_browser.py).

    python tools/ui_screenshots.py RUN_DIR... --out docs/ui [--prefix smollm2-] [--sample-with turns|segments]

Per run: the curves, the samples table, the timeline and one sample page (the newest sample with tool turns, coloured
by trained mask, or the newest with more than one policy version, coloured by version; else the newest); the runs
table once. The files are PNGs named
`<prefix><page>.png`.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl.ui.data import Dashboard  # noqa: E402
from rl.ui.server import UIServer  # noqa: E402


def driver(width: int, height: int):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, chromedriver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and chromedriver):
        raise SystemExit("ui_screenshots: needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={width},{height}",
                "--disable-gpu", "--no-first-run"):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(chromedriver), options=opts)


def pick_sample(dashboard: Dashboard, key: str, want: str) -> str | None:
    """A sample id of the run to show: with tool turns, or with more than one policy version (segments)."""
    rows = dashboard.samples(key, {"limit": "200", "sort": "-seq"})["rows"]
    for r in rows:
        s = dashboard.sample(key, r["sample_id"])
        if (want == "turns" and s.get("turns")) or (want == "segments" and len(s.get("segments", [])) > 1):
            return r["sample_id"]
    return rows[0]["sample_id"] if rows else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--out", type=Path, default=Path("docs/ui"))
    ap.add_argument("--prefix", default="")
    ap.add_argument("--sample-with", choices=["turns", "segments"], default="segments")
    ap.add_argument("--size", default="1400x1100")
    a = ap.parse_args()
    from selenium.webdriver.support.ui import WebDriverWait

    dashboard = Dashboard(a.runs)
    server = UIServer(dashboard, port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    width, height = (int(x) for x in a.size.split("x"))
    browser = driver(width, height)
    a.out.mkdir(parents=True, exist_ok=True)
    base = f"http://127.0.0.1:{server.server_address[1]}/?token={server.token}"

    def shot(hash_: str, ready: str, name: str, colour: str | None = None) -> None:
        browser.get(f"{base}#{hash_}")
        WebDriverWait(browser, 60).until(lambda d: d.find_element("id", "main").get_attribute("data-ready") == ready
                                         or d.find_elements("id", "error"))
        if browser.find_elements("id", "error"):
            raise SystemExit(f"ui_screenshots: {hash_}: {browser.find_element('id', 'error').text}")
        if colour is not None:  # the sample page's "colour by"
            from selenium.webdriver.support.ui import Select

            Select(browser.find_element("id", "color-mode")).select_by_value(colour)
        path = a.out / f"{a.prefix}{name}.png"
        browser.save_screenshot(str(path))
        print(path)

    try:
        shot("/", "/", "runs")
        keys = list(dashboard.runs)
        shot(f"/curves?runs={','.join(keys)}", "/curves", "curves")
        for key in keys:
            suffix = "" if len(keys) == 1 else f"-{key}"
            shot(f"/samples?run={key}", "/samples", f"samples{suffix}")
            shot(f"/timeline?run={key}", "/timeline", f"timeline{suffix}")
            sid = pick_sample(dashboard, key, a.sample_with)
            if sid is not None:
                shot(f"/sample?run={key}&id={sid}", "/sample", f"sample{suffix}",
                     colour="version" if a.sample_with == "segments" else "trained")
    finally:
        browser.quit()
        server.shutdown()
        server.server_close()
        dashboard.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
