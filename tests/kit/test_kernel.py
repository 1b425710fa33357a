"""dl.launch inside a real Jupyter kernel: what a student actually sees."""

from __future__ import annotations

import re
import time

import nbformat
import pytest
from jupyter_client.manager import start_new_kernel
from nbclient import NotebookClient

from tests.helpers import survivors

CELLS = [
    "import disttrain_lab as dl, torch, torch.distributed as dist\n"
    "a = torch.randn(1500, 1500); _ = (a @ a).sum()   # the kernel's OpenMP pool is now busy-initialised",
    "def hello():\n"
    "    print('hi from', dist.get_rank())\n"
    "    b = torch.randn(200, 200)\n"
    "    return float((b @ b).abs().sum() > 0) * dist.get_rank()\n"
    "out = dl.launch(hello, 4)\n"
    "print(out)",
    "def ring():\n"
    "    r, n = dist.get_rank(), dist.get_world_size()\n"
    "    x, y = torch.full((1000,), float(r)), torch.empty(1000)\n"
    "    with dl.region('compute'):\n"
    "        x = x * 2\n"
    "    reqs = [dist.isend(x, (r + 1) % n), dist.irecv(y, (r - 1) % n)]\n"
    "    for q in reqs: q.wait()\n"
    "    return y\n"
    "run = dl.launch(ring, 3, trace=True)\n"
    "print(run.summary())\n"
    "ax = dl.viz.timeline(run)\n"
    "print('rows', len(ax.get_yticklabels()))",
    "def broken():\n    if dist.get_rank() == 1:\n        return 1 / 0\n    dist.barrier()\ndl.launch(broken, 2)",
    # what a rank's traceback names, whatever file name the pickler gives rebuilt code
    # (cloudpickle >= 3.1.3 writes "<dynamic-code>"): a helper from another cell, a lambda,
    # a nested function, a method of a class defined in a cell, a lab's stub
    "def helper(x):\n    y = x + 1\n    return 1 / (y - y)",
    "def calls_helper():\n    return helper(dist.get_rank())\ndl.launch(calls_helper, 2)",
    "g = lambda: [1][dist.get_rank() + 5]\ndl.launch(g, 2)",
    "def outer():\n    def inner():\n        raise ValueError('inner broke')\n    return inner()\ndl.launch(outer, 2)",
    "class Model:\n    def go(self):\n        return {}['missing']\ndl.launch(Model().go, 2)",
    "def ping_pong():\n    # YOUR CODE HERE\n    raise NotImplementedError()\ndl.launch(ping_pong, 2)",
    # mistakes named in the kernel itself: a stub called in a cell, a method stub, dist.* outside a launch
    "def bubble(p, m):\n    # YOUR CODE HERE\n    raise NotImplementedError()\nbubble(4, 8)",
    "class Zero2Optimizer:\n    def __init__(self, params):\n        # YOUR CODE HERE\n        raise NotImplementedError()\n"
    "Zero2Optimizer([])",
    "dist.get_rank()",
    # ... and on the ranks: collectives that cannot match, an argument that cannot travel
    "def sizes():\n    t = torch.ones(4 if dist.get_rank() == 0 else 3)\n    dist.all_reduce(t)\ndl.launch(sizes, 2)",
    "import threading\nlock = threading.Lock()\ndef locked():\n    with lock:\n        return 1\ndl.launch(locked, 2)",
    # a figure made to draw a run in, when the launch fails: no bare axes under the error; one drawn on stays
    "import matplotlib.pyplot as plt\nfig, ax = plt.subplots()\ndef boom():\n    raise KeyError('x')\ndl.launch(boom, 2)",
    "fig, ax = plt.subplots()\nax.plot([1, 2])\ndl.launch(boom, 2)",
    # a prediction's self-check on a stub: the stub named, the kit's frames hidden
    "def predicted_bubble(p, m):\n    # YOUR CODE HERE\n    raise NotImplementedError()\n"
    "dl.predictions.check('bubble', predicted_bubble, [(4, 8)])",
    # a class's stub on the ranks names the class
    "def build():\n    return Zero2Optimizer([])\ndl.launch(build, 2)",
    # a check that fails: the student's cell and the message, not the kit's frames (unless asked for)
    "from disttrain_lab import checks\nchecks.assert_close(torch.ones(2), torch.zeros(2), what='the sum')",
    "%xmode Verbose\nchecks.assert_close(torch.ones(2), torch.zeros(2), what='the sum')",
    "%xmode Context\ndl.launch(5, 2)",
]


