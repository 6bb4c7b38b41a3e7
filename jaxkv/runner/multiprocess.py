"""Multi-process engines: one engine over the devices of several processes (jax.distributed).

A model too large for one host's devices runs tensor-parallel over the devices of every
process (one process per host on a cluster): the mesh of jaxkv/models/sharding.py spans them
all, so each process holds its slice of the weights and of the KV pool, and XLA's collectives
(gloo between CPU processes, NCCL between GPUs) join the slices inside the jitted step.

Process 0, the leader, runs the scheduler, the engine loop and the server. Every other process,
a follower, runs the same jitted programs in the same order: before each step the leader
sends that step's SchedulerOutput and token bucket through a JAX collective
(`jax.experimental.multihost_utils.broadcast_one_to_all`: a header with the size, then the
pickled bytes padded to a power of two, so a handful of broadcast programs serve every step),
and each follower runs `ModelRunner.execute` on it, discarding the sampled tokens the leader
keeps. The leader sends a heartbeat when idle (so no follower waits in a collective for
long) and a stop at exit, after which the followers leave jax.distributed and exit with status
0. As in JAX's own multi-controller model, the same script or command runs on every process;
only process 0's returns results.

The messages are pickles between the processes of one job (the trust of the job itself);
nothing else listens.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import socket
import threading
import time

import numpy as np

from jaxkv.runner.buckets import pow2_at_least

logger = logging.getLogger("jaxkv")

STEP, HEARTBEAT, STOP, CONFIG, RECOVER = "step", "heartbeat", "stop", "config", "recover"
_built = False  # whether this process built its multi-process engine already
HEARTBEAT_S = 10.0  # the leader's idle heartbeat period


def wanted(args) -> bool:
    """Whether EngineArgs ask for a multi-process engine: num_processes > 1, a coordinator or a
    process id given, or JAX's coordinator environment variable set."""
    return bool((args.num_processes or 1) > 1 or args.distributed_coordinator
                or args.process_id is not None or os.environ.get("JAX_COORDINATOR_ADDRESS"))


def _wait_for_coordinator(address: str, timeout: float) -> None:
    """Block until something listens at HOST:PORT; ConnectionError in one line after `timeout`
    seconds. (JAX aborts the process when the coordinator never answers; this check turns
    that into an error the caller can read.)"""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ConnectionError(f"distributed_coordinator {address} unreachable within "
                                   f"distributed_timeout {timeout:g} s ({e.strerror or e})") from None
            time.sleep(0.25)


def initialize(args) -> None:
    """Join the job (jax.distributed.initialize) before JAX starts its backends: the flags
    first, then JAX's environment (JAX_COORDINATOR_ADDRESS, or a SLURM / Open MPI / Kubernetes
    job). CPU processes use gloo collectives. A follower that cannot reach the coordinator
    within distributed_timeout seconds gets a one-line ConnectionError."""
    import jax
    if jax.distributed.is_initialized():  # `jaxkv serve` joins before its engine is built
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    address = args.distributed_coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if not address and (args.num_processes is not None or args.process_id is not None):
        raise ValueError("num_processes / process_id need distributed_coordinator HOST:PORT (or "
                         "JAX_COORDINATOR_ADDRESS): process 0's address, where the others join")
    t0 = time.monotonic()
    if address and args.process_id:  # process 0 hosts the coordinator itself
        _wait_for_coordinator(address, args.distributed_timeout)
    left = max(1, int(args.distributed_timeout - (time.monotonic() - t0)))
    jax.distributed.initialize(address, args.num_processes, args.process_id,
                               initialization_timeout=left)
    logger.info("process %d of %d (coordinator %s): %d devices, %d local", jax.process_index(),
                jax.process_count(), address or "from the environment", jax.device_count(),
                jax.local_device_count())


def check_mesh(tensor_parallel_size: int) -> None:
    """ValueError in one line unless the mesh spans every device of every process."""
    import jax
    if jax.process_count() > 1 and jax.local_device_count() * jax.process_count() != jax.device_count():
        raise ValueError(f"every process of a multi-process engine needs the same number of "
                         f"devices (this one has {jax.local_device_count()}, all "
                         f"{jax.process_count()} have {jax.device_count()})")
    if jax.process_count() > 1 and tensor_parallel_size != jax.device_count():
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size} must equal the devices of "
                         f"all {jax.process_count()} processes ({jax.device_count()}): a "
                         "multi-process engine splits the model over all of them")


