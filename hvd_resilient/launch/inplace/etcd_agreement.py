"""Generations agreed through etcd: one agent per host reports, one leads, generations are
published by compare-and-swap. etcd (Raft) does the agreeing; nothing here is a consensus
protocol of its own, only keys, leases and single transactions.

Keys live under ``/hvd_resilient/<job>/``: ``hosts/<host>`` (a host's report, on its lease),
``leader`` (the host index that decides, on its lease), ``gen`` (the newest generation number)
and ``gen/<g>`` (that generation's record, a string the caller made).

The client is `etcd3gw` (etcd's v3 JSON gateway over `requests`): one `Etcd3Client` per
endpoint, tried in turn from the one that answered last, each request bounded by a short
timeout, so a dead member costs one refused connection (or one timeout) and not the call.
etcd3gw works against etcd 3.4 as it is; its `Lease.ttl()` alone is not used (it fails when
the remaining TTL rounds down to 0, a field the gateway then leaves out).
"""

from __future__ import annotations

import base64
import math
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import requests
from etcd3gw.client import Etcd3Client
from etcd3gw.exceptions import (
    ConnectionFailedError,
    ConnectionTimeoutError,
    Etcd3Exception,
    InternalServerError,
)
from etcd3gw.lease import Lease

from hvd_resilient.errors import RESTARTABLE_EXIT_CODE, HvdResilientError

T = TypeVar("T")

_MEMBER_DOWN = (ConnectionFailedError, ConnectionTimeoutError, InternalServerError,
                requests.RequestException)
"""What says "this member did not answer" (refused, timed out, 5xx, cut off mid-reply): the
next endpoint is tried. Any other etcd error is an answer, and is the caller's to judge."""
_PASS_PAUSE_S = 0.05


class AgreementUnavailable(HvdResilientError):
    """etcd cannot be reached: every endpoint failed, pass after pass, for one TTL. This host
    cannot tell whether its lease still holds, and the TTL has passed, so it must assume it
    does not and stop its workers. A restart may cure it (etcd back, or its network)."""

    exit_code = RESTARTABLE_EXIT_CODE


class LeaseLost(HvdResilientError):
    """A write under this host's lease found the lease gone (expired or revoked): the other
    hosts already count this host out, so it must stop its workers and `start()` again."""

    exit_code = RESTARTABLE_EXIT_CODE


def _b64(text: str) -> str:
    """The gateway carries keys and values as base64 of their bytes (UTF-8 here)."""
    return base64.b64encode(text.encode()).decode()


def _lease_gone(e: Etcd3Exception) -> bool:
    return "lease not found" in (e.detail_text or "")


