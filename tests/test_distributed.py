"""Tests of runtime/ and convert/topology.py: topologies, megatron-core re-initialisation, LocalWorld failures.

The topology test re-initialises many topologies in one 4-rank world (what the commands and the
suite rely on), and the failure tests share a 2-rank world that each failure kills and the next
``run`` restarts. CPU ranks fork from a warm server: its tests check that they still read the
owner's environment and die with it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vime_gemma4_bridge.convert.topology import Topology, init_model_parallel, parallel_layout
from vime_gemma4_bridge.runtime.group import in_torchrun
from vime_gemma4_bridge.runtime.launch import add_launch_arguments, launch
from vime_gemma4_bridge.runtime.world import LocalWorld, RankError, WorldTimeoutError

# --------------------------------------------------------------------------------------------
# Job functions: module level, so that the ranks can unpickle them by reference.
# --------------------------------------------------------------------------------------------


def _layout_job(topology: Topology) -> dict:
    """Initialise ``topology`` and report what megatron-core and the process groups say."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    init_model_parallel(topology)
    layout = parallel_layout()
    rank = dist.get_rank()
    groups = {
        "tp": ps.get_tensor_model_parallel_group(),
        "pp": ps.get_pipeline_model_parallel_group(),
        "ep": ps.get_expert_model_parallel_group(),
        "etp": ps.get_expert_tensor_parallel_group(),
    }
    for name, group in groups.items():
        value = torch.tensor([float(rank)])
        dist.all_reduce(value, group=group)
        layout[f"{name}_sum"] = value.item()
        layout[f"{name}_members"] = sorted(dist.get_process_group_ranks(group))
    layout["in_embedding_group"] = ps.is_rank_in_embedding_group()
    layout["process_groups"] = len(dist.distributed_c10d._world.pg_map)
    layout["pid"] = os.getpid()
    layout["rand"] = torch.rand(3).tolist()
    return layout


def _whoami() -> tuple[int, int]:
    import torch.distributed as dist

    return dist.get_rank(), os.getpid()


def _raise_on(bad_rank: int) -> str:
    import torch.distributed as dist

    if dist.get_rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    dist.barrier()  # the others wait in a collective for the rank that failed: they never return
    return "unreachable"


def _exit_on(bad_rank: int, code: int) -> int:
    import torch.distributed as dist

    if dist.get_rank() == bad_rank:
        os._exit(code)
    return dist.get_rank()


def _hang_on(bad_rank: int, seconds: float) -> int:
    import torch.distributed as dist

    if dist.get_rank() == bad_rank:
        # A grandchild too: killing the world must take the rank's own children with it.
        subprocess.Popen(["sleep", str(int(seconds) + 60)])
        time.sleep(seconds)
    return dist.get_rank()


def _getenv(name: str) -> str | None:
    return os.environ.get(name)


