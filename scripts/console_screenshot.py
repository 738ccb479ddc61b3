"""The README's picture of the web console: `stepserve serve` on the embedded model under a mixed background load
(8, 20 and 40 steps), the page opened in headless Chromium, the live batch view captured after a few seconds.

    .venv/bin/python scripts/console_screenshot.py [--out docs/console-live.png] [--strategy slo]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from common import ROOT, free_port, stop_server, wait_until_healthy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "console-live.png")
    p.add_argument("--strategy", default="slo")
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--chromium", default="/usr/bin/chromium")
    args = p.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "stepserve.cli", "serve", "--port", str(port), "--strategy",
                               args.strategy, "--no-access-log"], cwd=ROOT, stderr=subprocess.DEVNULL)
    stop = threading.Event()

    def load(k: int) -> None:
        i = 0
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                client.post(url + "/v1/images/generations", json={
                    "prompt": "a handwritten four", "n": 2, "num_inference_steps": [8, 20, 40][(i + k) % 3],
                    "seed": i})
                i += 1

    try:
        wait_until_healthy(server, url, "serve", 120)
        from playwright.sync_api import sync_playwright

        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=args.chromium, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url + "/")
            page.wait_for_selector("#status.live", timeout=30_000)
            workers = [threading.Thread(target=load, args=(k,), daemon=True) for k in range(4)]
            for w in workers:
                w.start()
            time.sleep(args.seconds)
            page.locator("#live").screenshot(path=str(args.out))
            print(f"wrote {args.out}")
            stop.set()
            browser.close()
    finally:
        stop_server(server)


if __name__ == "__main__":
    main()