class EtcdAgreement:
    """One host's view of the agreement. Its methods are safe to call from several threads,
    one request at a time; a call takes at most about ttl + request_timeout_s, then raises
    AgreementUnavailable."""

    def __init__(self, endpoints: list[str], job: str, host: int, *, ttl_s: float = 2.0,
                 request_timeout_s: float = 0.5) -> None:
        """`ttl_s` is rounded up to whole seconds (etcd's unit), and etcd raises it to its own
        minimum (1.5 election timeouts, rounded up); `request_timeout_s` bounds each request
        to one member, so the failover to the next member is that quick."""
        if not endpoints:
            raise ValueError("EtcdAgreement needs at least one etcd endpoint")
        if not job.isascii() or "/" in job or not job:
            raise ValueError(f"job must be a non-empty ASCII name without '/': {job!r}")
        self.host = host
        self.ttl = max(1, math.ceil(ttl_s))
        self.prefix = f"/hvd_resilient/{job}/"
        self._clients = [_client(url, request_timeout_s) for url in endpoints]
        self._current = 0  # the endpoint that answered last: tried first
        self._lock = threading.Lock()
        self._lease: Lease | None = None

    def _call(self, op: Callable[[Etcd3Client], T]) -> T:
        """`op` on the first member that answers, in endpoint order from the last that did.

        Passes over the endpoints go on for one TTL: a member that lost the Raft leader answers
        nothing until the others elect a new one (up to two election timeouts), and waiting
        longer than a TTL cannot help, since this host's lease would be gone by then."""
        with self._lock:
            deadline = time.monotonic() + self.ttl
            n, errors = len(self._clients), {}
            while True:
                for k in range(n):
                    i = (self._current + k) % n
                    try:
                        result = op(self._clients[i])
                    except _MEMBER_DOWN as e:
                        errors[self._clients[i].base_url] = type(e).__name__
                        continue
                    self._current = i
                    return result
                if time.monotonic() >= deadline:
                    detail = "; ".join(f"{url}: {err}" for url, err in errors.items())
                    raise AgreementUnavailable(
                        f"no etcd endpoint answered for {self.ttl} s ({detail})")
                time.sleep(_PASS_PAUSE_S)  # every member refused at once: do not spin

    def start(self) -> None:
        """Grants this host a fresh lease: every key it writes dies with it, so a host that
        stops renewing (dead, frozen, cut off) vanishes from the agreement by itself."""
        self._lease = self._call(lambda c: c.lease(self.ttl))

    def renew(self) -> bool:
        """One keepalive. False once the lease is gone (expired or revoked): the others have
        already counted this host out, so it must stop its workers."""
        lease = self._lease
        if lease is None:
            return False
        ttl = self._call(lambda c: Lease(lease.id, c).refresh())
        return ttl > 0

    def put_report(self, report: str) -> None:
        """Writes `hosts/<host>` under the lease; each write moves its mod_revision, which is
        how the others see this host is alive and making progress."""
        lease = self._leased()
        try:
            self._call(lambda c: c.put(self._key(f"hosts/{self.host}"), report.encode(),
                                       Lease(lease.id, c)))
        except Etcd3Exception as e:
            if _lease_gone(e):
                raise LeaseLost(f"host {self.host}'s etcd lease is gone") from e
            raise

    def reports(self) -> dict[int, tuple[str, int]]:
        """Every live host's report and mod_revision. A host whose revision stops moving is
        stale; revisions are etcd's single clock, so no host's clock is ever compared."""
        prefix = self._key("hosts/")
        kvs = self._call(lambda c: c.get_prefix(prefix))
        return {int(kv["key"].decode()[len(prefix):]): (value.decode(), int(kv["mod_revision"]))
                for value, kv in kvs}

    def lead(self) -> bool:
        """One transaction: `leader` = this host under its lease if no leader exists. True iff
        this host leads now (the key is there on this host's lease). The leader key dies with
        its lease, so a dead leader is replaced as soon as its lease expires."""
        lease = self._leased()
        key = self._key("leader")
        txn = {"compare": [{"key": _b64(key), "target": "CREATE", "result": "EQUAL",
                            "create_revision": 0}],
               "success": [{"request_put": {"key": _b64(key), "value": _b64(str(self.host)),
                                            "lease": lease.id}}],
               "failure": [{"request_range": {"key": _b64(key)}}]}
        try:
            result = self._call(lambda c: c.transaction(txn))
        except Etcd3Exception as e:
            if _lease_gone(e):
                return False
            raise
        if result.get("succeeded"):
            return True
        kv = _first_kv(result)
        return kv is not None and int(kv.get("lease", 0)) == lease.id

    def leader(self) -> int | None:
        """The leading host's index, None while no host leads."""
        values = self._call(lambda c: c.get(self._key("leader")))
        return int(values[0].decode()) if values else None

    def publish(self, g: int, record: str) -> bool:
        """ONE transaction: iff the newest generation is g-1 (for g == 0: none yet), set
        `gen`=g and `gen/<g>`=record together. Two publishers can never both win a g: etcd
        applies one transaction after the other, and the second's compare fails.

        A request that timed out may still have been applied; when this call had to try
        again and finds `gen/<g>` holding exactly this record, the generation is the one it
        asked for and it returns True. AgreementUnavailable leaves it unknown: read `newest()`.
        """
        if g < 0:
            raise ValueError(f"generation numbers start at 0: {g}")
        gen, key = self._key("gen"), self._key(f"gen/{g}")
        if g == 0:
            compare = {"key": _b64(gen), "target": "CREATE", "result": "EQUAL",
                       "create_revision": 0}
        else:
            compare = {"key": _b64(gen), "target": "VALUE", "result": "EQUAL",
                       "value": _b64(str(g - 1))}
        txn = {"compare": [compare],
               "success": [{"request_put": {"key": _b64(gen), "value": _b64(str(g))}},
                           {"request_put": {"key": _b64(key), "value": _b64(record)}}],
               "failure": [{"request_range": {"key": _b64(key)}}]}
        attempts = 0

        def send(c: Etcd3Client) -> Any:
            nonlocal attempts
            attempts += 1
            return c.transaction(txn)

        result = self._call(send)
        if result.get("succeeded"):
            return True
        kv = _first_kv(result)
        return attempts > 1 and kv is not None and _value(kv) == record

    def newest(self) -> tuple[int, str] | None:
        """(g, record) of the newest generation, None before the first. `gen/<g>` is written
        in the same transaction as `gen` and never again, so the second read finds it."""
        values = self._call(lambda c: c.get(self._key("gen")))
        if not values:
            return None
        g = int(values[0].decode())
        records = self._call(lambda c: c.get(self._key(f"gen/{g}")))
        return g, records[0].decode()

    @property
    def lease_id(self) -> int | None:
        """This host's lease, for a peer that sees this agent die to revoke (`revoke`)."""
        return self._lease.id if self._lease is not None else None

    def revoke(self, lease_id: int) -> None:
        """Revokes another host's lease: its agent was seen to die (its connection closed), so
        its keys (its report, `leader`) go now instead of a TTL later. A lease already gone is
        no error."""
        try:
            self._call(lambda c: Lease(lease_id, c).revoke())
        except Etcd3Exception as e:
            if not _lease_gone(e):
                raise

    def put(self, name: str, value: str) -> None:
        """A key of the job's, on no lease (the leader's decisions outlive the leader)."""
        self._call(lambda c: c.put(self._key(name), value.encode()))

    def get(self, name: str) -> str | None:
        values = self._call(lambda c: c.get(self._key(name)))
        return values[0].decode() if values else None

    def close(self) -> None:
        """Revokes the lease: this host's report (and `leader`, if it led) vanish at once,
        not a TTL later, so the others move on without waiting."""
        lease, self._lease = self._lease, None
        try:
            if lease is not None:
                self._call(lambda c: Lease(lease.id, c).revoke())
        except Etcd3Exception as e:
            if not _lease_gone(e):
                raise
        finally:
            for c in self._clients:
                c.session.close()

    def _leased(self) -> Lease:
        if self._lease is None:
            raise LeaseLost(f"host {self.host} has no etcd lease: call start() first")
        return self._lease

    def _key(self, name: str) -> str:
        return self.prefix + name


def _client(url: str, timeout: float) -> Etcd3Client:
    """A gateway client for one `http(s)://host:port` endpoint; the API path is fixed to
    etcd >= 3.4's `/v3/`, so no version request precedes the first call."""
    parsed = urlsplit(url)
    if not parsed.hostname or not parsed.port:
        raise ValueError(f"etcd endpoint must be scheme://host:port: {url!r}")
    return Etcd3Client(host=parsed.hostname, port=parsed.port, protocol=parsed.scheme or "http",
                       timeout=timeout, api_path="/v3/")


def _first_kv(txn_result: Any) -> dict[str, Any] | None:
    """The key a transaction's failure branch read, None when it does not exist."""
    responses = txn_result.get("responses") or [{}]
    kvs = responses[0].get("response_range", {}).get("kvs") or []
    return kvs[0] if kvs else None


def _value(kv: dict[str, Any]) -> str:
    return base64.b64decode(kv.get("value", "")).decode()
