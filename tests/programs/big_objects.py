"""Objects over 2 GiB through broadcast_object_list and send/recv_object_list (2 ranks)."""
import gc

import spmd

spmd.init_process_group()
rank = spmd.get_rank()
SIZE = 2**31 + 4099  # just past what a 32-bit MPI count can describe in bytes

objs = [b"\x07" * SIZE, "tail"] if rank == 0 else [None, None]
spmd.broadcast_object_list(objs, src=0)
assert len(objs[0]) == SIZE and objs[0][:3] == b"\x07\x07\x07" and objs[0][-1:] == b"\x07"
assert objs[1] == "tail"
del objs
gc.collect()

if rank == 1:
    spmd.send_object_list([bytearray(b"\x05") * SIZE], dst=0)
elif rank == 0:
    got = [None]
    assert spmd.recv_object_list(got, src=1) == 1
    assert len(got[0]) == SIZE and got[0][-1] == 5
print(f"rank {rank} big objects OK", flush=True)
spmd.destroy_process_group()
