"""``hvd.init()`` under a real ``mpirun`` (Debian's Open MPI): ranks and topology from MPI, the rendezvous
through mpi4py, ``init(comm=...)`` with MPI communicators, the MASTER_ADDR/MASTER_PORT fallback without
mpi4py, and the error when neither is there; plus the pure parts (launcher variables, placement)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap

import psutil
import pytest

from sparkhvd.collective._engine import mpi as _mpi
from sparkhvd.runner import assign_ranks

INSTALL = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "openmpi-bin"]

SCRIPT = textwrap.dedent("""
    import os, sys, torch
    import sparkhvd.collective.torch as hvd

    mode = sys.argv[1]
    said = open(f"{mode}-{os.environ['OMPI_COMM_WORLD_RANK']}.said", "w")  # mpirun may mix lines of ranks


    def say(*words):
        print(*words, file=said, flush=True)

    if mode == "none":  # neither mpi4py nor MASTER_ADDR/MASTER_PORT
        try:
            hvd.init()
        except ValueError as exc:
            say(f"ERROR {exc}")
        sys.exit(0)
    if mode == "mpi":  # first with the MASTER_PORT the test holds: rank 0 cannot listen there
        try:
            hvd.init()
        except ValueError as exc:
            say(f"BUSY {exc}")
        del os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    env = [int(os.environ[f"OMPI_COMM_WORLD_{k}"]) for k in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE")]
    threads = None
    if mode == "mpi":
        from mpi4py import MPI
        threads = hvd.mpi_threads_supported() == (MPI.Query_thread() == MPI.THREAD_MULTIPLE)
    total = hvd.allreduce(torch.tensor([r + 1.0]), op=hvd.Sum).item()
    gathered = hvd.allgather(torch.full((r + 1,), r)).tolist()
    say("WORLD", [r, n, hvd.local_rank(), hvd.local_size()] == env, r, n, hvd.cross_rank(), hvd.cross_size(),
        hvd.is_homogeneous(), hvd.mpi_built(), hvd.mpi_enabled(), threads, total, gathered)
    if mode != "mpi":
        sys.exit(0)
    world = MPI.COMM_WORLD
    hvd.init(comm=world)  # the communicator it joined through: nothing to do
    sub = world.Split(color=r % 2, key=-r)  # ranks 0 and 2 (2 first), and rank 1 alone
    for comm in (sub, "world"):
        try:
            hvd.init(comm=comm)
        except ValueError as exc:
            say(f"REFUSED {exc}")
    hvd.shutdown()
    try:
        hvd.mpi_threads_supported()
    except ValueError as exc:
        say(f"DOWN {hvd.mpi_enabled()} {exc}")
    inter = sub.Create_intercomm(0, world, 1 if r != 1 else 2, tag=7)
    try:
        hvd.init(comm=inter)
    except ValueError as exc:
        say(f"INTER {exc}".replace(repr(inter), "<inter>"))
    inter.Free()
    hvd.init(comm=sub)
    total = hvd.allreduce(torch.tensor([r + 1.0]), op=hvd.Sum).item()
    say("SUB", r, hvd.rank(), hvd.size(), hvd.local_rank(), hvd.mpi_enabled(), total)
""")


@pytest.fixture(scope="session")
def mpirun() -> str:
    """Debian's Open MPI's ``mpirun``, installed (without recommends) where it is missing; skips where it cannot be."""
    found = shutil.which("mpirun")
    if found:
        return found
    if os.geteuid() != 0:
        pytest.skip("mpirun is missing and this user is not root, so it cannot apt-get install openmpi-bin.")
    if shutil.which("apt-get") is None:
        pytest.skip("mpirun is missing and there is no apt-get here to install Debian's openmpi-bin.")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    out = subprocess.run(INSTALL, capture_output=True, text=True, env=env)
    if out.returncode != 0:  # a fresh machine has no package lists yet
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, text=True, env=env)
        out = subprocess.run(INSTALL, capture_output=True, text=True, env=env)
    if out.returncode != 0 or not shutil.which("mpirun"):
        pytest.skip(f"mpirun is missing and `{' '.join(INSTALL)}` failed: {out.stderr.strip()[-300:]}")
    return shutil.which("mpirun")


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mpirun")
    (folder / "train.py").write_text(SCRIPT)
    hidden = folder / "hide" / "mpi4py"  # on PYTHONPATH, it stands before the installed mpi4py
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('mpi4py is hidden by tests/collective/test_mpirun.py')\n")
    return folder


def _run(mpirun: str, np: int, script, mode: str, *exported: str) -> str:
    """``mpirun -np N python train.py MODE`` on this host, checked for a clean exit: what its ranks
    said, then its output."""
    # one host: MPI's own traffic over shared memory, so the ranks open no TCP listener of MPI's on every
    # interface (mpirun's launcher listens as it must), and no single-copy (ptrace) that containers may deny
    command = [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(np), "--mca", "btl", "self,vader",
               "--mca", "btl_vader_single_copy_mechanism", "none"]
    for item in exported:
        command += ["-x", item]
    command += [sys.executable, str(script / "train.py"), mode]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=script)
    try:
        output, _ = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:  # leave no rank behind
            for child in psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]:
                child.kill()
            proc.wait()
    assert proc.returncode == 0, output
    said = "".join(path.read_text() for path in sorted(script.glob(f"{mode}-*.said")))
    return said + "\n" + output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lines(output: str, tag: str) -> list[str]:
    return sorted(line for line in output.splitlines() if line.startswith(tag + " "))


@pytest.fixture(scope="module")
def mpi_run(mpirun, script):
    """One np=3 job through mpi4py; MASTER_ADDR/MASTER_PORT first name a port the test holds."""
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        return port, _run(mpirun, 3, script, "mpi", "MASTER_ADDR=127.0.0.1", f"MASTER_PORT={port}")


@pytest.mark.timeout(240)
def test_ranks_topology_and_collectives_come_from_mpi(mpi_run):
    _, output = mpi_run
    threads = "True"  # Debian's Open MPI 4.1 gives mpi4py the MPI_THREAD_MULTIPLE it asks for
    assert _lines(output, "WORLD") == [  # one host: cross rank 0 of 1 for everyone
        f"WORLD True {r} 3 0 1 True True True {threads} 6.0 [0, 1, 1, 2, 2, 2]" for r in range(3)], output


@pytest.mark.timeout(240)
def test_rank_0_that_cannot_listen_fails_every_rank_alike(mpi_run):
    port, output = mpi_run
    expected = (f"BUSY Rank 0 could not open the rendezvous store on 127.0.0.1:{port} (Address already in use); "
                "pass a free port on an address of rank 0's host with mpirun -x MASTER_ADDR=<address> "
                "-x MASTER_PORT=<port>, or leave both unset.")
    assert _lines(output, "BUSY") == [expected] * 3, output


@pytest.mark.timeout(240)
def test_init_takes_mpi_communicators_as_horovod(mpi_run):
    _, output = mpi_run
    # ranks 0 and 2 form one job (2 first: key=-rank), rank 1 a job of its own
    assert _lines(output, "SUB") == ["SUB 0 1 2 1 True 4.0", "SUB 1 0 1 0 True 2.0", "SUB 2 0 2 0 True 4.0"], output
    refused = _lines(output, "REFUSED")
    assert len(refused) == 6, output
    assert sum(line.startswith("REFUSED init(comm=<mpi4py.MPI.Intracomm object at ") and line.endswith(
        "): this process already joined a job of 3 ranks through another communicator; call hvd.shutdown() "
        "before hvd.init(comm=...).") for line in refused) == 3, output
    assert refused.count("REFUSED init(comm='world'): pass None, the list of every rank, or an mpi4py "
                         "communicator such as MPI.COMM_WORLD.") == 3, output
    assert _lines(output, "INTER") == ["INTER init(comm=<inter>) got an intercommunicator; pass an "
                                       "intracommunicator such as MPI.COMM_WORLD, or one made by its Split()."] * 3
    assert _lines(output, "DOWN") == ["DOWN False MPI is not enabled: this process did not join its job through MPI "
                                      "(that needs mpirun and mpi4py: pip install \"sparkhvd[mpi]\"), so there is "
                                      "no MPI threading to ask about; call hvd.mpi_enabled() first."] * 3, output


@pytest.mark.timeout(240)
def test_without_mpi4py_master_addr_and_port_make_the_rendezvous(mpirun, script):
    hide = f"PYTHONPATH={script / 'hide'}"
    output = _run(mpirun, 2, script, "env", hide, "MASTER_ADDR=127.0.0.1", f"MASTER_PORT={_free_port()}")
    # mpi_built: False, as the ranks tried mpi4py and could not import it
    assert _lines(output, "WORLD") == [f"WORLD True {r} 2 0 1 True False False None 3.0 [0, 1, 1]"
                                       for r in range(2)], output


@pytest.mark.timeout(240)
def test_without_mpi4py_or_master_addr_the_error_names_both_fixes(mpirun, script):
    output = _run(mpirun, 1, script, "none", f"PYTHONPATH={script / 'hide'}")
    assert _lines(output, "ERROR") == [
        "ERROR This process was started by Open MPI's mpirun (OMPI_COMM_WORLD_RANK=0, OMPI_COMM_WORLD_SIZE=1), but "
        "mpi4py cannot be used (ImportError: mpi4py is hidden by tests/collective/test_mpirun.py) and MASTER_ADDR/MASTER_PORT "
        "are not both set; install it (pip install \"sparkhvd[mpi]\"), or name a free port on rank 0's host with "
        "mpirun -x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=<port>."], output


def test_launcher_variables_of_open_mpi_and_hydra():
    assert _mpi.launched({}) is None
    assert _mpi.launched({"RANK": "0", "WORLD_SIZE": "2"}) is None  # torchrun's are not MPI's
    ompi = _mpi.launched({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "PMI_RANK": "9", "PMI_SIZE": "9"})
    assert ompi == _mpi.Launch("Open MPI's mpirun", 3, 4, "OMPI_COMM_WORLD_RANK=3, OMPI_COMM_WORLD_SIZE=4")
    hydra = _mpi.launched({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"})
    assert hydra == _mpi.Launch("MPICH's or Intel MPI's mpirun", 1, 2, "PMI_RANK=1, PMI_SIZE=2")


@pytest.mark.unit
@pytest.mark.parametrize("hosts", [["a", "a", "b", "b"], ["a", "b", "a", "b", "c"], ["a", "a", "a"], ["b", "a", "a"]])
def test_placement_splits_as_horovods_mpi_controller(hosts):
    """Where ranks are grouped by host (as the runner assigns them), MPI's placement is the runner's;
    in any order, local and cross ranks count in rank order."""
    placed = [_mpi.place(r, hosts) for r in range(len(hosts))]
    for p in placed:
        same_host = [q.rank for q in placed if hosts[q.rank] == hosts[p.rank]]
        same_local = [q.rank for q in placed if q.local_rank == p.local_rank]
        assert (p.local_rank, p.local_size) == (same_host.index(p.rank), len(same_host))
        assert (p.cross_rank, p.cross_size) == (same_local.index(p.rank), len(same_local))
        assert p.homogeneous == (len({hosts.count(h) for h in hosts}) == 1)
    grouped = sorted(hosts, key=hosts.index)
    assert [_mpi.place(r, grouped) for r in range(len(hosts))] == assign_ranks(grouped)


@pytest.mark.timeout(120)
def test_an_mpi_other_than_the_launchers_is_refused_not_a_job_of_one(mpirun, tmp_path):
    # mpi4py's MPI is not the launcher's: MPI says each process is a job of one, where the launcher said rank 1 of 2
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "PMIX_"))}
    env.update(PMI_RANK="1", PMI_SIZE="2")
    code = "import sparkhvd.collective.torch as hvd\ntry:\n    hvd.init()\nexcept ValueError as exc:\n    print(exc)\n"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=100)
    assert out.stdout.strip() == (
        "MPICH's or Intel MPI's mpirun started this process as rank 1 of 2 (PMI_RANK=1, PMI_SIZE=2), but the MPI "
        "library mpi4py loaded says rank 0 of 1: it is another MPI than the mpirun's, and every rank would train "
        "alone; point mpi4py at the launcher's MPI (MPI4PY_LIBMPI=<its libmpi.so>, or MPI4PY_MPIABI=openmpi or "
        "mpich), or start the job with the mpirun of the MPI mpi4py loads."), out.stdout + out.stderr


def test_the_store_never_listens_on_loopback_for_ranks_on_several_hosts():
    assert _mpi.reachable("localhost", multi_node=False) == "localhost"  # one host: loopback is right
    with pytest.raises(ValueError, match=r"^the rendezvous store would listen on localhost \(127\.0\.0\.1\), a "
                                         r"loopback address, but this job's ranks span several hosts, which cannot "
                                         r"reach it there; pass rank 0's address on the network the hosts share "
                                         r"with mpirun -x MASTER_ADDR=<address>\.$"):
        _mpi.reachable("localhost", multi_node=True)
    with pytest.raises(ValueError, match=r"^the rendezvous store's host 'no-such-host\.invalid' does not resolve "
                                         r"here \(.+\); pass an address of rank 0's host with mpirun "
                                         r"-x MASTER_ADDR=<address>\.$"):
        _mpi.reachable("no-such-host.invalid", multi_node=False)
