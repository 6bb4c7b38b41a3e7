"""The disk tier of the KV cache: full KV blocks in files, kept across restarts.

Plain Python and numpy, no JAX. Every block the host tier takes (jaxkv/core/host_tier.py)
is written through to a file here, one file per block named by its block hash, so the disk
keeps it after the host tier evicts it and across restarts; a prefix lookup that misses on
the device and in host memory continues here, and the block is read back into a free device
block. The directory `kv_cache_disk_dir` holds one folder per model identity (weights
fingerprint, dtype, KV dtype, block size, layer and head shape: `identity_key`), so another
model or dtype never reads a block it did not write. The files are LRU within
`kv_cache_disk_bytes` (by modification time across restarts).

Crash safety: a block is written to a temporary name and renamed (atomic on POSIX), so a
half-written block never has a block's name; each file ends with the CRC-32 of its contents
and a magic tag, and its size is checked at lookup and its CRC at read, so a truncated or
damaged file is dropped and its block computed again.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from collections import OrderedDict

import numpy as np

from .block_pool import BlockHash

MAGIC = b"JKV1"
SUFFIX = ".kvb"
TRAILER = struct.Struct("<I4s")  # crc32 of the contents, MAGIC


class CorruptBlockError(OSError):
    """A block file whose size or CRC does not match (it has been deleted)."""


def fingerprint_files(path: str) -> str:
    """A fingerprint of a checkpoint (a file or a folder): each file's relative name, size and
    modification time, and SHA-256 of its first and last MiB and of 64 KiB at 32 evenly spaced
    offsets. Cheap at any model size; a copy elsewhere or a rewrite in place (a new mtime)
    changes it, so a block is never read for weights other than those that wrote it."""
    h = hashlib.sha256()
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)
    for f in files:
        st = os.stat(f)
        h.update(f"{os.path.relpath(f, os.path.dirname(path))}:{st.st_size}:{st.st_mtime_ns}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            for i in range(1, 33):
                fh.seek(st.st_size * i // 33)
                h.update(fh.read(1 << 16))
            if st.st_size > 2 << 20:
                fh.seek(-(1 << 20), os.SEEK_END)
                h.update(fh.read())
    return h.hexdigest()[:32]


def identity_key(identity: dict) -> str:
    """The folder name of a model identity: SHA-256 of its fields, as sorted JSON."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]


def write_block(path: str, arrays) -> None:
    """Write one block (its arrays' bytes in order, then the trailer) atomically."""
    data = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.write(TRAILER.pack(zlib.crc32(data), MAGIC))
    os.replace(tmp, path)


def read_block(path: str, like) -> list[np.ndarray]:
    """Read a block written by write_block into arrays shaped and typed as `like`.
    CorruptBlockError (after deleting the file) when its size, CRC or tag do not match."""
    n = sum(a.nbytes for a in like)
    with open(path, "rb") as f:
        raw = f.read()
    ok = len(raw) == n + TRAILER.size
    if ok:
        crc, magic = TRAILER.unpack(raw[n:])
        ok = magic == MAGIC and crc == zlib.crc32(raw[:n])
    if not ok:
        try:
            os.unlink(path)
        except OSError:
            pass
        raise CorruptBlockError(f"KV block file {os.path.basename(path)} is damaged; deleted")
    out, off = [], 0
    for a in like:
        out.append(np.frombuffer(raw, a.dtype, a.size, off).reshape(a.shape))
        off += a.nbytes
    return out