@pytest.mark.slow
def test_launch_trace_and_timeline_in_a_real_kernel():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=True).execute()
    outputs = [c.outputs for c in nb.cells]

    def text(i):
        return "".join(o.get("text", "") for o in outputs[i] if o.output_type == "stream")

    assert not any(o.output_type == "error" for i in range(3) for o in outputs[i]), outputs[:3]
    assert "[rank 3] hi from 3" in text(1) and "[0.0, 1.0, 2.0, 3.0]" in text(1)
    assert "isend×1" in text(2) and "rows 3" in text(2)
    (err,) = [o for o in outputs[3] if o.output_type == "error"]
    assert err.ename == "RankError"
    assert "rank 1 raised ZeroDivisionError" in err.evalue
    # the traceback points at the student's cell and line, as IPython names cells
    assert "Cell In[4], line 3, in broken" in err.evalue and "return 1 / 0" in err.evalue
    assert "<dynamic-code>" not in "".join(o.get("evalue", "") for c in outputs for o in c)

    def error(i):
        (err,) = [o for o in outputs[i] if o.output_type == "error"]
        return err.evalue

    assert "Cell In[6], line 2, in calls_helper\n    return helper(dist.get_rank())\n" in error(5)
    assert "Cell In[5], line 3, in helper\n    return 1 / (y - y)\n" in error(5)
    assert "Cell In[7], line 1, in <lambda>\n    g = lambda: [1][dist.get_rank() + 5]" in error(6)
    assert "Cell In[8], line 4, in outer\n    return inner()\n" in error(7)
    assert "Cell In[8], line 3, in inner\n    raise ValueError('inner broke')" in error(7)
    assert "Cell In[9], line 3, in go\n    return {}['missing']" in error(8)
    assert "ping_pong is not written yet (Cell In[10], line 3 still raises the stub's NotImplementedError)" in error(9)
    assert "Cell In[10], line 3, in ping_pong\n    raise NotImplementedError()" in error(9)
    assert error(10).startswith("bubble is not written yet (Cell In[11], line 3 still raises the stub's"), error(10)
    assert error(11).startswith("Zero2Optimizer.__init__ is not written yet (Cell In[12], line 4"), error(11)
    assert "outside a launch" in error(12) and "dl.launch(hello, 4)" in error(12), error(12)
    assert "Default process group has not been initialized" in error(12)  # torch's own words stay
    assert "with different sizes" in error(
        13
    ) and "rank 1: all_reduce(3 elements, float32), in sizes (line 3)" in error(13)
    assert "cannot send the variable lock (lock) that locked uses" in error(14), error(14)
    assert error(17).startswith("predicted_bubble is not written yet (Cell In[18], line 3"), error(17)
    (shown,) = [re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(o.traceback)) for o in outputs[17] if o.output_type == "error"]
    assert "predictions.py" not in shown and "own code not shown" in text(17), shown
    assert "Zero2Optimizer.__init__ is not written yet (Cell In[12], line 4 still raises" in error(18), error(18)
    kinds = [[o.output_type for o in outputs[i] if o.output_type != "stream"] for i in (15, 16)]
    assert kinds == [["error"], ["error", "display_data"]], kinds

    def shown(i):
        (err,) = [o for o in outputs[i] if o.output_type == "error"]
        return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(err.traceback)), text(i)

    trace, note = shown(19)
    assert "Cell In[20], line 2" in trace and "the sum: values differ" in trace and "checks.py" not in trace, trace
    assert "(1 frame of disttrain_lab's own code not shown: `%xmode Verbose` shows it)" in note, note
    trace, note = shown(20)
    assert "checks.py" in trace and "not shown" not in note, trace  # asked for
    trace, note = shown(21)
    assert "Cell In[22], line 2" in trace and "launcher.py" not in trace and "not shown" in note, trace
    enames = [[o.ename for o in outputs[i] if o.output_type == "error"] for i in range(10, 15)]
    assert enames == [
        ["NotImplementedError"],
        ["NotImplementedError"],
        ["ValueError"],
        ["CollectiveMismatch"],
        ["TypeError"],
    ]


@pytest.mark.slow
def test_interrupting_the_kernel_stops_every_rank():
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        kc.execute_interactive("import disttrain_lab as dl, os, time", timeout=60)
        msg_id = kc.execute(
            "def sleeper():\n    print('pid', os.getpid(), flush=True)\n    time.sleep(1000)\n"
            "dl.launch(sleeper, 3, timeout=600)"
        )
        pids, said, interrupted = [], "", False
        deadline = time.time() + 60
        while time.time() < deadline:
            msg = kc.get_iopub_msg(timeout=60)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream":
                said += msg["content"]["text"]
                pids += [int(w.split()[-1]) for w in msg["content"]["text"].splitlines() if "] pid" in w]
                if len(pids) == 3 and not interrupted:
                    km.interrupt_kernel()  # the notebook's stop button
                    interrupted = True
            elif msg["msg_type"] == "error":
                said += msg["content"]["ename"]
            elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        assert interrupted and "interrupted: stopped all 3 ranks" in said and "KeyboardInterrupt" in said
        assert survivors(pids) == []
        # the kernel is still usable afterwards
        reply = kc.execute_interactive("assert dl.launch(lambda: 7, 2) == [7, 7]", timeout=60)
        assert reply["content"]["status"] == "ok"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


@pytest.mark.slow
def test_a_kernels_own_exception_handler_is_kept():
    # Colab and other front ends may install IPython's one custom exception handler: the kit's
    # hints (disttrain_lab/hints.py) then stay out, and errors read as Python's own
    cells = [
        "get_ipython().set_custom_exc((KeyError,), lambda self, *a, **k: print('theirs'))",
        "import disttrain_lab as dl\nprint(get_ipython().custom_exceptions)",
        "def stub():\n    raise NotImplementedError()\nstub()",
        "{}['x']",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=True).execute()
    out = [c.outputs for c in nb.cells]
    assert "(<class 'KeyError'>,)" in "".join(o.get("text", "") for o in out[1])
    (err,) = [o for o in out[2] if o.output_type == "error"]
    assert err.ename == "NotImplementedError" and err.evalue == ""
    assert "theirs" in "".join(o.get("text", "") for o in out[3])