def _single_rank_job(topology: Topology) -> dict:
    init_model_parallel(topology)
    return parallel_layout()


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _expected(topology: Topology, world: int, rank: int) -> dict:
    """Sizes, ranks and group members from megatron-core's rank order "tp-cp-ep-dp-pp"."""
    tp, pp, ep, etp = topology.tp, topology.pp, topology.ep, topology.etp
    dp, edp = world // (tp * pp), world // (etp * ep * pp)
    tp_rank, dp_rank, pp_rank = rank % tp, (rank // tp) % dp, rank // (tp * dp)
    etp_rank, ep_rank = rank % etp, (rank // etp) % ep
    members = {
        "tp": [rank - tp_rank + i for i in range(tp)],
        "pp": [rank % (world // pp) + i * (world // pp) for i in range(pp)],
        "ep": [rank - ep_rank * etp + i * etp for i in range(ep)],
        "etp": [rank - etp_rank + i for i in range(etp)],
    }
    return {
        "sizes": {"tp": tp, "pp": pp, "vpp": topology.vpp, "ep": ep, "etp": etp, "dp": dp, "edp": edp},
        "ranks": {"tp_rank": tp_rank, "pp_rank": pp_rank, "ep_rank": ep_rank, "etp_rank": etp_rank, "dp_rank": dp_rank},
        "members": members,
        "sums": {name: float(sum(ranks)) for name, ranks in members.items()},
        "in_embedding_group": pp_rank in (0, pp - 1),
    }


def _processes() -> dict[int, list[str]]:
    """Every process → the fields of its ``/proc/PID/stat`` after the command name (state, ppid, pgrp, …)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            found[int(entry.name)] = stat[stat.rindex(")") + 2 :].split()
    return found


def _processes_in_groups(pgids: set[int]) -> list[int]:
    """Live (non-zombie) processes whose process group is one of ``pgids`` (ranks lead their own group)."""
    return [pid for pid, fields in _processes().items() if int(fields[2]) in pgids and fields[0] != "Z"]


def _parent(pid: int) -> int:
    return int(_processes()[pid][1])


def _spawned_children() -> list[int]:
    """Multiprocessing children of this process (multiprocessing's resource tracker excepted)."""
    found = []
    for pid, fields in _processes().items():
        if int(fields[1]) != os.getpid() or fields[0] == "Z":
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            found.append(pid)
    return found


def _wait_until_gone(pids: list[int], seconds: float) -> list[int]:
    """Wait up to ``seconds`` for the live processes in the groups of ``pids`` to end; return those left."""
    deadline = time.monotonic() + seconds
    while (left := _processes_in_groups(set(pids))) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _assert_gone(pids: list[int]) -> None:
    assert pids, "the world had no processes to check"
    assert _wait_until_gone(pids, 5) == [], "rank processes (or their children) were left behind"
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert _spawned_children() == [], "spawned child processes were left behind"


# --------------------------------------------------------------------------------------------
# (a) many topologies in one world
# --------------------------------------------------------------------------------------------

TOPOLOGIES = [
    Topology(tp=2, pp=2, ep=2),  # ETP1: fits 4 ranks only because etp does not default to tp
    Topology(ep=4),
    Topology(tp=4),
    Topology(tp=2, ep=2, etp=2),
    Topology(pp=4),  # after PP1/PP2: middle stages must not keep stale embedding-group ranks
    Topology(tp=2, pp=2, vpp=2, ep=2),
    Topology(tp=2, pp=2, ep=2),  # again: same process-group count as the first time (no leak)
]


def test_reinitialises_many_topologies_in_one_world(local_world) -> None:
    world = local_world(4)
    started = time.monotonic()
    first = world.run(_whoami)
    startup = time.monotonic() - started
    pids = [pid for _, pid in first]
    group_counts = []
    for topology in TOPOLOGIES:
        layouts = world.run(_layout_job, topology, timeout=120)
        assert [layout["pid"] for layout in layouts] == pids, "ranks must be reused, not respawned"
        for rank, layout in enumerate(layouts):
            want = _expected(topology, 4, rank)
            where = f"{topology} rank {rank}"
            assert layout["rank"] == rank and layout["world_size"] == 4, where
            assert {k: layout[k] for k in want["sizes"]} == want["sizes"], where
            assert {k: layout[k] for k in want["ranks"]} == want["ranks"], where
            assert {k: layout[f"{k}_members"] for k in want["members"]} == want["members"], where
            assert {k: layout[f"{k}_sum"] for k in want["sums"]} == want["sums"], where
            assert layout["in_embedding_group"] == want["in_embedding_group"], where
        assert all(layout["rand"] == layouts[0]["rand"] for layout in layouts), "ranks must be seeded alike"
        group_counts.append(layouts[0]["process_groups"])
    assert group_counts[-1] == group_counts[0], f"process groups leak across re-initialisation: {group_counts}"
    print(f"4-rank world start-up {startup:.1f} s; {len(TOPOLOGIES)} topologies {time.monotonic() - started:.1f} s")

    # close() leaves nothing behind (and the failure tests below want a smaller world anyway).
    world.close()
    assert not world.alive
    _assert_gone(pids)


# --------------------------------------------------------------------------------------------
# (b, c) failures: raise, crash, hang, close
# --------------------------------------------------------------------------------------------


def _leave_a_cycle(nbytes: int) -> int:
    """Return, leaving ``nbytes`` in a reference cycle (a Megatron model's modules reference each other)."""
    import torch

    cycle: dict = {"tensor": torch.ones(nbytes, dtype=torch.uint8)}
    cycle["self"] = cycle
    return _rss()


def _rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) << 10 for line in status if line.startswith("VmRSS:"))


def test_a_job_leaves_nothing_for_the_next(local_world) -> None:
    """A rank serves job after job: what a job left in a reference cycle is collected before the next
    runs (a 2-layer 26B-A4B round trip's model stayed, 1.1 GB a rank, and the next load came on top)."""
    world = local_world(2)
    holding = world.run(_leave_a_cycle, 300 << 20)
    after = world.run(_rss)
    assert all(held - now > 250 << 20 for held, now in zip(holding, after, strict=True)), (holding, after)


def _private_dirty_after_a_collection() -> int:
    """How much of this rank's memory a full collection made its own (bytes of pages it copied)."""
    import gc

    def private_dirty() -> int:
        with open("/proc/self/smaps_rollup") as rollup:
            return next(int(line.split()[1]) << 10 for line in rollup if line.startswith("Private_Dirty:"))

    before = private_dirty()
    gc.collect()
    return private_dirty() - before


def test_a_collection_in_a_warm_rank_copies_none_of_the_servers_pages(local_world) -> None:
    """Ranks fork from the fork server that imported megatron; its objects are frozen (``gc.freeze``), so
    the collection after each job does not write into them: it copied 157 MB a rank, 1.25 GB on 8."""
    assert all(copied < 32 << 20 for copied in local_world(2).run(_private_dirty_after_a_collection))


def test_rank_error_reports_traceback_and_world_recovers(local_world) -> None:
    world = local_world(2)
    before = [pid for _, pid in world.run(_whoami)]
    started = time.monotonic()
    with pytest.raises(RankError) as caught:
        world.run(_raise_on, 1, timeout=60)
    elapsed = time.monotonic() - started
    error = caught.value
    assert error.ranks == (1,)
    assert error.unfinished == (0,)  # rank 0 was stuck in the barrier
    text = str(error)
    assert "rank(s) 1" in text and "----- rank 1 -----" in text
    assert "Traceback (most recent call last)" in text and "_raise_on" in text
    assert "ValueError: deliberate failure on rank 1" in text
    assert elapsed < 30, f"the failure took {elapsed:.1f} s to report"
    assert not world.alive
    _assert_gone(before)

    # The next run respawns the world transparently (and leaves it alive for the next test).
    starts = world.starts
    after = world.run(_whoami)
    assert [rank for rank, _ in after] == [0, 1]
    assert set(pid for _, pid in after).isdisjoint(before)
    assert world.starts == starts + 1 and world.alive


def test_unpicklable_job_is_refused_before_sending(local_world) -> None:
    world = local_world(2)
    with pytest.raises(TypeError, match="module level"):
        world.run(lambda: 1)


def test_dead_rank_is_reported(local_world) -> None:
    world = local_world(2)
    pids = [pid for _, pid in world.run(_whoami)]
    with pytest.raises(RankError, match=r"rank 0 process ended \(exit code 3\)") as caught:
        world.run(_exit_on, 0, 3, timeout=60)
    assert caught.value.ranks == (0,)
    assert not world.alive
    _assert_gone(pids)


def test_hung_rank_times_out_and_nothing_is_left_behind(local_world) -> None:
    world = local_world(2)
    pids = [pid for _, pid in world.run(_whoami)]
    started = time.monotonic()
    with pytest.raises(TimeoutError) as caught:
        world.run(_hang_on, 1, 120, timeout=3)
    elapsed = time.monotonic() - started
    assert isinstance(caught.value, WorldTimeoutError)
    assert caught.value.ranks == (1,)
    assert "rank(s) 1 did not answer within 3 s" in str(caught.value)
    assert elapsed < 15, f"the timeout took {elapsed:.1f} s"
    assert not world.alive
    _assert_gone(pids)  # the hung rank's `sleep` child included


def test_ranks_fork_warm_and_see_the_owners_environment_now(local_world, monkeypatch) -> None:
    """CPU ranks fork from the fork server (imports done once), yet read this process's environment at their start."""
    world = local_world(2)
    world.run(_whoami)  # the fork server runs from here on
    world.close()
    monkeypatch.setenv("VIME_GEMMA4_TEST_MARK", "set after the fork server started")
    started = time.monotonic()
    assert world.run(_getenv, "VIME_GEMMA4_TEST_MARK") == ["set after the fork server started"] * 2
    startup = time.monotonic() - started
    print(f"warm 2-rank world start-up {startup:.1f} s")
    assert startup < 10, "a warm 2-rank world must start in seconds"
    assert world.run(_getenv, "OMP_NUM_THREADS") == [str(max(1, len(os.sched_getaffinity(0)) // 2))] * 2
    parents = {_parent(pid) for pid in world.pids}
    assert parents != {os.getpid()} and len(parents) == 1, "ranks must be forks of one server"


def test_verbose_worlds_spawn_fresh_interpreters(local_world) -> None:
    """The spawn road (GPU hosts, ``--verbose``): each rank its own interpreter, a child of this process."""
    local_world(2).close()  # one world at a time
    with LocalWorld(2, verbose=True) as world:
        assert [rank for rank, _ in world.run(_whoami)] == [0, 1]
        assert {_parent(pid) for pid in world.pids} == {os.getpid()}


_OWNER = """
import time
from vime_gemma4_bridge.runtime.world import LocalWorld
world = LocalWorld(2)
world.start()
print(*world.pids, flush=True)
world.run(time.sleep, 600)  # busy ranks: they do not read their pipes, only the watch can end them
"""


def test_ranks_die_with_a_killed_owner() -> None:
    """SIGKILL of the process that owns a world (no close, no atexit) takes its busy ranks down within seconds."""
    owner = subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        pids = [int(pid) for pid in owner.stdout.readline().split()]
        assert len(pids) == 2, "the owner did not start its world"
        time.sleep(2)  # the ranks are in the job by now
    finally:
        owner.kill()
        owner.wait(30)
    # Orphans are re-parented to init, which may leave zombies unreaped here: only live ones count.
    assert _wait_until_gone(pids, 10) == [], "ranks outlived the owner they serve"


_TORCHRUN_JOB = """
import os, sys, time
import torch.distributed as dist
from vime_gemma4_bridge.io.commit import partial_path, remove_own_partials
from vime_gemma4_bridge.runtime.launch import at_launcher_gone, launch

def job(out):
    if dist.get_rank() == 0:
        partial_path(out).mkdir()  # what a command writes into until it commits
    with open(f"{out}.pid{dist.get_rank()}", "w") as f:
        f.write(str(os.getpid()))
    while True:  # in collectives: a peer that ends first breaks them
        dist.barrier()
        time.sleep(0.05)

at_launcher_gone(remove_own_partials)  # as the command line does
launch(None, job, sys.argv[1])
"""


def test_ranks_end_quietly_with_a_killed_torchrun(tmp_path: Path) -> None:
    """SIGKILL of torchrun: its ranks end within seconds, print nothing, and rank 0's partial output is gone.

    Before: they went on (a stopped run committed its output) or waited in a collective for gloo's
    timeout, then printed C++ ``DistNetworkError`` traces.
    """
    torchrun = Path(sys.executable).parent / "torchrun"
    script = tmp_path / "job.py"
    script.write_text(_TORCHRUN_JOB)
    launcher = subprocess.Popen(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", str(script), str(tmp_path / "out")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while len(pid_files := sorted(tmp_path.glob("out.pid*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1)  # both ranks in their barriers
        pids = [int(f.read_text()) for f in pid_files]
        assert len(pids) == 2, "the ranks did not start"
    finally:
        launcher.kill()
        launcher.wait(30)
    assert _wait_until_gone(pids, 10) == [], "ranks outlived the torchrun that launched them"
    printed = launcher.stderr.read()
    assert not [line for line in printed.splitlines() if "Traceback" in line or "Error" in line], printed
    assert list(tmp_path.glob(".out.partial*")) == [], "rank 0's partial output was left"


# --------------------------------------------------------------------------------------------
# (d) Topology and command-line helpers
# --------------------------------------------------------------------------------------------


def test_topology_str_and_sizes() -> None:
    assert str(Topology(tp=2, pp=2, ep=2)) == "TP2·PP2·EP2·ETP1"
    assert str(Topology(pp=2, vpp=3)) == "TP1·PP2·VPP3·EP1·ETP1"
    assert Topology().etp == 1 and Topology(tp=4).etp == 1
    assert Topology(tp=2, pp=2, ep=2).min_world_size == 4
    assert Topology(tp=2, ep=4).min_world_size == 4
    assert Topology(tp=3, ep=2).min_world_size == 6
    assert Topology(tp=2, pp=2, ep=2).data_parallel_size(8) == 2
    for topology, world in [
        (Topology(tp=2, pp=2, ep=2), 4),
        (Topology(ep=4), 4),
        (Topology(tp=4), 8),
        (Topology(tp=2, ep=2, etp=2), 4),
        (Topology(pp=2, vpp=2), 2),
        (Topology(), 1),
    ]:
        topology.validate(world)


@pytest.mark.parametrize(
    ("topology", "world", "message"),
    [
        (Topology(tp=2, pp=2), 6, r"TP·PP = 4 must divide the world size; use a world size that is a multiple of 4"),
        (Topology(ep=4), 2, r"ETP·EP·PP = 4 must divide the world size.*--nproc 4"),
        (Topology(tp=2, pp=2, ep=2, etp=2), 4, r"ETP·EP·PP = 8 must divide .*multiple of 8"),
        (Topology(vpp=2), 4, r"--vpp 2 needs pipeline parallelism: set --pp to 2 or more, or omit --vpp"),
        (Topology(tp=0), 4, r"--tp must be a whole number >= 1, got 0"),
        (Topology(ep=-1), 4, r"--ep must be a whole number >= 1"),
        (Topology(pp=2, vpp=0), 4, r"--vpp must be a whole number >= 1 or omitted"),
        (Topology(), 0, r"--nproc \(the world size; under torchrun its WORLD_SIZE\) must be a whole number >= 1"),
    ],
)
def test_topology_validate_rejects(topology: Topology, world: int, message: str) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        topology.validate(world)
    assert "\n" not in str(caught.value)


def test_topology_and_launch_arguments() -> None:
    parser = argparse.ArgumentParser()
    Topology.add_arguments(parser)
    add_launch_arguments(parser)
    args = parser.parse_args(["--tp", "2", "--pp", "2", "--vpp", "2", "--ep", "2", "--nproc", "4"])
    assert Topology.from_args(args) == Topology(tp=2, pp=2, vpp=2, ep=2, etp=1)
    assert args.nproc == 4
    defaults = parser.parse_args([])
    assert Topology.from_args(defaults) == Topology() and defaults.nproc is None
    assert Topology.from_args(argparse.Namespace(tp=4)) == Topology(tp=4)
    helptext = parser.format_help()
    for flag in ("--tp", "--pp", "--vpp", "--ep", "--etp", "--nproc"):
        assert flag in helptext


def test_local_world_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="nproc"):
        LocalWorld(0)


# --------------------------------------------------------------------------------------------
# launch(): a single rank in this process, and under a torchrun-like environment
# --------------------------------------------------------------------------------------------


def test_launch_runs_in_process_without_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert not in_torchrun()
    [layout] = launch(None, _single_rank_job, Topology())
    assert layout["world_size"] == 1 and layout["tp"] == 1 and layout["ep"] == 1
    assert not dist.is_initialized(), "the one-rank world must be torn down after the job"


def test_launch_under_torchrun_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert in_torchrun()
    try:
        [layout] = launch(None, _single_rank_job, Topology())
        assert layout["world_size"] == 1 and layout["rank"] == 0
        assert dist.is_initialized(), "under torchrun the process group belongs to the job"
    finally:
        from vime_gemma4_bridge.compat.parallel_state import reset_model_parallel

        if dist.is_initialized():
            reset_model_parallel()
            dist.destroy_process_group()
