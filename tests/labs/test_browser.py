"""The labs in a real browser: JupyterLab started as the README's first command starts it,
every solution notebook run through the UI in headless Chromium (Debian's package, driven
by Playwright without a browser download), and a student notebook's stub.

Screenshots, one per lab, go to build/test-output/browser/ (or $DISTTRAIN_TEST_OUTPUT).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.notebooks import REPO

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# as root Chromium needs --no-sandbox; the rest keeps it off the network and quiet
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
    "--disable-dev-shm-usage",
]
LABS = sorted(p.name for p in (REPO / "solutions").glob("[0-9][0-9]_*") if (p / f"{p.name}.ipynb").exists())
OUTPUT = Path(os.environ.get("DISTTRAIN_TEST_OUTPUT", REPO / "build" / "test-output")) / "browser"
LAB_TIMEOUT = 900  # seconds for one lab to run through the UI on a loaded 2-core machine

if CHROMIUM is None:
    pytest.skip("needs Debian's chromium (`apt-get install -y chromium`; .ci/run installs it)", allow_module_level=True)
playwright = pytest.importorskip("playwright.sync_api")


def _settings(folder: Path) -> None:
    """JupyterLab user settings for a test: every cell in the DOM (no windowing), no news popup."""

    def put(plugin: str, values: dict) -> None:
        path = folder / (plugin.replace(":", "/") + ".jupyterlab-settings")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))

    put("@jupyterlab/notebook-extension:tracker", {"windowingMode": "none"})
    put("@jupyterlab/apputils-extension:notification", {"checkForUpdates": False, "fetchNews": "false"})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``bash scripts/lab.sh`` (the README's first command) on a free port with a token, over a
    copy of the solutions (running them through the UI saves them) and of one student lab."""
    tmp = tmp_path_factory.mktemp("browser")
    root = tmp / "root"
    for lab in LABS:
        shutil.copytree(REPO / "solutions" / lab, root / "solutions" / lab)
    shutil.copytree(REPO / "labs" / "01_point_to_point", root / "student" / "01_point_to_point")
    _settings(tmp / "settings")
    token = secrets.token_hex(16)
    log = tmp / "lab.log"
    env = dict(
        os.environ,
        LAB_ROOT=str(root),
        JUPYTERLAB_SETTINGS_DIR=str(tmp / "settings"),
        JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"),
        JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
    )
    env.pop("NBGRADER_EXECUTION", None)  # a student's run: the ring slider, not the grader's still frames
    env.pop("MPLBACKEND", None)  # the notebooks draw inline, as for a student
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                "bash",
                "scripts/lab.sh",
                "--no-browser",
                "--ip=127.0.0.1",
                "--port=0",
                f"--IdentityProvider.token={token}",
            ],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 600  # lab.sh runs setup.sh first
        while not (found := re.search(rb"http://127\.0\.0\.1:(\d+)/lab", log.read_bytes())):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        yield {"url": f"http://127.0.0.1:{int(found.group(1))}", "token": token, "root": root, "log": log}
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (kernels and ranks too), SIGKILL if it lingers."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        yield chromium
        chromium.close()


NB = ".jp-NotebookPanel:not(.lm-mod-hidden)"  # the notebook in front (JupyterLab keeps others in the DOM)


def _open(browser, server, path: str):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(120_000)
    # a workspace of its own: JupyterLab restores no other notebook (and starts no other kernel)
    workspace = re.sub(r"\W", "-", path)
    page.goto(f"{server['url']}/lab/workspaces/{workspace}/tree/{path}?token={server['token']}")
    page.wait_for_selector(f"{NB} .jp-Notebook .jp-CodeCell")
    # the status bar says "Python 3 (ipykernel) | Idle" once the kernel is connected; a run
    # asked for while it still says Connecting or Unknown is lost
    page.wait_for_function(
        "() => /\\| Idle/.test(document.querySelector('#jp-main-statusbar')?.textContent || '')",
        timeout=180_000,
        polling=500,
    )
    return page


def _close(page, server, path: str) -> None:
    """Close the page and shut its kernel down (its warm ranks with it), through the server's API."""
    page.close()
    headers = {"Authorization": f"token {server['token']}"}
    with urllib.request.urlopen(urllib.request.Request(f"{server['url']}/api/sessions", headers=headers)) as r:
        sessions = json.load(r)
    for session in sessions:
        if session["path"] == path:
            urllib.request.urlopen(
                urllib.request.Request(
                    f"{server['url']}/api/sessions/{session['id']}", headers=headers, method="DELETE"
                )
            ).close()


