"""Contract tests of the warm RankCluster (tests/kit/runtime/cluster.py; docs/architecture.md, "The cluster").

Most tests share the session ``cluster`` fixture; only the leftover-process test starts
clusters of its own (in driver subprocesses, one engine each).
"""

from __future__ import annotations

import glob
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.kit.runtime._watchdog import owned_processes, sweep
from tests.kit.runtime.cluster import REPO_ROOT, RankCluster, RankFailure
from tests.kit.runtime.engine_fork import load_time_environment
from tests.kit_tests import _ranks_cluster as ranks


@pytest.fixture(scope="module")
def owned_cluster(cluster: RankCluster):
    """The session's cluster when this session started it; else (the session joined someone's
    cluster) a private one: these tests kill and restart engines."""
    if cluster.cluster is not None:
        yield cluster
    else:
        with RankCluster.start(2) as private:
            yield private


def test_allreduce_results_indexed_by_rank(cluster):
    for world_size in (2, 4):
        if world_size > cluster.n_engines:
            continue
        out = cluster.run(ranks.allreduce_sum, world_size)
        assert [o["rank"] for o in out] == list(range(world_size))
        expected = world_size * (world_size + 1) / 2
        assert [o["sum"] for o in out] == [expected] * world_size
        assert {o["world_size"] for o in out} == {world_size}
        threads = max(1, (os.cpu_count() or 1) // world_size)
        assert {o["threads"] for o in out} == {threads}


def test_seed_namespace_and_view(cluster):
    torch.manual_seed(0)
    expected = torch.rand(1).item()
    assert cluster.run(ranks.seeded_draw, 2) == [expected, expected]

    assert cluster.run(ranks.keep_objects, 2, "hello") == ["hello", "hello"]
    view = cluster.view(1)
    assert view.pull("_rank", block=True) == 1
    assert view.pull("kept_tag", block=True) == "hello"
    assert view.pull("_last_result", block=True) == "hello"
    assert view.pull("_last_run", block=True)["world_size"] == 2
    assert torch.equal(view.pull("kept_tensor", block=True), torch.full((2,), 1.0))
    assert view.apply_sync(os.getpid) == cluster.pids[1]
    assert cluster.view().apply_sync(os.getcwd) == [str(REPO_ROOT)] * cluster.n_engines


def test_error_names_rank_fast_and_next_run_works(cluster):
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        cluster.run(ranks.fail_on_rank, 2, timeout=60)
    elapsed = time.monotonic() - t0
    failure = info.value
    # a rank that raised leaves at once (rank_runtime._leave_together): waiting out its peers' leave
    # bound (10 s) before reporting made every failing run about 11 s
    assert elapsed < 6, f"an error on one rank took {elapsed:.1f} s to report"
    assert "rank 1 raised ValueError: boom from rank 1" in str(failure)
    assert "fail_on_rank" in failure.failures[1]  # the remote traceback
    assert "ValueError: boom from rank 1" in cluster.view(1).pull("_last_traceback", block=True)
    assert cluster.run(ranks.trivial, 2) == [0, 1]


def test_a_rank_that_fails_at_once_leaves_its_slow_peer_its_own_error(owned_cluster):
    """A refusal on rank 0 must not tear the group down while rank 1 is still joining: rank 1
    then failed in gloo's connectFullMesh, or was reported stuck, and an UNSUPPORTED case read
    as ERROR (seen once in CI). Rank 1 runs at the lowest priority on busy cores to widen the
    window; without the barrier after joining, about 1 run in 20 went wrong here."""
    slow = psutil.Process(owned_cluster.pids[1])
    burners = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range((os.cpu_count() or 1) + 1)]
    wrong: list[str] = []
    runs = 0
    try:
        slow.nice(19)
        deadline = time.monotonic() + 60
        while runs < 80 and time.monotonic() < deadline:
            runs += 1
            with pytest.raises(RankFailure) as info:
                owned_cluster.run(ranks.fail_at_once, 2, timeout=30)
            if info.value.raised != {r: ("ValueError", f"refused on rank {r}") for r in (0, 1)}:
                wrong.append(info.value.summary)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
        try:
            slow.nice(0)
        except psutil.AccessDenied:  # not allowed to raise priority again: a fresh engine instead
            slow.kill()
    print(f"{runs} runs, {len(wrong)} wrong")
    assert runs >= 20, f"only {runs} runs in 60 s"
    assert not wrong, f"{len(wrong)} of {runs} runs did not report each rank's own error:\n" + "\n".join(wrong[:3])
    assert owned_cluster.run(ranks.allreduce_sum, 2)[1]["sum"] == 3.0


