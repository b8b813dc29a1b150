"""The last good answer of a discovery script, kept for transient failures only.

Why keep it: after a full restart of ``horovodrun`` its *first* discovery call decides
whether the job starts at all, and an API that blinks at that moment would end the run.
Printing the answer from a few seconds ago (and saying so on stderr) rides over the blink.

What it must never do: mask a configuration or validation error (the runner only consults
the cache for ``TransientDiscoveryError`` and ``DeadlineExceeded``), hand out an answer that
is too old (``max_age``), or be a way to inject hostnames: the default directory is private
to the user (0700, owned by us, not a symlink) and every entry read back is validated again
exactly like fresh output.

Writes are atomic (temporary file in the same directory, then ``os.replace``) so a reader
running a second later never sees half a file.  No fsync: after a power loss an empty or
missing file only means "no cached answer".
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
import time
from collections.abc import Mapping

from .output import HostSlots
from .validate import parse_slots, validate_hostname

#: Default for ``--cache-max-age``: old enough to ride over an API restart, young enough
#: that a host which died meanwhile is soon noticed.
DEFAULT_MAX_AGE_S = 300.0
_FORMAT_VERSION = 1
_MAX_BYTES = 1 << 20


def cache_key(script: str, material: Mapping[str, object]) -> str:
    """A short stable hash of the script name and everything that shapes its answer."""
    blob = json.dumps({"script": script, "material": material}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def default_cache_dir(environ: Mapping[str, str]) -> str:
    """``$XDG_RUNTIME_DIR/hvd_resilient`` (per-user tmpfs), else ``/tmp/hvd_resilient-UID``."""
    runtime = environ.get("XDG_RUNTIME_DIR", "")
    if runtime and os.path.isabs(runtime) and os.path.isdir(runtime):
        return os.path.join(runtime, "hvd_resilient")
    return os.path.join(tempfile.gettempdir(), f"hvd_resilient-{os.getuid()}")


class AnswerCache:
    """One cache file for one (script, options) pair."""

    def __init__(self, path: str, *, script: str, private_dir: bool) -> None:
        """``private_dir``: create and check the parent directory as a private one (default
        location); an explicit ``--cache FILE`` is trusted as given."""
        self.path = path
        self.script = script
        self._private_dir = private_dir
        self.unusable: str | None = None

    @classmethod
    def for_script(
        cls, script: str, material: Mapping[str, object], environ: Mapping[str, str],
        explicit_path: str | None = None,
    ) -> AnswerCache:
        if explicit_path:
            return cls(explicit_path, script=script, private_dir=False)
        name = f"discovery-{script}-{cache_key(script, material)}.json"
        return cls(os.path.join(default_cache_dir(environ), name), script=script,
                   private_dir=True)

    def _check_dir(self, create: bool) -> bool:
        if not self._private_dir:
            return True
        directory = os.path.dirname(self.path)
        try:
            if create:
                try:
                    os.mkdir(directory, 0o700)
                except FileExistsError:
                    pass
            st = os.lstat(directory)
        except FileNotFoundError:
            self.unusable = "no earlier answer cached"
            return False
        except OSError as exc:
            self.unusable = f"cache directory {directory}: {exc.strerror or exc}"
            return False
        # In a shared /tmp another user could pre-create the directory or plant a symlink and
        # feed us hostnames; refuse anything that is not our own private directory.
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            self.unusable = (f"cache directory {directory} is not a private directory owned "
                             "by this user")
            return False
        return True

    def store(self, hosts: Mapping[str, int]) -> None:
        """Write ``hosts`` atomically.  Best effort: a failure only disables the fallback."""
        if not self._check_dir(create=True):
            return
        payload = json.dumps({
            "version": _FORMAT_VERSION, "script": self.script, "written": time.time(),
            "hosts": dict(sorted(hosts.items())),
        }, sort_keys=True)
        directory = os.path.dirname(self.path) or "."
        try:
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
        except OSError as exc:
            self.unusable = f"cannot write cache in {directory}: {exc.strerror or exc}"
            return
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(payload)
            os.replace(tmp, self.path)
        except OSError as exc:
            self.unusable = f"cannot write cache {self.path}: {exc.strerror or exc}"
            try:
                os.unlink(tmp)
            except OSError:
                pass

    def load(self, max_age: float) -> tuple[HostSlots, float] | None:
        """Return ``(hosts, age_seconds)`` for a valid answer younger than ``max_age``.

        Anything unexpected (missing, unreadable, foreign, too old, invalid entries) yields
        ``None`` with the reason in ``self.unusable``: the cache can only help, never fail.
        """
        if max_age <= 0:
            self.unusable = "cache disabled (max age 0)"
            return None
        if not self._check_dir(create=False):
            return None
        try:
            flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
            fd = os.open(self.path, flags)
            with os.fdopen(fd, "rb") as fh:
                raw = fh.read(_MAX_BYTES + 1)
        except FileNotFoundError:
            self.unusable = "no earlier answer cached"
            return None
        except OSError as exc:
            self.unusable = f"cannot read cache {self.path}: {exc.strerror or exc}"
            return None
        try:
            if len(raw) > _MAX_BYTES:
                raise ValueError("cache file too large")
            data = json.loads(raw)
            if data.get("version") != _FORMAT_VERSION or data.get("script") != self.script:
                raise ValueError("cache file written by something else")
            written = float(data["written"])
            hosts = {validate_hostname(h): parse_slots(s) for h, s in data["hosts"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            self.unusable = f"ignoring cache {self.path}: {exc}"
            return None
        age = time.time() - written
        if age > max_age or age < -5:
            self.unusable = f"cached answer is {age:.0f} s old (max {max_age:g} s)"
            return None
        return hosts, max(age, 0.0)