def _menu(page, menu: str, item: str) -> None:
    """Click ``menu`` in JupyterLab's menu bar, then its item labelled ``item``."""
    page.locator("#jp-menu-panel .lm-MenuBar-itemLabel", has_text=re.compile(f"^{menu}$")).click()
    page.locator(".lm-Menu-item .lm-Menu-itemLabel", has_text=re.compile(f"^{re.escape(item)}$")).first.click()


_PROMPTS = f"[...document.querySelectorAll('{NB} .jp-CodeCell .jp-InputArea-prompt')].map(e => e.textContent.trim())"


def _run_all(page, timeout_s: float) -> None:
    """Run → Run All Cells, then wait until no cell is queued or running ([*])."""
    _menu(page, "Run", "Run All Cells")
    page.wait_for_function(
        f"() => {{ const p = {_PROMPTS}; return p.includes('[*]:') || p.every(t => /^\\[\\d+\\]:$/.test(t)); }}"
    )
    page.wait_for_function(f"() => !{_PROMPTS}.includes('[*]:')", timeout=timeout_s * 1000, polling=1000)


def _saved(page, path: Path) -> dict:
    """Save through the UI (File → Save) and read the notebook the browser wrote."""
    before = path.stat().st_mtime_ns
    _menu(page, "File", "Save Notebook")
    deadline = time.monotonic() + 60
    while path.stat().st_mtime_ns == before and time.monotonic() < deadline:
        time.sleep(0.2)
    while True:  # the server may still be writing the file: read until it is whole JSON
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _broken_images(page) -> int:
    return page.evaluate(
        f"() => [...document.querySelectorAll('{NB} .jp-OutputArea-output img')]"
        ".filter(i => !(i.complete && i.naturalWidth > 0)).length"
    )


@pytest.mark.parametrize("lab", LABS)
def test_solution_runs_in_jupyterlab(lab, server, browser):
    OUTPUT.mkdir(parents=True, exist_ok=True)
    path = f"solutions/{lab}/{lab}.ipynb"
    page = _open(browser, server, path)
    try:
        _run_all(page, LAB_TIMEOUT)
        nb = _saved(page, server["root"] / "solutions" / lab / f"{lab}.ipynb")
        code = [c for c in nb["cells"] if c["cell_type"] == "code"]
        errors = [o for c in code for o in c["outputs"] if o["output_type"] == "error"]
        assert not errors, f"{lab}: {errors[0]['ename']}: {errors[0]['evalue']}"
        assert all(c["execution_count"] for c in code), f"{lab}: not every cell ran"
        pictures = sum("image/png" in o.get("data", {}) for c in code for o in c["outputs"])
        shown = page.locator(f"{NB} .jp-OutputArea-output img").count()
        assert pictures >= 1 and shown >= pictures, (lab, pictures, shown)
        assert _broken_images(page) == 0, f"{lab}: a figure did not render"
        if "viz.ring_steps_slider(" in json.dumps(nb):
            _slider_changes_the_picture(page)  # leaves the slider in view for the screenshot
        else:
            page.locator(f"{NB} .jp-OutputArea-output img").first.scroll_into_view_if_needed()
        page.screenshot(path=str(OUTPUT / f"{lab}.png"))
    finally:
        _close(page, server, path)


def _slider_changes_the_picture(page) -> None:
    widget = page.locator(f"{NB} .widget-interact").first
    widget.scroll_into_view_if_needed()
    picture = widget.locator("img").first
    picture.wait_for()
    before = picture.get_attribute("src")
    widget.locator(".widget-slider .noUi-handle, .widget-slider input[type=range]").first.focus()
    page.keyboard.press("ArrowRight")
    page.wait_for_function(
        "([el, old]) => { const i = el.querySelector('img'); return i && i.src !== old "
        "&& i.complete && i.naturalWidth > 0; }",
        arg=[widget.element_handle(), before],
        timeout=60_000,
    )
    assert "step 1/" in widget.inner_text() or widget.locator(".widget-readout").inner_text().strip() == "1"


def test_student_stub_shows_the_kits_message(server, browser):
    lab = "01_point_to_point"
    path = f"student/{lab}/{lab}.ipynb"
    page = _open(browser, server, path)
    try:
        _run_all(page, LAB_TIMEOUT)  # stops at the first self-check: its exercise is a stub
        text = page.locator(f"{NB} .jp-OutputArea-output").all_inner_texts()
        shown = "\n".join(text)
        assert "RankError" in shown and "is not written yet" in shown, shown[-3000:]
        assert "replace `raise NotImplementedError()` with your code" in shown
        page.locator(f"{NB} .jp-OutputArea-output", has_text="is not written yet").first.scroll_into_view_if_needed()
        page.screenshot(path=str(OUTPUT / f"student_{lab}.png"))
    finally:
        _close(page, server, path)
