"""What a process sees of itself at start, for tests/test_units.py's fork-server test: run as ``python -u -m fork_probe
OUT MODE`` (cwd tests/scripts), fresh or forked by trainer.forkserver. Writes a JSON description to OUT, then MODE:
``exit7`` exits 7, ``segv`` dies of SIGSEGV, ``term`` exits 5 on SIGTERM (after writing OUT.term), ``sleep`` sleeps;
``term`` and ``sleep`` write OUT.ready first."""

import ctypes
import json
import os
import random
import signal
import sys
import time

out, mode = sys.argv[1], sys.argv[2]
pdeathsig = ctypes.c_int(-1)
ctypes.CDLL(None).prctl(2, ctypes.byref(pdeathsig), 0, 0, 0)  # PR_GET_PDEATHSIG
info = {
    "pid": os.getpid(),
    "sid": os.getsid(0),
    "argv": sys.argv,
    "cwd": os.getcwd(),
    "path0": sys.path[0],
    "probe_var": os.environ.get("PROBE_VAR"),
    "forked_by": os.environ.get("SHARDKEEPER_FORKED_BY"),
    "signals": {
        int(s): str(signal.getsignal(s)) for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)
    },
    "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "threads": len(os.listdir("/proc/self/task")),
    "fds": sorted(int(f) for f in os.listdir("/proc/self/fd")),
    "stdout": os.readlink("/proc/self/fd/1"),
    "random": random.random(),
    "pdeathsig": pdeathsig.value,
    "name": __name__,
}
with open(out, "w") as f:
    json.dump(info, f)
if mode == "exit7":
    sys.exit(7)
if mode == "segv":
    os.kill(os.getpid(), signal.SIGSEGV)
if mode == "term":

    def on_term(*_: object) -> None:
        open(out + ".term", "w").close()
        os._exit(5)

    signal.signal(signal.SIGTERM, on_term)
if mode in ("term", "sleep"):
    open(out + ".ready", "w").close()
    time.sleep(60)