def test_hang_reports_every_stack_and_next_run_works(owned_cluster):
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        owned_cluster.run(ranks.hang_in_collective, 2, timeout=5)
    elapsed = time.monotonic() - t0
    failure = info.value
    print(f"hang case finished in {elapsed:.1f} s")
    assert elapsed < 5 + 20
    assert "timed out after 5 s" in str(failure)
    assert set(failure.failures) == {0, 1}
    assert "hang_in_collective" in failure.failures[0]
    assert "all_reduce" in failure.failures[0]
    assert "sleep_forever" in failure.failures[1]
    assert owned_cluster.run(ranks.allreduce_sum, 2)[1]["sum"] == 3.0


def test_deadlock_in_gloo_recv_reports_stacks(owned_cluster):
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        owned_cluster.run(ranks.deadlock_in_recv, 2, timeout=3)
    elapsed = time.monotonic() - t0
    print(f"deadlock case finished in {elapsed:.1f} s")
    assert elapsed < 3 + 20
    for rank in (0, 1):
        assert "deadlock_in_recv" in info.value.failures[rank]
    assert owned_cluster.run(ranks.allreduce_sum, 2)[0]["sum"] == 3.0


def test_ranks_deaf_to_sigint_are_killed_and_restarted(owned_cluster):
    old = owned_cluster.pids[:2]
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        owned_cluster.run(ranks.deaf_to_sigint, 2, timeout=3)
    elapsed = time.monotonic() - t0
    failure = info.value
    print(f"deaf case finished in {elapsed:.1f} s")
    assert elapsed < 3 + 20
    for rank in (0, 1):
        assert "sleep_forever" in failure.failures[rank]
        assert "engine killed and restarted" in failure.failures[rank]
    assert "restarted engines of ranks [0, 1]" in str(failure)
    assert set(owned_cluster.pids[:2]).isdisjoint(old)
    assert [owned_cluster.view(r).targets for r in (0, 1)] == [0, 1]
    assert owned_cluster.run(ranks.allreduce_sum, 2)[0]["sum"] == 3.0


def test_engine_killed_between_runs_is_restarted(owned_cluster):
    old_pid = owned_cluster.pids[1]
    engine = psutil.Process(old_pid)
    engine.kill()
    engine.wait(timeout=10)  # dead before the run starts (else it dies during the run)
    assert owned_cluster.run(ranks.trivial, 2) == [0, 1]
    assert owned_cluster.pids[1] != old_pid


_HOW_IT_ENDED = {"exit": "(exit code 3)", "sigkill": "(killed by SIGKILL)", "segfault": "(killed by SIGSEGV)"}


@pytest.mark.parametrize("how", ["exit", "sigkill", "segfault"])
def test_dead_engine_named_and_restarted(owned_cluster, how):
    old_pid = owned_cluster.pids[1]
    with pytest.raises(RankFailure) as info:
        owned_cluster.run(ranks.die_on_rank, 2, how, timeout=60)
    failure = info.value
    print(f"{how}: death reported after {failure.elapsed_s:.2f} s")
    assert failure.elapsed_s < 5
    assert f"rank 1 (engine pid {old_pid}) died" in str(failure)
    assert _HOW_IT_ENDED[how] in failure.failures[1], failure.failures[1]  # told by a forked engine's zygote
    if how == "segfault":
        assert "Segmentation fault" in failure.failures[1]
    assert not _alive(old_pid)
    assert owned_cluster.pids[1] != old_pid
    assert owned_cluster.view(1).targets == 1  # engine id == rank survives the restart
    assert owned_cluster.run(ranks.trivial, 2) == [0, 1]


def test_engines_are_forked_from_a_warm_parent_of_this_driver(owned_cluster):
    """What makes starts and restarts cheap (``engine_fork.py``): every engine, restarted ones
    too, is a child of a zygote of the engine role that this process started; none fell back to a
    cold start."""
    for pid in owned_cluster.pids:
        parent = psutil.Process(pid).parent()
        assert parent is not None and parent.ppid() == os.getpid(), f"engine {pid} was not forked by our zygote"
        assert parent.cmdline()[-1] == "tests.kit.runtime.engine_fork", parent.cmdline()


def test_engines_share_a_zygote_only_where_their_load_time_environments_match():
    base = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "2"}
    run_time = {"HPKIT_OWNER": "a-1", "HPKIT_NODE": "node1", "IPP_CLUSTER_ID": "c", "ATEN_CPU_CAPABILITY": "default"}
    assert load_time_environment({**base, **run_time}) == load_time_environment(base)
    assert load_time_environment({**base, "OMP_NUM_THREADS": "1"}) != load_time_environment(base)


def test_warm_overhead_under_one_second(cluster):
    cluster.run(ranks.trivial, 2)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        assert cluster.run(ranks.trivial, 2) == [0, 1]
        times.append(time.perf_counter() - t0)
    times.sort()
    print(f"warm 2-rank trivial run: median {times[2] * 1e3:.0f} ms, max {times[-1] * 1e3:.0f} ms")
    assert times[2] < 1.0


