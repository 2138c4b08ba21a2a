"""Run a worker on N local CPU ranks forked from one process that imported the worker's modules
once, with what ``torchrun --standalone`` gives a worker:

    python -m functional_tests.forkrun --nproc 4 --preload a.b,c -m package.worker ARGS...
    python -m functional_tests.forkrun --nproc 4 path/to/worker.py ARGS...

The functional workers spend most of their CPU in imports: megatron-core and its dependencies
take 6 to 10 s of CPU a process, torchtitan's Trainer 8 to 9 s, torch 2 to 3 s, and the suite
runs on two cores. Under torchrun every rank pays them; here the launcher pays them once
(``--preload``, then the worker module itself), forks the ranks, and each rank runs the worker
as ``__main__`` (``runpy``). A worker cannot tell the difference: ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` are set, and its
``init_process_group`` (``env://``) connects to a TCP store the launcher hosts, as torchrun's
agent does (``TORCHELASTIC_USE_AGENT_STORE``): the store listens on a port the system picked,
so no two launches can race for one.

Forking is safe only from a process with one thread: the launcher refuses to fork when an
import started a Python thread, and hosts the store (which has threads) only after the fork.
For the CPU only: a process that initialised CUDA cannot fork ranks that use it.

Like torchrun: the first rank to fail ends the others (SIGTERM, then SIGKILL after
:data:`GRACE_S`) and its exit status is the launcher's; SIGTERM or SIGINT to the launcher ends
every rank. Unlike torchrun's, a rank ends without the interpreter's teardown (its ``atexit``
handlers do not run; multiprocessing's finalizers do), as te-paged's own ranks end
(``te_paged.tools.launch.leave``): gloo's native threads were seen to abort finished ranks there.
And unlike torchrun's, a rank's gloo groups share one transport device
(``functional_tests/gloo.py``): one loop thread a rank, not one a group.
"""

from __future__ import annotations

import argparse
import importlib
import os
import runpy
import signal
import sys
import threading
import time

from functional_tests.gloo import share_one_device
from te_paged.tools.launch import leave

#: Seconds the other ranks get to end after SIGTERM before SIGKILL.
GRACE_S = 10.0


def _parse(argv: list[str]) -> argparse.Namespace:
    """The launcher's options, then ``-m MODULE ARGS...`` or ``SCRIPT ARGS...`` (passed on
    untouched, as torchrun does)."""
    parser = argparse.ArgumentParser(prog="python -m functional_tests.forkrun",
                                     description=__doc__.splitlines()[0])  # fmt: skip
    parser.add_argument("--nproc", type=int, required=True, help="ranks to fork")
    parser.add_argument("--preload", default="", help="comma-separated modules to import first")
    split = 0
    while split < len(argv) and argv[split] != "-m" and argv[split].startswith("-"):
        split += 1 if "=" in argv[split] or argv[split] in ("-h", "--help") else 2
    args = parser.parse_args(argv[:split])
    target = argv[split:]
    if args.nproc < 1:
        parser.error(f"--nproc must be >= 1, got {args.nproc}")
    if not target or target == ["-m"]:
        parser.error("give -m MODULE or a script, and its arguments")
    args.module = target[1] if target[0] == "-m" else None
    args.target = target[2:] if target[0] == "-m" else target
    return args


def _run_rank(args: argparse.Namespace, rank: int, port_fd: int) -> int:
    """In a forked rank: wait for the store's port, set torchrun's variables, run the worker."""
    with os.fdopen(port_fd, "rb") as f:
        port = f.read().decode()
    if not port:  # the launcher failed before it could host the store
        return 1
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        WORLD_SIZE=str(args.nproc),
        LOCAL_WORLD_SIZE=str(args.nproc),
        ROLE_WORLD_SIZE=str(args.nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=port,
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    try:
        if args.module is not None:
            sys.argv = [args.module, *args.target]
            runpy.run_module(args.module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args.target)
            runpy.run_path(args.target[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    return 0


def _status(wait_status: int) -> int:
    """A child's wait status as a shell would give it (128 + N for signal N)."""
    code = os.waitstatus_to_exitcode(wait_status)
    return 128 - code if code < 0 else code


def _end(pids: set[int]) -> None:
    """SIGTERM to the ranks still running, SIGKILL to those left after GRACE_S; reap them."""
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while pids and time.monotonic() < deadline:
        pid, _ = os.waitpid(-1, os.WNOHANG)
        if pid:
            pids.discard(pid)
        else:
            time.sleep(0.05)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    pids.clear()


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    preload = [m for m in args.preload.split(",") if m]
    if args.module is not None:
        preload.append(args.module)  # its imports; the rank runs it again as __main__
    for name in preload:
        importlib.import_module(name)
    share_one_device()  # in every rank: the megatron-core workers' 130 gloo groups a rank
    if threading.active_count() > 1:
        names = ", ".join(t.name for t in threading.enumerate() if t is not threading.main_thread())
        print(f"forkrun: importing {preload} started threads ({names}); a fork would not "
              "copy them: launch with torchrun instead", file=sys.stderr)  # fmt: skip
        return 1
    sys.stdout.flush()
    sys.stderr.flush()
    ranks: dict[int, int] = {}  # pid -> rank
    port_pipes: list[int] = []
    for rank in range(args.nproc):
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # a rank
            for fd in (write_fd, *port_pipes):
                os.close(fd)
            try:
                code = _run_rank(args, rank, read_fd)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
            leave(code)  # without the interpreter's teardown (module docstring)
        os.close(read_fd)
        ranks[pid] = rank
        port_pipes.append(write_fd)

    stopped: list[int] = []

    def stop(signum, frame) -> None:
        stopped.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    running = set(ranks)
    try:
        from torch.distributed import TCPStore

        # Hosted after the fork (its server has threads); it lives until the ranks are done.
        store = TCPStore("127.0.0.1", 0, world_size=None, is_master=True,
                         wait_for_workers=False)  # fmt: skip
        for fd in port_pipes:
            os.write(fd, str(store.port).encode())
            os.close(fd)
        port_pipes.clear()
        while running:
            pid, wait_status = os.waitpid(-1, 0)
            running.discard(pid)
            code = _status(wait_status)
            if code != 0:
                print(f"forkrun: rank {ranks[pid]} (pid {pid}) exited with status {code}; "
                      f"ending the other ranks", file=sys.stderr, flush=True)  # fmt: skip
                _end(running)
                return code
        return 0
    except KeyboardInterrupt:
        _end(running)
        return 128 + (stopped[0] if stopped else signal.SIGINT)
    except BaseException:
        _end(running)
        raise
    finally:
        for fd in port_pipes:  # ranks still waiting for a port read an empty one and exit
            os.close(fd)


if __name__ == "__main__":
    sys.exit(main())
