"""
dist.py: the process group and the collectives dapo.py runs on, on one process or many (torchrun), and what
vLLM's TP groups leave on the machine: their shared memory and IPC sockets.
"""

import atexit
import contextlib
import os
import re
import shutil
import tempfile

import torch


def rank():
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def world():
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def compute_device():
    return torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")


def full_tensor(t):
    """The whole tensor behind an FSDP2 shard (a collective), or t itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def print0(*a, **k):
    if rank() == 0:
        print(*a, **k, flush=True)


def init_distributed(timeout_min=180.0):
    """torchrun sets RANK/WORLD_SIZE/...; plain `python dapo.py` becomes a world of one. The timeout
    bounds every collective of this group; vLLM's own TP groups keep torch's (they run in lockstep)."""
    from datetime import timedelta
    if torch.distributed.is_initialized():  # a caller's own (tools/gpu_check.py runs train() twice in one)
        return compute_device()
    if "RANK" not in os.environ:  # vLLM's external_launcher reads these too
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    backend, device = "gloo", None
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"
    # device_id forms this group's NCCL communicator now, before vLLM starts: --deterministic's batch-invariant
    # mode pins NCCL to one channel and the Simple protocol for every communicator formed after its engine starts
    # (vLLM's batch_invariant.py), which would slow FSDP's gathers; lazily, ours would be formed after it
    torch.distributed.init_process_group(backend, timeout=timedelta(minutes=timeout_min), device_id=device)
    return compute_device()


def all_gather_objects(obj):
    """Every rank's obj, and the bytes this rank received (each pickle is padded to the largest)."""
    import pickle
    if not torch.distributed.is_initialized():  # one process, no group (the tests of the maths)
        return [obj], 0
    out = [None] * world()
    torch.distributed.all_gather_object(out, obj)
    return out, (world() - 1) * (max(len(pickle.dumps(o)) for o in out) + 8)


def all_to_all_objects(outgoing):
    """outgoing[r] goes to rank r. Returns what each rank sent to this one, and the bytes received.
    Pickles travel as CPU byte tensors (gloo on a cpu:gloo,cuda:nccl group), sizes first."""
    import pickle
    blobs = [pickle.dumps(o) for o in outgoing]
    sizes = torch.tensor([len(b) for b in blobs])
    in_sizes = torch.empty_like(sizes)
    torch.distributed.all_to_all_single(in_sizes, sizes)
    data = torch.empty(int(in_sizes.sum()), dtype=torch.uint8)
    sent = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8)
    torch.distributed.all_to_all_single(data, sent, in_sizes.tolist(), sizes.tolist())
    nbytes = sum(in_sizes.tolist()) - in_sizes[rank()].item() + 8 * (world() - 1)
    return [pickle.loads(p.numpy().tobytes()) for p in data.split(in_sizes.tolist())], nbytes


STALE_SHM = (": an earlier TP run that ended before removing them (killed while it started, or an older "
             "dapo.py) left vLLM's shared memory in /dev/shm: if no other vLLM runs here, "
             "rm /dev/shm/-tp:*-cpushm_*")


def unlink_group_shm(pattern=r"-cpushm_\d+"):
    """Unlink the /dev/shm files this process has mapped whose names end in pattern; the memory lives on
    until the last process that mapped it exits. vLLM's CPU TP group shares memory through files whose names
    are the same in every run (external_launcher), unlinked by a C++ static destructor that os._exit, a kill
    or a crash skips, and the next TP run on the machine could not create them: once the engine is up every
    rank has mapped all of its group's files, so their names can go. On Ctrl-C (pattern "") the TP group's
    broadcast queue (24 MiB in vLLM 0.32) goes too, which os._exit would leave."""
    paths = set()
    with contextlib.suppress(OSError), open("/proc/self/maps") as f:  # Linux; an unlinked file: " (deleted)"
        paths = {line.split(None, 5)[5].strip() for line in f if re.search(rf"/dev/shm/\S*{pattern}$", line)}
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


OWN_IPC_DIRS = []  # made by own_ipc_dir, removed by remove_own_ipc_dirs


def own_ipc_dir():
    """vLLM's ZMQ IPC sockets (a TP group's broadcast queue) in a directory of this process's own, removed
    at its exit (exit_now's and Ctrl-C's too): in /tmp, where vLLM binds them, os._exit would leave them."""
    if "VLLM_RPC_BASE_PATH" not in os.environ:
        OWN_IPC_DIRS.append(tempfile.mkdtemp(prefix="dapo-"))  # short: a socket's path holds <= 107 bytes
        os.environ["VLLM_RPC_BASE_PATH"] = OWN_IPC_DIRS[-1]
        atexit.register(remove_own_ipc_dirs)


def remove_own_ipc_dirs():
    for path in OWN_IPC_DIRS:
        shutil.rmtree(path, ignore_errors=True)
