"""Regenerate the docs' playground screenshot: a trained run served by `stemlm serve`, the README's edit applied.

    .venv/bin/python scripts/playground_screenshot.py runs/tiny                    # writes docs/playground.png
    .venv/bin/python scripts/playground_screenshot.py runs/tiny --out /tmp/page.png

It trains nothing: RUN is a run folder (the README's `stemlm train --out runs/tiny`) or a checkpoint. The script
starts `stemlm serve RUN --port 0` on loopback, opens the page in headless Chromium through selenium, applies
the README's edit (Spain -> Germany in "The capital of Spain is", greedy, the page's other defaults) on the
Edit tab and saves the whole page as a PNG. Needs what the browser tests need: Debian's chromium and
chromium-driver and the selenium package.
"""

from __future__ import annotations

import argparse
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT, SOURCE, TARGET = "The capital of Spain is", "Spain", "Germany"
WIDTH = 1280
# Headless and offline: nothing in Chromium may reach for the network (see tests/serve/test_browser.py).
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-dev-shm-usage",
    f"--window-size={WIDTH},1000",
)


def start_server(run: Path) -> tuple[subprocess.Popen, str]:
    """`stemlm serve RUN` on a free loopback port, and its URL once it listens (read from its banner line)."""
    command = [sys.executable, "-m", "stemlm.cli.main", "serve", str(run), "--port", "0"]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in server.stderr:
        seen.append(line)
        found = re.search(r" at (http://127\.0\.0\.1:\d+)/ ", line)
        if found:
            # The server may log there: keep reading so a full pipe never blocks it.
            threading.Thread(target=server.stderr.read, daemon=True).start()
            return server, found.group(1)
    server.wait()
    sys.exit(f"stemlm serve {run} stopped before listening (exit {server.returncode}):\n{''.join(seen)}")


def screenshot(url: str, out: Path) -> str:
    """Apply the edit on the page at `url`, save the page to `out`; returns the edited output's text."""
    from selenium import webdriver
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(shutil.which("chromedriver")))
    try:
        by_id = driver.find_element
        driver.get(url + "/")
        WebDriverWait(driver, 120).until(lambda d: "ffn=" in by_id(By.ID, "model-info").text)
        by_id(By.ID, "tab-edit").click()
        for name, value in (("prompt", PROMPT), ("edit-source", SOURCE), ("edit-target", TARGET)):
            by_id(By.ID, name).clear()
            by_id(By.ID, name).send_keys(value)
        by_id(By.ID, "edit-btn").click()
        WebDriverWait(driver, 300).until(
            lambda d: by_id(By.ID, "error").is_displayed() or by_id(By.ID, "edit-output").get_attribute("data-state")
        )
        if by_id(By.ID, "error").is_displayed():
            sys.exit(f"the page refused the edit: {by_id(By.ID, 'error-text').text}")
        # The whole page in one picture: the window's height is the page's plus what the window itself takes.
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(WIDTH, height)
        driver.set_window_size(WIDTH, 2 * height - driver.execute_script("return window.innerHeight"))
        out.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(out))
        return by_id(By.ID, "edit-output").text
    finally:
        driver.quit()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("run", type=Path, help="trained run folder or checkpoint, e.g. runs/tiny")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "playground.png", help="PNG to write")
    args = parser.parse_args()
    if not args.run.exists():
        sys.exit(f"{args.run} does not exist; train one first: .venv/bin/stemlm train --out {args.run}")
    missing = [name for name in ("chromium", "chromedriver") if shutil.which(name) is None]
    if missing:
        sys.exit(f"{' and '.join(missing)} not found: apt-get install chromium chromium-driver")
    server, url = start_server(args.run)
    try:
        text = screenshot(url, args.out)
    finally:
        server.send_signal(signal.SIGINT)  # stemlm serve stops cleanly on Ctrl-C
        server.wait(timeout=60)
    print(f"wrote {args.out}: {text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
