#!/usr/bin/env python
"""A real JupyterHub on this machine: N students run lab 1 at the same moment through it.

    python scripts/hub_check.py                 # 8 users, lab 1's solution, FAST mode
    python scripts/hub_check.py --users 3 --lab 02_all_reduce --full

What it does (every part real, nothing mocked):

1. starts ``jupyterhub`` with a test authenticator (DummyAuthenticator), the Python port of
   configurable-http-proxy, and a local spawner (SimpleLocalProcessSpawner: one
   ``jupyterhub-singleuser`` per user, each in its own home folder), every port chosen free;
2. through the Hub's REST API, as a service with a token: creates the users, starts their
   servers, uploads the lab's solution notebook to each one (contents API);
3. opens a kernel per user (kernel API, websocket through the proxy) and, once all are
   ready, runs every code cell of the notebook in all of them at the same moment;
4. in each kernel, a last cell asks 4 ranks who they are (user, parent kernel, home folder)
   and lists the user's files;
5. stops the servers and the Hub, then looks for any process left behind.

It prints one line per user and a JSON summary (``--json PATH`` writes it), and exits 0 only
if every user's notebook ran without an error, every rank belonged to its own user's kernel,
no user saw another's files, and nothing was left running.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import requests
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

from disttrain_lab.grading import steps

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

# The probe each user's kernel runs last: which user and kernel every rank belongs to, and
# what the user can see in their own folder.
PROBE = """
import json, os
def _who():
    return {"user": os.environ.get("JUPYTERHUB_USER"), "ppid": os.getppid(), "home": os.environ.get("HOME")}
