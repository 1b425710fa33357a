"""Kernels forked from the zygote (disttrain_lab/grading/kernel_forks.py) behave as kernels that
jupyter_client starts: the same interpreter's view (path, arguments, flags, signals, session), the
folder and environment they were given, their own random numbers, an interrupt, a restart and a
shutdown as usual; and the zygote ends with the process that started it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from jupyter_client.manager import AsyncKernelManager
from jupyter_core.utils import run_sync

from disttrain_lab.grading.kernel_forks import ForkingKernelManager, Zygote

pytestmark = pytest.mark.slow  # kernels start: seconds each

VIEW = (
    "import os, sys, signal, numpy\n"
    "print(repr((sys.path, sys.argv[0], tuple(sys.flags), os.getcwd(), os.environ.get('FORK_TEST'),\n"
    "    signal.getsignal(signal.SIGINT).__name__, signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGCHLD),\n"
    "    os.getpgid(0) == os.getpid(), 'disttrain_lab' in sys.modules)))\n"
)


async def _kernel(manager_class, tmp_path, code: str, *, interrupt_and_restart: bool = False):
    km = manager_class(kernel_name="python3")
    await km.start_kernel(cwd=str(tmp_path), env=dict(os.environ, FORK_TEST="given"))
    kc = km.client()
    kc.start_channels()
    try:
        await kc.wait_for_ready(timeout=120)
        said = []

        def keep(msg):
            if msg["msg_type"] in ("stream", "error"):
                said.append(msg["content"].get("text") or msg["content"]["ename"])

        await kc.execute_interactive(code, output_hook=keep, timeout=120)
        if interrupt_and_restart:
            kc.execute("import time; time.sleep(60)")
            time.sleep(1)
            await km.interrupt_kernel()
            reply = await kc.get_shell_msg(timeout=30)
            said.append(reply["content"].get("ename"))
            await km.restart_kernel(now=True)
            await kc.wait_for_ready(timeout=120)
            await kc.execute_interactive("print('numpy' in dir())", output_hook=keep, timeout=60)
        pid = km.provisioner.pid
    finally:
        kc.stop_channels()
        await km.shutdown_kernel(now=True)
    return said, pid


def test_a_forked_kernel_sees_what_a_started_one_sees(tmp_path):
    forked, forked_pid = run_sync(_kernel)(ForkingKernelManager, tmp_path, VIEW)
    started, _ = run_sync(_kernel)(AsyncKernelManager, tmp_path, VIEW)
    assert forked == started
    assert (
        f"'{tmp_path}', 'given', 'default_int_handler', <Handlers.SIG_DFL: 0>, <Handlers.SIG_DFL: 0>, True, False"
        in (forked[0])
    )
    assert Zygote.shared() is not None and not os.path.exists(f"/proc/{forked_pid}")  # (its kernel is gone)


def test_forked_kernels_draw_their_own_random_numbers_and_interrupt_and_restart(tmp_path):
    draw = "import numpy, random\nprint(numpy.random.rand(), random.random())\n"
    first, _ = run_sync(_kernel)(ForkingKernelManager, tmp_path, draw)
    second, _ = run_sync(_kernel)(ForkingKernelManager, tmp_path, draw, interrupt_and_restart=True)
    assert first[0] != second[0]
    assert second[1:] == ["KeyboardInterrupt", "False\n"]  # interrupted; restarted with nothing of before


def test_the_zygote_ends_with_the_process_that_started_it():
    starter = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nfrom disttrain_lab.grading.kernel_forks import Zygote\n"
            "print(Zygote.shared().process.pid, flush=True)\ntime.sleep(120)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    zygote = int(starter.stdout.readline())
    assert os.path.exists(f"/proc/{zygote}")
    starter.send_signal(signal.SIGKILL)  # (no atexit: the zygote must notice by itself)
    starter.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and os.path.exists(f"/proc/{zygote}"):
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{zygote}") or open(f"/proc/{zygote}/stat").read().split()[2] == "Z"
