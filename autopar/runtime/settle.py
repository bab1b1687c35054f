"""A rank's exit after gloo collectives: its worker threads settle before the interpreter goes.

gloo runs each collective on a worker thread (``pt_gloo_runloop``) that keeps the collective's
tensors until it drops the finished work, a moment after the rank's ``wait`` returned. A tensor
Python let go of in between is freed on that thread, which needs the GIL to free its Python
object. When the rank is already past its last line by then (``destroy_process_group`` does not
stop gloo's threads, and the groups live on in DeviceMesh's and the model's references), the
interpreter is finalizing, the thread is stopped where it asks for the GIL (``PyThread_exit_thread``)
and the forced unwind through gloo's noexcept frames aborts the process: "terminate called
without an active exception", exit status -6 after a run that trained and saved everything. A
core dump of one (2026-12-05, an EP checkpoint test under the full suite's load) showed exactly
that stack: ``ProcessGroupGloo::runLoop`` → ``~AsyncAllgatherCoalescedWork`` →
``TensorImpl::decref_pyobject`` → ``take_gil`` → ``pthread_exit`` → ``std::terminate``, with the
main thread in ``Py_FinalizeEx``. pytorch/pytorch#179291 describes the same race.

``settle_at_exit()`` registers, once per process, an ``atexit`` hook (atexit runs before the
interpreter starts finalizing) that sleeps in short steps, the GIL released, until every gloo
worker thread of the process has been seen asleep twice in a row (Linux ``/proc``; a thread
waiting for the GIL gets it during the sleep), for at most ``SETTLE_TIMEOUT_S``.
"""

from __future__ import annotations

import atexit
import functools
import time
from pathlib import Path

SETTLE_TIMEOUT_S = 2.0
"""The longest an exiting rank waits for gloo's worker threads (a work in flight that will never
finish, an async collective nobody waited for, must not hold the exit)."""

WORKER_THREAD = "pt_gloo_runloop"
"""The name torch gives gloo's worker threads (``ProcessGroupGloo::runLoop``)."""


def worker_states(tasks: Path = Path("/proc/self/task")) -> list[str]:
    """The scheduler state of each of this process's gloo worker threads (``R`` running or ready
    to run, ``S`` asleep: an idle worker waits there for its next work); none where ``/proc`` is
    not there to read."""
    states = []
    for task in sorted(tasks.glob("*")) if tasks.is_dir() else ():
        try:
            if (task / "comm").read_text().strip() != WORKER_THREAD:
                continue
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended while we looked
            continue
        states.append(stat.rsplit(")", 1)[1].split()[0])  # the field after "pid (comm)"
    return states


def busy_workers(tasks: Path = Path("/proc/self/task")) -> int:
    """How many of this process's gloo worker threads are not asleep."""
    return sum(state != "S" for state in worker_states(tasks))


def wait_for_workers(timeout_s: float = SETTLE_TIMEOUT_S, step_s: float = 0.002) -> bool:
    """Sleep in steps of ``step_s`` until no gloo worker is busy at two looks in a row; False if
    ``timeout_s`` ran out first."""
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while quiet < 2:
        if time.monotonic() > deadline:
            return False
        time.sleep(step_s)  # the GIL released: a worker waiting for it frees its tensor now
        quiet = quiet + 1 if busy_workers() == 0 else 0
    return True


@functools.cache
def settle_at_exit() -> None:
    """Register ``wait_for_workers`` to run at this process's exit (once, however often called)."""
    atexit.register(wait_for_workers)


__all__ = ["SETTLE_TIMEOUT_S", "busy_workers", "settle_at_exit", "wait_for_workers", "worker_states"]