_ranks = dl.launch(_who, 4)
print("PROBE" + json.dumps({"kernel": os.getpid(), "user": os.environ.get("JUPYTERHUB_USER"),
                            "ranks": _ranks, "files": sorted(os.listdir(os.path.expanduser("~")))}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(folder: Path, token: str, marker: str, fast: bool, environment: dict | None = None) -> Path:
    """The Hub's config; ``environment``: more variables every user's server gets (as an admin sets them)."""
    hub_port, api_port, proxy_port = free_port(), free_port(), free_port()
    # DISTTRAIN_HUB_CHECK marks every process the Hub starts (found if left behind)
    env = {**(environment or {}), "DISTTRAIN_HUB_CHECK": marker}
    if fast:
        env["NBGRADER_EXECUTION"] = "1"  # the labs' FAST mode: smaller benchmarks, same tests
    config = f"""
c = get_config()  # noqa
c.JupyterHub.bind_url = "http://127.0.0.1:{hub_port}"
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = {api_port}
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{proxy_port}"
c.ConfigurableHTTPProxy.command = [{str(BIN / "configurable-http-proxy")!r}]
c.ConfigurableHTTPProxy.auth_token = {secrets.token_hex(16)!r}
c.JupyterHub.authenticator_class = "dummy"
c.DummyAuthenticator.password = {secrets.token_hex(8)!r}
c.Authenticator.allow_all = True
c.JupyterHub.spawner_class = "jupyterhub.spawner.SimpleLocalProcessSpawner"
c.SimpleLocalProcessSpawner.home_dir_template = {str(folder / "home" / "{username}")!r}
c.Spawner.cmd = [{str(BIN / "jupyterhub-singleuser")!r}]
c.Spawner.args = ["--allow-root"] if {os.geteuid() == 0} else []
c.Spawner.default_url = "/lab"
c.Spawner.environment = {env!r}
c.Spawner.start_timeout = 300
c.Spawner.http_timeout = 300
c.JupyterHub.db_url = "sqlite:///{folder / "jupyterhub.sqlite"}"
c.JupyterHub.cookie_secret_file = {str(folder / "cookie_secret")!r}
c.JupyterHub.pid_file = {str(folder / "jupyterhub.pid")!r}
c.JupyterHub.cleanup_servers = True
c.JupyterHub.services = [{{"name": "hub-check", "api_token": {token!r}}}]
c.JupyterHub.load_roles = [{{"name": "hub-check", "services": ["hub-check"],
                            "scopes": ["admin:users", "admin:servers", "access:servers", "read:users"]}}]
"""
    path = folder / "jupyterhub_config.py"
    path.write_text(config)
    return path


class Hub:
    def __init__(self, folder: Path, token: str, marker: str, fast: bool, environment: dict | None = None):
        self.folder, self.token = folder, token
        config = write_config(folder, token, marker, fast, environment)
        self.url = next(l.split('"')[1] for l in config.read_text().splitlines() if "bind_url" in l)
        self.log = open(folder / "jupyterhub.log", "wb")
        env = dict(os.environ, DISTTRAIN_HUB_CHECK=marker, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
        self.proc = subprocess.Popen(
            [str(BIN / "jupyterhub"), "-f", str(config)],
            cwd=folder,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"token {token}"

    def api(self, method: str, path: str, **kw):
        r = self.session.request(method, f"{self.url}/hub/api{path}", timeout=120, **kw)
        if r.status_code >= 400:
            raise RuntimeError(f"{method} {path}: {r.status_code} {r.text[:500]}")
        return r.json() if r.content else None

    def wait_up(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("jupyterhub exited:\n" + (self.folder / "jupyterhub.log").read_text()[-3000:])
            try:
                if self.session.get(f"{self.url}/hub/api/", timeout=5).ok:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"jupyterhub did not answer within {timeout:.0f} s")

    def start_servers(self, users: list[str], timeout: float = 600) -> None:
        self.api("POST", "/users", json={"usernames": users})
        for user in users:
            self.api("POST", f"/users/{user}/server")
        deadline = time.monotonic() + timeout
        waiting = set(users)
        while waiting and time.monotonic() < deadline:
            for user in sorted(waiting):
                server = self.api("GET", f"/users/{user}").get("servers", {}).get("")
                if server and server.get("ready"):
                    waiting.discard(user)
            time.sleep(1)
        if waiting:
            raise RuntimeError(f"servers of {sorted(waiting)} did not start within {timeout:.0f} s")

    def user_api(self, user: str, method: str, path: str, **kw):
        r = self.session.request(method, f"{self.url}/user/{user}/api{path}", timeout=120, **kw)
        if r.status_code >= 400:
            raise RuntimeError(f"{user}: {method} {path}: {r.status_code} {r.text[:500]}")
        return r.json() if r.content else None

    def stop(self, users: list[str]) -> None:
        for user in users:
            try:
                self.api("DELETE", f"/users/{user}/server")
            except Exception:
                pass
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if not any(self.api("GET", f"/users/{u}").get("servers") for u in users):
                    break
            except Exception:
                break
            time.sleep(1)
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


# ----------------------------------------------------------------------------------------
# Running a notebook's cells in a user's kernel over the kernel websocket


def _message(code: str, session: str) -> tuple[str, str]:
    msg_id = uuid.uuid4().hex
    return msg_id, json.dumps(
        {
            "header": {
                "msg_id": msg_id,
                "username": "hub-check",
                "session": session,
                "msg_type": "execute_request",
                "version": "5.3",
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            },
            "parent_header": {},
            "metadata": {},
            "channel": "shell",
            "buffers": [],
            "content": {
                "code": code,
                "silent": False,
                "store_history": True,
                "user_expressions": {},
                "allow_stdin": False,
                "stop_on_error": True,
            },
        }
    )


async def run_cells(
    hub: Hub, user: str, kernel: str, cells: list[str], start: asyncio.Event, cell_timeout: float
) -> dict:
    ws_url = hub.url.replace("http", "ws", 1) + f"/user/{user}/api/kernels/{kernel}/channels"
    session = uuid.uuid4().hex
    out = {"user": user, "cells": 0, "errors": [], "text": "", "seconds": 0.0}
    conn = None
    try:
        conn = await websocket_connect(
            HTTPRequest(ws_url, headers={"Authorization": f"token {hub.token}"}), max_message_size=1 << 28
        )
    except Exception as exc:
        out["errors"].append(f"kernel websocket: {type(exc).__name__}: {exc}")
        return out
    await start.wait()
    t0 = time.monotonic()
    try:
        for code in cells:
            msg_id, data = _message(code, session)
            await conn.write_message(data)
            replied = idle = False
            while not (replied and idle):
                raw = await asyncio.wait_for(conn.read_message(), cell_timeout)
                if raw is None:
                    raise RuntimeError("kernel websocket closed")
                msg = json.loads(raw)
                if msg.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                kind, content = msg["msg_type"], msg["content"]
                if kind == "stream":
                    out["text"] += content["text"]
                elif kind == "error":
                    out["errors"].append(f"{content['ename']}: {content['evalue']}")
                elif kind == "execute_reply":
                    replied = True
                elif kind == "status" and content["execution_state"] == "idle":
                    idle = True
            out["cells"] += 1
            if out["errors"]:
                break
    except Exception as exc:  # a timeout or a dropped connection is this user's failure
        out["errors"].append(f"{type(exc).__name__}: {exc}")
    finally:
        out["seconds"] = time.monotonic() - t0
        conn.close()
    return out


def notebook_cells(path: Path) -> list[str]:
    nb = json.loads(path.read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def processes_with(marker: str) -> list[tuple[int, str]]:
    """(pid, command line) of every process whose environment mentions ``marker``."""
    found = []
    for pid in steps.processes_with(marker):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as c:
                found.append((pid, c.read().replace(b"\0", b" ").decode(errors="replace")[:200]))
        except OSError:
            pass
    return found


def check(users: int, lab: str, fast: bool, folder: Path, cell_timeout: float) -> dict:
    names = [f"student{i}" for i in range(1, users + 1)]
    token, marker = secrets.token_hex(16), f"hubcheck-{secrets.token_hex(8)}"
    notebook = REPO / "solutions" / lab / f"{lab}.ipynb"
    cells = notebook_cells(notebook) + [PROBE]
    summary = {"users": users, "lab": lab, "fast": fast, "timings": {}}
    t0 = time.monotonic()
    hub = Hub(folder, token, marker, fast)
    try:
        hub.wait_up()
        summary["timings"]["hub_up"] = time.monotonic() - t0
        hub.start_servers(names)
        summary["timings"]["servers_up"] = time.monotonic() - t0
        kernels = {}
        for user in names:
            hub.user_api(user, "PUT", f"/contents/{lab}", json={"type": "directory"})
            hub.user_api(
                user,
                "PUT",
                f"/contents/{lab}/{lab}.ipynb",
                json={"type": "notebook", "format": "json", "content": json.loads(notebook.read_text())},
            )
            kernels[user] = hub.user_api(user, "POST", "/kernels", json={"name": "python3", "path": lab})["id"]

        async def everyone():
            start = asyncio.Event()
            tasks = [asyncio.create_task(run_cells(hub, u, kernels[u], cells, start, cell_timeout)) for u in names]
            await asyncio.sleep(1)
            start.set()  # all users begin at the same moment
            return await asyncio.gather(*tasks)

        t_run = time.monotonic()
        results = asyncio.run(everyone())
        summary["timings"]["run_all_users"] = time.monotonic() - t_run
    finally:
        hub.stop(names)
    summary["timings"]["total"] = time.monotonic() - t0
    time.sleep(1)
    summary["left_behind"] = processes_with(marker)
    summary["results"] = []
    for r in results:
        probe = next((json.loads(l[5:]) for l in r["text"].splitlines() if l.startswith("PROBE")), None)
        problems = list(r["errors"])
        if probe is None and not problems:
            problems.append("the probe cell printed nothing")
        elif probe is not None:
            home = str(folder / "home" / r["user"])
            for k, rank in enumerate(probe["ranks"]):
                if rank["user"] != r["user"] or rank["ppid"] != probe["kernel"] or rank["home"] != home:
                    problems.append(f"rank {k} belongs to {rank} , not to {r['user']}'s kernel {probe['kernel']}")
            others = [n for n in probe["files"] if n != lab and not n.startswith(".")]
            if others:
                problems.append(f"sees files that are not its own: {others}")
        summary["results"].append(
            {
                "user": r["user"],
                "cells": r["cells"],
                "seconds": round(r["seconds"], 1),
                "ok": not problems,
                "problems": problems,
            }
        )
    summary["ok"] = (
        all(r["ok"] for r in summary["results"]) and not summary["left_behind"] and len(summary["results"]) == users
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=8, help="students running the lab at once (default %(default)s)")
    parser.add_argument("--lab", default="01_point_to_point", help="a folder of solutions/")
    parser.add_argument(
        "--full",
        action="store_true",
        help="run the labs as a student does (default: the grader's FAST mode, smaller benchmarks)",
    )
    parser.add_argument(
        "--cell-timeout", type=float, default=900, help="seconds a cell of the lab may run (default %(default)s)"
    )
    parser.add_argument("--json", type=Path, help="write the summary here")
    parser.add_argument("--keep", action="store_true", help="keep the Hub's folder (logs, homes)")
    args = parser.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="disttrain-hub-"))
    try:
        summary = check(args.users, args.lab, not args.full, folder, args.cell_timeout)
    except Exception:
        log = folder / "jupyterhub.log"
        if log.exists():
            sys.stderr.write(log.read_text()[-5000:])
        raise
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    for r in summary["results"]:
        print(
            f"{r['user']:10s} {'ok' if r['ok'] else 'FAILED'}  {r['cells']} cells in {r['seconds']:.1f} s"
            + ("".join(f"\n    {p}" for p in r["problems"]))
        )
    t = summary["timings"]
    print(
        f"hub up {t['hub_up']:.1f} s, {args.users} servers up {t['servers_up']:.1f} s, all users ran the lab "
        f"in {t.get('run_all_users', 0):.1f} s, total {t['total']:.1f} s"
    )
    print("left behind: " + (", ".join(f"{pid} {cmd}" for pid, cmd in summary["left_behind"]) or "nothing"))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    print("HUB CHECK " + ("PASSED" if summary["ok"] else "FAILED"))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
