"""Independent simulations fanned out: in this process, or as Ray tasks on a local Ray
instance or an existing Ray cluster. Results come back in submission order, so a sweep
gives the same numbers whatever runs it."""

from __future__ import annotations

import os
import socket
import sys
from typing import Callable, Sequence

from tqdm import tqdm

from envs.errors import ConfigError, catch_sigterm, integer, show

MAX_CLUSTER_WORKERS = 4096


class LocalExecutor:
    """Runs every task here, one after another (``--workers 1``)."""

    workers = 1

    def map(self, fn: Callable, tasks: Sequence[tuple], progress=None) -> list:
        out = []
        for args in tasks:
            out.append(fn(*args))
            if progress is not None:
                progress.update(1)
        return out


class RayExecutor:
    """Runs tasks as Ray tasks: a local Ray instance with ``workers`` CPUs, or the cluster
    at ``address`` (``auto``, ``HOST:PORT`` or ``ray://HOST:10001``)."""

    def __init__(self, workers: int | None = None, address: str | None = None):
        if address:
            check_reachable(address)
        import ray  # heavy (seconds to start) and optional: --workers 1 runs without it

        self.ray = ray
        if not ray.is_initialized():
            kwargs = dict(include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                          configure_logging=True)
            try:
                if address:
                    ray.init(address=address, **kwargs)
                else:
                    ray.init(num_cpus=workers, **kwargs)
            except (ConnectionError, RuntimeError, ValueError) as err:
                where = f"the Ray cluster at {address!r}" if address else "a local Ray instance"
                msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise ConfigError(f"ray_address: cannot start or reach {where} ({msg})") from None
            catch_sigterm()  # ray.init takes SIGTERM over
        self.workers = int(ray.cluster_resources().get("CPU", workers or 1))
        self._remote: dict[Callable, object] = {}

    def map(self, fn: Callable, tasks: Sequence[tuple], progress=None) -> list:
        ray = self.ray
        remote = self._remote.get(fn)
        if remote is None:
            remote = self._remote[fn] = ray.remote(num_cpus=1)(fn)
        refs = [remote.remote(*args) for args in tasks]
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=min(len(pending), 8), timeout=0.5)
            if progress is not None and ready:
                progress.update(len(ready))
        return ray.get(refs)


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast on a cluster address nothing answers at (Ray itself retries for a minute).
    ``auto`` is left to Ray, which finds a local cluster or says there is none."""
    if address == "auto":
        return
    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"ray_address: got {show(address)}, must be auto, HOST:PORT or "
                          "ray://HOST:PORT")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as err:
        raise ConfigError(f"ray_address: cannot reach the Ray cluster at {address!r} "
                          f"({err.strerror or err})") from None


def make_executor(workers: int | None = None, address: str | None = None):
    """``workers`` 1 without an address runs in this process; otherwise Ray (local with
    ``workers`` CPUs, default all cores; or the cluster at ``address``)."""
    if workers is not None:
        # A local Ray instance starts a process per CPU it is given: beyond a few per core
        # they only queue and take memory.
        most = MAX_CLUSTER_WORKERS if address else 4 * (os.cpu_count() or 1)
        integer("workers", workers, 1, most, "1 runs in this process; at most 4 per core of this "
                "machine, or 4096 on a Ray cluster")
    if address is None and (workers or os.cpu_count() or 1) == 1:
        return LocalExecutor()
    return RayExecutor(workers or os.cpu_count() or 1, address)


def progress_bar(total: int, desc: str, unit: str = "sim"):
    """``unit``s (simulations) done / total on stderr (only on a terminal)."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False,
                disable=not sys.stderr.isatty())