def _pid_alive(name: str) -> bool:
    """Whether the process that named a temporary file NAME.PID.tmp still runs."""
    try:
        pid = int(name.rsplit(".", 2)[-2])
        os.kill(pid, 0)
    except (ValueError, IndexError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


class DiskTier:
    """Index of the block files of one model identity under `root`; `capacity_bytes` bounds
    the whole of `root` (every identity's files): files of other identities (another model or
    dtype) are evicted first, oldest first, then this identity's least recently used. Hits
    refresh a file's modification time, so the order survives restarts. `block_nbytes`: one
    block's bytes (all layers, K and V, scales). Errors: ValueError naming kv_cache_disk_dir
    when it cannot be created or written, and naming kv_cache_disk_bytes when it holds no
    block."""

    def __init__(self, root: str, capacity_bytes: int, block_nbytes: int, identity: dict):
        self.file_size = block_nbytes + TRAILER.size
        self.capacity = capacity_bytes
        if capacity_bytes < self.file_size:
            raise ValueError(f"kv_cache_disk_bytes {capacity_bytes} holds no block (one block is "
                             f"{self.file_size} bytes)")
        self.dir = os.path.join(root, identity_key(identity))
        try:
            os.makedirs(self.dir, exist_ok=True)
            probe = os.path.join(self.dir, f".probe.{os.getpid()}")
            with open(probe, "w") as f:
                json.dump(identity, f)
            os.replace(probe, os.path.join(self.dir, "identity.json"))
        except OSError as e:
            raise ValueError(f"kv_cache_disk_dir {root!r} is not writable: {e.strerror or e}") from None
        self.entries: OrderedDict[str, None] = OrderedDict()  # least recently used first
        found, others = [], []
        for sub in os.listdir(root):
            d = os.path.join(root, sub)
            if not os.path.isdir(d):
                continue
            for f in os.listdir(d):
                p = os.path.join(d, f)
                if f.endswith(".tmp"):  # a write cut short by a crash or a kill
                    if not _pid_alive(f):
                        self._unlink(p)
                    continue
                if not f.endswith(SUFFIX):
                    continue
                try:
                    st = os.stat(p)
                except OSError:
                    continue
                if d != self.dir:
                    others.append((st.st_mtime, p, st.st_size))
                elif st.st_size == self.file_size:
                    found.append((st.st_mtime, f[:-len(SUFFIX)]))
                else:
                    self._unlink(p)
        for _, name in sorted(found):
            self.entries[name] = None
        self.others = sorted(others)  # other identities' files, oldest first
        self.others_bytes = sum(x[2] for x in others)
        self.busy: set[str] = set()
        self.added_this_step: list[str] = []
        self.num_stored = self.num_loaded = self.num_evicted = 0
        self._trim()

    @property
    def max_blocks(self) -> int:
        """This identity's capacity in blocks (the budget less other identities' files)."""
        return max(1, (self.capacity - self.others_bytes) // self.file_size)

    @staticmethod
    def _unlink(p: str) -> None:
        try:
            os.unlink(p)
        except OSError:
            pass

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name + SUFFIX)

    @property
    def num_used(self) -> int:
        return len(self.entries)

    def begin_step(self) -> None:
        self.busy = set()
        self.added_this_step = []

    def undo_step(self) -> None:
        """The step did not run: forget the files it added that were not written."""
        for name in self.added_this_step:
            if name in self.entries and not os.path.exists(self.path(name)):
                del self.entries[name]
        self.added_this_step = []

    def lookup(self, h: BlockHash) -> bool:
        """Whether block `h` has a whole file here (a missing or short one is dropped)."""
        name = h.hex()
        if name not in self.entries:
            return False
        try:
            ok = os.path.getsize(self.path(name)) == self.file_size
        except OSError:
            ok = False
        if not ok:
            del self.entries[name]
            self._unlink(self.path(name))
            return False
        self.entries.move_to_end(name)
        try:
            os.utime(self.path(name))  # the LRU order across restarts
        except OSError:
            pass
        return True

    def load(self, h: BlockHash) -> str:
        """Block `h` is read into the device this step: its file name, kept until then."""
        name = h.hex()
        self.busy.add(name)
        self.num_loaded += 1
        return name

    def add(self, h: BlockHash) -> str | None:
        """Block `h` will be written this step: its file name (None when already here)."""
        name = h.hex()
        if name in self.entries:
            self.entries.move_to_end(name)
            return None
        self.entries[name] = None
        self.busy.add(name)
        self.added_this_step.append(name)
        self.num_stored += 1
        self._trim()
        return name

    def _trim(self) -> None:
        while len(self.entries) * self.file_size + self.others_bytes > self.capacity:
            if self.others:  # another identity's oldest file goes first
                _, p, size = self.others.pop(0)
                self._unlink(p)
                self.others_bytes -= size
                continue
            victim = next((n for n in self.entries if n not in self.busy), None)
            if victim is None:
                return
            del self.entries[victim]
            self._unlink(self.path(victim))
            self.num_evicted += 1