def test_join_runs_on_existing_engines_and_leaves_them(owned_cluster):
    cluster = owned_cluster
    joined = RankCluster.join(cluster.cluster.cluster_id, profile=cluster.cluster.profile or None)
    try:
        assert joined.pids == cluster.pids
        assert joined.run(ranks.trivial, 2) == [0, 1]
    finally:
        joined.stop()
    assert all(psutil.pid_exists(pid) for pid in cluster.pids)
    assert cluster.run(ranks.trivial, 2) == [0, 1]


_DRIVER = textwrap.dedent(
    """
    import faulthandler, json, sys, time

    from tests.kit_tests import _ranks_cluster as ranks
    from tests.kit.runtime.cluster import RankCluster

    faulthandler.dump_traceback_later(100)  # stuck before the test gives up at 120 s: say where
    mode = sys.argv[1]
    cluster = RankCluster.start(1)
    assert cluster.run(ranks.trivial, 1, timeout=40) == [0]  # a hung run reports the engine's stack
    faulthandler.cancel_dump_traceback_later()
    info = dict(
        token=cluster.token,
        controller=cluster.controller_pid,
        engines=cluster.pids,
        watchdog=cluster._watchdog.pid,
        files=cluster.leftover_globs,
    )
    print(json.dumps(info), flush=True)
    if mode.startswith("kill"):
        time.sleep(600)  # the test SIGKILLs us here
    elif mode == "with":
        with cluster:
            pass
        cluster.stop()  # idempotent
    # mode "atexit": just return; atexit must stop the cluster
    """
)


def _read_line(proc: subprocess.Popen, timeout: float, err: Path) -> str:
    """First stdout line of proc, bounded by timeout; on timeout, what the driver wrote to stderr."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise TimeoutError(f"driver printed nothing in {timeout:g} s; its stderr:\n{err.read_text()}")
    return proc.stdout.readline()


def _alive(pid: int) -> bool:
    """True if pid exists and is not a zombie."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.mark.slow
def test_no_leftover_processes(tmp_path):
    """Driver SIGKILLed; the same without its watchdog (engines must see it alone);
    driver exiting without stop() (atexit); and `with` + stop()."""
    modes = ["kill", "kill_without_watchdog", "atexit", "with"]
    drivers: dict[str, subprocess.Popen] = {}
    infos: dict[str, dict] = {}
    for mode in modes:
        with open(tmp_path / f"{mode}.err", "w") as err:
            drivers[mode] = subprocess.Popen(
                [sys.executable, "-c", _DRIVER, mode],
                cwd=REPO_ROOT,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
    try:
        for mode, proc in drivers.items():
            line = _read_line(proc, 120, tmp_path / f"{mode}.err")
            assert line, (tmp_path / f"{mode}.err").read_text()
            infos[mode] = json.loads(line)
        os.kill(infos["kill_without_watchdog"]["watchdog"], signal.SIGKILL)
        drivers["kill_without_watchdog"].send_signal(signal.SIGKILL)
        drivers["kill"].send_signal(signal.SIGKILL)
        for mode, proc in drivers.items():
            code = proc.wait(timeout=60)
            if not mode.startswith("kill"):
                assert code == 0, (tmp_path / f"{mode}.err").read_text()
        deadline = time.monotonic() + 20
        alone = infos["kill_without_watchdog"]
        while any(map(_alive, alone["engines"])) and time.monotonic() < deadline:
            time.sleep(0.2)
        engines_left = [p for p in alone["engines"] if _alive(p)]
        _clean_up(alone)  # its controller has no watchdog left: clean up by hand
        assert not engines_left, "engines outlived their driver with no watchdog"
        for mode, info in infos.items():
            if mode == "kill_without_watchdog":
                continue
            pids = [info["controller"], info["watchdog"], *info["engines"]]
            while time.monotonic() < deadline:
                if not owned_processes(info["token"]) and not any(map(_alive, pids)):
                    break
                time.sleep(0.2)
            assert not owned_processes(info["token"]), f"{mode}: leftover processes"
            assert not [p for p in pids if _alive(p)], f"{mode}: leftover pids"
            assert not [p for pattern in info["files"] for p in glob.glob(pattern)], f"{mode}: leftover files"
    finally:
        for proc in drivers.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        for info in infos.values():
            _clean_up(info)  # no-op when the test passed; else leave nothing behind


def _clean_up(info: dict) -> None:
    """Kill the processes and remove the files of a driver's cluster."""
    sweep(info["token"])
    for pattern in info["files"]:
        for path in glob.glob(pattern):
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            elif os.path.exists(path):
                os.remove(path)
