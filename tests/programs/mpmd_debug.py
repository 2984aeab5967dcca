"""Debug mode over an MPMD link: mismatched link broadcasts end in
CollectiveMismatchError on every rank of both programs, matched ones pass.

    SPMD_DEBUG=DETAIL mpiexec -n L python tests/programs/mpmd_debug.py left : \
        -n R python tests/programs/mpmd_debug.py right

World rank 0 prints every rank's outcome, one line each ("rank W CASE: ...")."""
import sys

import numpy as np

import spmd

me = sys.argv[1]
other = "right" if me == "left" else "left"
spmd.init_process_group()
assert spmd.get_debug_level() == spmd.DebugLevel.DETAIL
world = spmd.get_rank()
group = spmd.init_program(me)
link = spmd.new_link(other)
last_right = me == "right" and link.rank() == link.size() - 1
outcomes = []


def case(name, call):
    try:
        call()
    except spmd.CollectiveMismatchError as exc:
        outcomes.append(f"rank {world} {name}: " + str(exc).replace("\n", " |"))
    else:
        outcomes.append(f"rank {world} {name}: NO ERROR")
    # the link is still in step: a matched broadcast from left's rank 0
    got = link.broadcast_object("step" if me == "left" else None, src=0, src_program="left")
    assert got == "step", got


x = np.arange(3.0)
case("shape", lambda: link.broadcast(np.zeros(4) if last_right else x.copy(), 0, "left"))
case("src_program", lambda: link.broadcast(x.copy(), 0, me))  # each side thinks it sends
case("op", lambda: link.broadcast(x.copy(), 0, "left") if me == "left"
     else link.broadcast_object(None, 0, "left"))
# matched calls pass and deliver
y = np.arange(3.0) * 7 if me == "left" else np.zeros(3)
link.broadcast(y, src=0, src_program="left")
got = link.broadcast_object({"from": me} if me == "right" else None, src=0, src_program="right")
ok = (y == np.arange(3.0) * 7).all() and (me == "right" or got == {"from": "right"})
outcomes.append(f"rank {world} matched: {'OK' if ok else 'WRONG'}")
everyone = [None] * spmd.get_world_size()
spmd.all_gather_object(everyone, outcomes)
if world == 0:
    print("\n".join(line for lines in everyone for line in lines), flush=True)
link.free()
spmd.destroy_process_group()