class Channel:
    """Leader-to-followers messages over JAX's broadcast collective. Every process must call
    send (the leader) or receive (the others) the same number of times, in the same order."""

    def send(self, msg) -> None:
        from jax.experimental import multihost_utils as mhu
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        mhu.broadcast_one_to_all(np.array([len(data)], np.int32))
        mhu.broadcast_one_to_all(np.frombuffer(data.ljust(pow2_at_least(len(data), 256), b"\0"), np.uint8))

    def receive(self):
        from jax.experimental import multihost_utils as mhu
        n = int(mhu.broadcast_one_to_all(np.zeros(1, np.int32))[0])
        buf = mhu.broadcast_one_to_all(np.zeros(pow2_at_least(n, 256), np.uint8))
        return pickle.loads(np.asarray(buf)[:n].tobytes())


def share_config(config, channel: Channel | None = None):
    """The leader's resolved EngineConfig, on every process (KV pool size included: hosts
    with different memory must still build the same pool). ValueError for a second engine in
    the same job: its processes serve one engine, for their lifetime."""
    global _built
    import jax
    if _built:
        raise ValueError("a multi-process engine exists in this process already: one engine per "
                         "job (its followers serve it until it stops)")
    _built = True
    channel = channel or Channel()
    if jax.process_index() == 0:
        channel.send((CONFIG, config))
        return config
    kind, config = channel.receive()
    assert kind == CONFIG, kind
    return config


class Leader:
    """Process 0's side: `run(out, bucket, fn)` sends the step, then runs it (`fn()`), under
    one lock with the idle heartbeat, so every process dispatches the same programs in the
    same order. `start()` begins the idle heartbeat once the leader has warmed up (the
    ModelRunner holds the leader from its construction; build_engine starts it after warmup);
    `stop()` (also at interpreter exit) releases the followers."""

    def __init__(self, channel: Channel | None = None, heartbeat_s: float = HEARTBEAT_S):
        self.channel = channel or Channel()
        self.lock = threading.Lock()
        self.last = time.monotonic()
        self.stopped = False
        self.heartbeat_s = heartbeat_s
        self._started = False

    def start(self) -> Leader:
        """Start the idle heartbeat (a daemon thread) and the stop at interpreter exit; once."""
        if not self._started:
            self._started = True
            self.last = time.monotonic()
            threading.Thread(target=self._heartbeat, name="jaxkv-heartbeat", daemon=True).start()
            atexit.register(self._at_exit)
        return self

    def run(self, out, bucket: int, fn):
        with self.lock:
            if self.stopped:
                raise RuntimeError("the multi-process engine was stopped; its followers are gone")
            self.channel.send((STEP, (out, bucket)))
            try:
                return fn()
            finally:
                self.last = time.monotonic()

    def recovered(self) -> None:
        """The leader's step failed and its pool was checked (ModelRunner.recover_kv_cache):
        tell the followers, whose same step failed too, to do the same."""
        with self.lock:
            if not self.stopped:
                self.channel.send((RECOVER, None))
                self.last = time.monotonic()

    def _heartbeat(self) -> None:
        while True:
            time.sleep(self.heartbeat_s / 4)
            with self.lock:
                if self.stopped:
                    return
                if time.monotonic() - self.last >= self.heartbeat_s:
                    self.channel.send((HEARTBEAT, None))
                    self.last = time.monotonic()

    def stop(self) -> None:
        """Send the followers their stop (once); later steps raise."""
        with self.lock:
            if self.stopped:
                return
            self.stopped = True
            self.channel.send((STOP, None))
        logger.info("multi-process engine stopped; followers released")

    def _at_exit(self) -> None:
        import jax
        self.stop()
        jax.distributed.shutdown()  # waits for the followers to leave too


def follow(runner, channel: Channel | None = None) -> int:
    """A follower's loop: run every step the leader sends, until its stop. Returns the steps
    run. A step that fails on the leader is followed by its RECOVER, and the follower checks its
    pool as the leader did; a step that failed here while the leader's ran (this host's own
    trouble) makes the follower stop with an error, rather than hold shards the engine no
    longer matches."""
    import jax
    channel = channel or Channel()
    logger.info("process %d follows process 0's steps", jax.process_index())
    steps, failed = 0, None
    while True:
        kind, body = channel.receive()
        if failed is not None and kind != RECOVER:  # the leader's step ran: ours alone failed
            raise RuntimeError(f"process {jax.process_index()}: a step failed here but not on "
                               f"process 0 ({failed}); this process's KV shards are no longer "
                               "the engine's, so it stops") from failed
        if kind == STOP:
            break
        if kind == RECOVER:  # the leader's step failed: check our pool as it did
            runner.recover_kv_cache()
            failed = None
        elif kind == STEP:
            out, bucket = body
            try:
                runner.execute(out, bucket=bucket)
            except Exception as e:  # noqa: BLE001 - the leader's RECOVER must follow
                logger.warning("a step failed on this follower: %s", e)
                failed = e
            steps += 1
    logger.info("process %d: process 0 stopped after %d steps; leaving", jax.process_index(), steps)
    return steps
