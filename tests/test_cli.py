"""The command line's process-level set-up (``beatflow.cli``): the garbage collector around imports
and at exit, for the command and for its cluster's workers; no PyTorch in the command's process. (Its
commands are tested end to end in the flow, engine-cache and evaluation tests.)"""
from __future__ import annotations

import gc
import subprocess
import sys

import pytest

from beatflow.cli import _long_lived_imports


@pytest.fixture
def gc_state():
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    (gc.enable if enabled else gc.disable)()


def _python(code: str) -> str:
    """The last line that ``code`` prints, run by a fresh interpreter (which must exit with 0)."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split("\n")[-1]


class _Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_long_lived_imports_pause_the_collector_then_freeze_what_was_made(gc_state):
    gc.enable()
    seen = []
    with _long_lived_imports():
        seen.append(gc.isenabled())
        made = _Node()
        frozen_before = gc.get_freeze_count()
    assert seen == [False]
    assert gc.isenabled()
    assert gc.get_freeze_count() > frozen_before
    assert gc.is_tracked(made)
    assert id(made) not in {id(o) for o in gc.get_objects()}  # in the permanent generation: not walked


def test_long_lived_imports_restore_the_collector_after_a_failed_import(gc_state):
    gc.enable()
    with pytest.raises(ImportError):
        with _long_lived_imports():
            import beatflow_no_such_module  # noqa: F401
    assert gc.isenabled()
    gc.disable()  # a caller that had it off keeps it off
    with _long_lived_imports():
        pass
    assert not gc.isenabled()


@pytest.mark.parametrize("setup", ["command", "worker"])
def test_the_heap_is_left_to_the_os_at_exit(setup, tmp_path):
    """The ``beatflow`` command (``main``) and each worker of the flow's own cluster (its preload,
    ``beatflow.pipeline.worker_preload``) register ``gc.freeze`` to run at exit, after the handlers registered
    later: what is alive then is not walked by the interpreter's last full collection."""
    start = {"command": f"from beatflow.cli import main\nrc = main(['engine', 'list', '--cache-dir', {str(tmp_path)!r}])\n",
             "worker": "from beatflow.pipeline.worker_preload import dask_setup\nrc = dask_setup(None) or 0\n"}[setup]
    code = (
        "import atexit, gc, sys\n" + start +
        "keep = [[i] for i in range(1000)]  # made after the last freeze before\n"
        "def collected():  # (the permanent generation is not among the collector's objects)\n"
        "    ids = {id(o) for o in gc.get_objects()}\n"
        "    return sum(id(k) in ids for k in keep)\n"
        "before = collected()\n"
        "atexit._run_exitfuncs()\n"
        "print(rc, before, collected())\n"
    )
    assert _python(code) == "0 1000 0"  # rc, kept objects walked by the collector before, after


def test_the_command_and_the_flows_process_do_not_import_pytorch():
    """What ``beatflow run`` imports and calls in its own process (the command's checks, the flow,
    the task runner's plumbing) leaves PyTorch to the workers: 0.9 s of the command's start."""
    code = (
        "import sys\n"
        "from beatflow.cli import main\n"
        "assert main(['run', '--device', 'cpu', '--precision', 'bf16']) == 2  # refused by the engine check\n"
        "import prefect_dask, beatflow.pipeline.flow, beatflow.pipeline.inbox_flow, beatflow.pipeline.cluster, beatflow.pipeline.stages\n"
        "from beatflow.engine.options import resolve_backend\n"
        "from beatflow.params import TRAIN_FRACTION, compile_pays\n"
        "assert resolve_backend('auto', 'fp32', 'cpu') == 'onnxruntime'\n"
        "assert resolve_backend('onnxruntime', 'int8', 'cpu') == 'onnxruntime'\n"
        "assert compile_pays('cpu', int(97102 * TRAIN_FRACTION), 10)\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    assert _python(code) == "[]"


def test_the_command_starts_the_figure_pool_before_it_imports_prefect_and_the_flow():
    """``beatflow run`` starts the report's figure processes first: their start (1-1.5 s each, spawned)
    overlaps the imports of Prefect, Dask and the flow (2-2.6 s here) and the flow run's set-up, so that
    a warm GPU run's figures find them ready. The pool's module itself is light (no Prefect, no Dask)."""
    code = (
        "import sys\n"
        "import beatflow.report.pool as fp\n"
        "assert not any(m in sys.modules for m in ('prefect', 'distributed', 'beatflow.pipeline.flow', 'torch'))\n"
        "seen = []\n"
        "class Started(Exception):\n"
        "    pass\n"
        "def pool():\n"
        "    seen.append(sorted(m for m in ('prefect', 'prefect_dask', 'distributed', 'beatflow.pipeline.flow')"
        " if m in sys.modules))\n"
        "    raise Started\n"
        "fp.figure_pool = pool\n"
        "from beatflow.cli import main\n"
        "try:\n"
        "    main(['run', '--device', 'cpu', '--hours', '0.1'])\n"
        "except Started:\n"
        "    pass\n"
        "print(seen)\n"
    )
    assert _python(code) == "[[]]"
