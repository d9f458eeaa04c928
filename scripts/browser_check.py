"""Real-browser check of the quickstart: JupyterLab on loopback, headless Chromium (Debian's `chromium`) driven by
Playwright, "Run All Cells", wait until the live dashboard shows steps, screenshot it, press its stop button.

    python scripts/browser_check.py                  # embedded model (the real quickstart); a few minutes on CPU
    python scripts/browser_check.py --small          # tiny random model (MINIRL_NB_SMALL=1): under a minute
    python scripts/browser_check.py --out tutorials/img/dashboard.png --steps 4

Needs: `apt-get install chromium`, `pip install jupyterlab playwright` (no `playwright install`: the Debian
browser is used through executable_path). Nothing listens beyond 127.0.0.1; the notebook runs in a temporary
folder; every process this script starts is stopped at the end. Exit status 0 = the dashboard showed steps.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_lab(work: Path, port: int, token: str, small: bool, log) -> subprocess.Popen:
    settings = work / ".lab-settings"
    (settings / "@jupyterlab" / "apputils-extension").mkdir(parents=True)
    # no news / update pop-ups over the notebook
    (settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    env = {**os.environ, "MINIRL_NB_SMALL": "1" if small else "0", "JUPYTERLAB_SETTINGS_DIR": str(settings),
           "JUPYTERLAB_WORKSPACES_DIR": str(work / ".lab-workspaces"), "JUPYTER_RUNTIME_DIR": str(work / ".runtime"),
           "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           f"--ServerApp.root_dir={work}", "--ServerApp.port_retries=0",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate", "--allow-root"]
    # the token travels in the environment (readable by this user only), never on the command line (readable by all)
    proc = subprocess.Popen(cmd, env={**env, "JUPYTER_TOKEN": token}, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}/api/status?token={token}"
    for _ in range(120):
        if proc.poll() is not None:
            raise RuntimeError(f"jupyterlab exited with {proc.returncode}; see its log")
        try:
            urllib.request.urlopen(url, timeout=2)
            return proc
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("jupyterlab did not answer within 60 s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()  # the server shuts its kernels down on SIGTERM
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny random model and 3 steps (MINIRL_NB_SMALL=1)")
    ap.add_argument("--steps", type=int, default=3, help="wait until the dashboard shows this many steps")
    ap.add_argument("--out", default=str(ROOT / "tutorials" / "img" / "dashboard.png"), help="screenshot path")
    ap.add_argument("--timeout", type=float, default=900, help="seconds to wait for the steps")
    ap.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder (notebook, logs)")
    a = ap.parse_args()

    from playwright.sync_api import sync_playwright

    work = Path(tempfile.mkdtemp(prefix="minirl-browser-"))
    shutil.copy(ROOT / "notebooks" / "quickstart.ipynb", work / "quickstart.ipynb")
    port, token = free_port(), secrets.token_hex(16)
    log = open(work / "jupyterlab.log", "w")
    lab = start_lab(work, port, token, a.small, log)
    ok = False
    try:
        with sync_playwright() as p:
            # a fresh profile (--user-data-dir) in the temporary folder
            ctx = p.chromium.launch_persistent_context(str(work / ".chromium"), executable_path=a.chromium,
                                                       headless=True, args=CHROMIUM_ARGS,
                                                       viewport={"width": 1500, "height": 1900})
            page = ctx.pages[0] if ctx.pages else ctx.new_page()
            t0 = time.time()
            page.goto(f"http://127.0.0.1:{port}/lab/tree/quickstart.ipynb?token={token}", timeout=120_000)
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
            page.wait_for_function(  # kernel connected and idle
                "() => document.querySelector('.jp-Notebook') && "
                "!document.body.innerText.includes('Connecting') ", timeout=120_000)
            time.sleep(2)
            print(f"[{time.time() - t0:5.1f}s] notebook open; Run > Run All Cells", flush=True)
            page.click("text=Run", timeout=30_000)  # the menu bar
            page.click("text=Run All Cells", timeout=30_000)
            pattern = re.compile(r"step (\d+) / \d+")
            deadline = time.time() + a.timeout
            shown = 0
            while time.time() < deadline:
                m = pattern.search(page.inner_text(".jp-Notebook"))
                if m and int(m.group(1)) != shown:
                    shown = int(m.group(1))
                    print(f"[{time.time() - t0:5.1f}s] dashboard shows step {shown}", flush=True)
                if "failed:" in page.inner_text(".jp-Notebook"):
                    print("the run failed; see the notebook", flush=True)
                    break
                if shown >= a.steps:
                    break
                time.sleep(2)
            dash = page.locator(".jp-OutputArea-output:has(.widget-image)").first
            dash.evaluate("el => el.scrollIntoView({block: 'start'})")  # the whole dashboard in the viewport
            page.wait_for_function(  # the PNG has loaded
                "() => { const i = document.querySelector('.widget-image'); return i && i.naturalWidth > 0; }",
                timeout=30_000)
            time.sleep(8)  # let the latest PNG reach the page (it travels after the status line)
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            dash.screenshot(path=a.out)
            page.screenshot(path=str(work / "viewport.png"))
            print(f"[{time.time() - t0:5.1f}s] screenshot -> {a.out} (viewport: {work / 'viewport.png'})", flush=True)
            ok = shown >= a.steps
            # "Run All" left the kernel busy in `dash.wait()`: interrupt it (only the waiting stops, the run goes
            # on), then the dashboard's stop button ends the run cleanly from the browser
            if "finished" not in page.inner_text(".jp-Notebook"):
                page.click("text=Kernel", timeout=30_000)
                page.click("text=Interrupt Kernel", timeout=30_000)
                page.wait_for_function(
                    "() => /stopped waiting/.test(document.querySelector('.jp-Notebook').innerText)", timeout=60_000)
                print(f"[{time.time() - t0:5.1f}s] kernel interrupted: the run goes on in the background", flush=True)
            page.locator(".jp-OutputArea-output button:has-text('stop')").first.click()
            try:
                page.wait_for_function("() => /finished/.test(document.querySelector('.jp-Notebook').innerText)",
                                       timeout=240_000)
                print(f"[{time.time() - t0:5.1f}s] stop button: run finished cleanly", flush=True)
            except Exception:  # noqa: BLE001 - reported, the screenshot is what matters here
                print("stop button: the run did not report 'finished' within 240 s", flush=True)
                ok = False
            ctx.close()
    finally:
        stop(lab)
        log.close()
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept {work}")
    print("OK" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
