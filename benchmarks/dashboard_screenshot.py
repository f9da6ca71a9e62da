"""A screenshot of a running stack's dashboard, as a PNG.

    python benchmarks/dashboard_screenshot.py http://127.0.0.1:8080 --out dashboard.png

Opens ``URL/dashboard`` in headless Chromium (Debian's ``chromium``; ``--chromium`` for
another), waits until the page has drawn ``--samples`` points of its own (the history the
stack keeps comes with the first), then writes the whole page.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from playwright.sync_api import Error as PlaywrightError
from playwright.sync_api import sync_playwright

CHROMIUM = "/usr/bin/chromium"


def screenshot(
    url: str,
    out: Path,
    *,
    chromium: str = CHROMIUM,
    samples: int = 2,
    width: int = 1400,
    timeout_s: float = 30.0,
) -> Path:
    """Write the dashboard of the stack at ``url`` to ``out``, once it shows at least
    ``samples`` samples; return ``out``."""
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": width, "height": 900})
            page.goto(f"{url.rstrip('/')}/dashboard", timeout=timeout_s * 1e3)
            page.wait_for_function(
                "n => Number(document.querySelector('[data-testid=sample-seq]').textContent) >= n",
                arg=samples,
                timeout=timeout_s * 1e3,
            )
            out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(out), full_page=True)
        finally:
            browser.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="the stack's front door, e.g. http://127.0.0.1:8080")
    parser.add_argument("--out", type=Path, default=Path("dashboard.png"))
    parser.add_argument("--chromium", default=CHROMIUM, help="the browser to drive")
    parser.add_argument("--samples", type=int, default=2, help="wait for this many samples")
    parser.add_argument("--width", type=int, default=1400, help="the window's width, pixels")
    args = parser.parse_args(argv)
    try:
        written = screenshot(
            args.url, args.out, chromium=args.chromium, samples=args.samples, width=args.width
        )
    except PlaywrightError as exc:
        print(f"no screenshot of {args.url}/dashboard: {exc}", file=sys.stderr)
        return 1
    print(written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
