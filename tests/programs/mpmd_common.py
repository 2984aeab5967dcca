"""What both programs of the two-script MPMD job check (imported by mpmd_left/right.py).

Each program knows only its own name; the other's size and ranks come from the job.
Prints ``<name> R/N mpmd OK`` per rank; any failure aborts the whole job.
"""

import sys
import traceback

import numpy as np
from mpi4py import MPI

import spmd
from spmd.layouts import mpmd


def check(me: str, other: str) -> str:
    spmd.init_process_group()
    world, n = spmd.get_rank(), spmd.get_world_size()
    appnum = MPI.COMM_WORLD.Get_attr(MPI.APPNUM)
    # Hydra's "a : b" sets MPI_APPNUM: the programs are found without names ...
    by_app = spmd.init_program()
    if appnum is not None:
        assert mpmd.get_program().name == f"app{appnum}"
        assert [p.name for p in spmd.get_programs()] == ["app0", "app1"]
    # ... and names work under every launcher; both ways give the same groups.
    group = spmd.init_program(me)
    assert group.ranks == list(by_app.ranks) or appnum is None
    progs = {p.name: p for p in spmd.get_programs()}
    assert sorted(progs) == ["left", "right"] and sum(p.size for p in progs.values()) == n
    left, right = progs["left"], progs["right"]
    assert left.ranks == tuple(range(left.size))  # "a : b" puts a's ranks first
    assert right.ranks == tuple(range(left.size, n)) and world in progs[me].ranks
    r, size = group.rank(), group.size()
    assert progs[me].ranks[r] == world

    # Collectives inside one program do not involve the other.
    x = np.array([world], np.int64)
    spmd.all_reduce(x, group=group)
    assert x[0] == sum(progs[me].ranks)

    link = spmd.new_link(other)
    remote = link.remote_size()
    assert remote == progs[other].size and link.rank() == r

    # Ring across the programs: rank r sends to remote rank r % remote, receives from any.
    sends = [link.isend(np.array([world, r], np.int64), dst=r % remote, tag=1)]
    expected = sorted(q for q in range(remote) if q % size == r)
    got = []
    for _ in expected:
        box = np.zeros(2, np.int64)
        got.append(link.recv(box, tag=1))
        assert box[0] == progs[other].ranks[box[1]]
    assert sorted(got) == expected
    for w in sends:
        w.wait()

    # Broadcast of an array and an object from each program's last rank.
    for src_prog in ("left", "right"):
        src = progs[src_prog].size - 1
        data = np.zeros(4)
        if me == src_prog and r == src:
            data[:] = [1.5, 2.5, 3.5, 4.5]
        link.broadcast(data, src=src, src_program=src_prog)
        if me != src_prog:
            assert data.tolist() == [1.5, 2.5, 3.5, 4.5]
        obj = link.broadcast_object({"from": src_prog, "ranks": progs[src_prog].ranks}
                                    if me == src_prog else None, src=src, src_program=src_prog)
        assert obj == {"from": src_prog, "ranks": progs[src_prog].ranks}

    # Objects point to point between the two leaders.
    if r == 0:
        if me == "left":
            link.send_object({"sender": me, "size": size}, dst=0)
        assert link.recv_object(src=0) == {"sender": other, "size": remote}
        if me == "right":
            link.send_object({"sender": me, "size": size}, dst=0)

    # The same name in both programs is refused on every rank (Hydra sets APPNUM).
    if appnum is not None:
        try:
            spmd.init_program("same")
        except ValueError as exc:
            assert "used by the programs started as MPI_APPNUM 0 and 1" in str(exc)
        else:
            raise AssertionError("init_program('same') in both programs was accepted")
    link.free()
    spmd.destroy_process_group()
    return f"{me} {r}/{size} mpmd OK"


def main(me: str, other: str) -> None:
    try:
        line = check(me, other)
    except BaseException:  # noqa: BLE001 - a failed rank must not leave the others waiting
        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
