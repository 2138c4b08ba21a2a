"""``functional_tests/forkrun.py``, the launcher of the functional workers: what a rank sees, the
one import of the preloaded modules, and how a failing rank ends the launch."""

from __future__ import annotations

import json
import os
import textwrap
import time

from .launch import REPO_ROOT, run_python

WORKER = """
import json, os, sys
import torch
import torch.distributed as dist
import imported_once

if __name__ == "__main__":
    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    groups = [dist.new_group([0, 1]) for _ in range(4)]  # rank 2 is in none of them
    in_groups = [torch.ones(1) for _ in groups]
    for group, one in zip(groups, in_groups):
        if dist.get_rank() < 2:
            dist.all_reduce(one, group=group)
    mine = [dist.group.WORLD, *groups] if dist.get_rank() < 2 else [dist.group.WORLD]
    devices = [g._get_backend(torch.device("cpu")).options._devices[0] for g in mine]
    task = "/proc/self/task"
    threads = [open(f"{task}/{t}/comm").read().strip() for t in os.listdir(task)]
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
    out = {name: os.environ[name] for name in names}
    out.update(total=total.item(), argv=sys.argv[1:], imported_by=imported_once.PID,
               launcher=os.getppid(), in_groups=[one.item() for one in in_groups],
               gloo_devices=len({id(device) for device in devices}),
               gloo_loops=threads.count("gloo_tcp_loop"), named="pt_gloo_runloop" in threads)
    with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
"""


def _write(folder, name: str, text: str) -> str:
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_ranks_get_torchruns_variables_and_the_preloaded_modules_of_the_launcher(tmp_path):
    _write(tmp_path, "imported_once.py", "import os\nPID = os.getpid()\n")
    script = _write(tmp_path, "worker.py", WORKER)
    proc = run_python(
        ["-m", "functional_tests.forkrun", "--nproc", "3", "--preload", "imported_once", script,
         str(tmp_path), "--flag"],
        timeout_s=120,
        env={"PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO_ROOT)])},
        merge_output=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    for rank, seen in enumerate(ranks):
        assert seen["RANK"] == seen["LOCAL_RANK"] == str(rank)
        assert seen["WORLD_SIZE"] == seen["LOCAL_WORLD_SIZE"] == "3"
        assert seen["total"] == 6.0  # 1 + 2 + 3: the ranks met through the launcher's store
        assert seen["argv"] == [str(tmp_path), "--flag"]
        # Imported once, by the launcher the ranks were forked from.
        assert seen["imported_by"] == seen["launcher"] == ranks[0]["launcher"]
        # Five gloo groups on ranks 0 and 1 and one transport device a rank, so one loop
        # thread (functional_tests/gloo.py); torch alone gives each group its own. (torch
        # 2.10 leaves gloo's threads unnamed.)
        assert seen["in_groups"] == [2.0 if rank < 2 else 1.0] * 4
        assert seen["gloo_devices"] == 1, f"rank {rank}: a gloo device per group: {seen}"
        assert seen["gloo_loops"] == seen["named"], f"rank {rank}: gloo loop threads: {seen}"


def test_a_failing_rank_ends_the_others_and_its_status_is_the_launchers(tmp_path):
    script = _write(tmp_path, "worker.py", """
        import os, sys, time
        if os.environ["RANK"] == "1":
            sys.exit(3)
        time.sleep(120)
        open(os.path.join(sys.argv[1], "finished"), "w").close()
        """)  # fmt: skip
    start = time.monotonic()
    proc = run_python(["-m", "functional_tests.forkrun", "--nproc", "2", script, str(tmp_path)],
                      timeout_s=90, merge_output=True)  # fmt: skip
    assert proc.returncode == 3, proc.stdout
    assert "rank 1" in proc.stdout and "exited with status 3" in proc.stdout
    assert time.monotonic() - start < 60 and not (tmp_path / "finished").exists()


def test_an_import_that_starts_a_thread_is_refused_before_any_fork(tmp_path):
    _write(tmp_path, "threaded.py", """
        import threading, time
        threading.Thread(target=time.sleep, args=(5,), name="sleeper", daemon=True).start()
        """)  # fmt: skip
    script = _write(tmp_path, "worker.py", "raise SystemExit('a rank ran')\n")
    proc = run_python(
        ["-m", "functional_tests.forkrun", "--nproc", "2", "--preload", "threaded", script],
        timeout_s=60,
        env={"PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO_ROOT)])},
        merge_output=True,
    )
    assert proc.returncode == 1 and "started threads (sleeper)" in proc.stdout, proc.stdout
    assert "a rank ran" not in proc.stdout


def test_a_rank_ends_without_the_interpreters_teardown(tmp_path):
    # gloo's native threads were seen to abort a rank in the teardown after a complete run; a
    # teardown that aborts stands in for them.
    script = _write(tmp_path, "worker.py", """
        import atexit, os, sys
        atexit.register(os.abort)
        open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}"), "w").close()
        """)  # fmt: skip
    proc = run_python(["-m", "functional_tests.forkrun", "--nproc", "2", script, str(tmp_path)],
                      timeout_s=60, merge_output=True)  # fmt: skip
    assert proc.returncode == 0, f"a rank ran the interpreter's teardown:\n{proc.stdout}"
    assert (tmp_path / "rank0").exists() and (tmp_path / "rank1").exists()
