"""The one gate in front of Horovod's private internals.

The launcher patches (slot hosts, standby workers, the fatal stop, the discovery check) and the
worker side (the elastic state, the host-update queue) use names Horovod does not promise to
keep. They were written against one release; on another, a renamed method would fail minutes
into a job in a driver thread, or a guard would silently skip a patch (and hand ssh a
``host+0`` name). ``check_compatible()`` runs before any patch and stops with one line naming
the first missing piece.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

from hvd_resilient.errors import LaunchError

TESTED_VERSIONS = ("0.28.1",)
"""Horovod releases the patches were written and tested against."""

DRIVER_TARGETS = (
    # (module, dotted attribute): launcher side, `launch/horovod/patches/`
    ("horovod.runner.util.network", "resolve_host_address"),
    ("horovod.runner.util.remote", "get_remote_command"),
    ("horovod.runner.gloo_run", "get_remote_command"),
    ("horovod.runner.gloo_run", "register_shutdown_event"),
    ("horovod.runner.launch", "get_remote_command"),
    ("horovod.runner.launch", "_run_elastic"),
    ("horovod.runner.launch", "gloo_built"),
    ("horovod.runner.launch", "run_commandline"),
    ("horovod.runner.driver.driver_service", "get_remote_command"),
    ("horovod.runner.elastic.discovery", "HostDiscoveryScript.find_available_hosts_and_slots"),
    ("horovod.runner.elastic.discovery", "HostDiscoveryScript._execute_discovery_script"),
    ("horovod.runner.elastic.discovery", "FixedHosts.find_available_hosts_and_slots"),
    ("horovod.runner.elastic.driver", "DISCOVER_HOSTS_FREQUENCY_SECS"),
    ("horovod.runner.elastic.driver", "ElasticDriver._notify_workers_host_changes"),
    ("horovod.runner.elastic.driver", "ElasticDriver._start_worker_processes"),
    ("horovod.runner.elastic.driver", "ElasticDriver._start_worker_process"),
    ("horovod.runner.elastic.driver", "ElasticDriver._handle_worker_exit"),
    ("horovod.runner.elastic.driver", "ElasticDriver._get_host_assignments"),
    ("horovod.runner.elastic.driver", "ElasticDriver._update_host_assignments"),
    ("horovod.runner.elastic.driver", "ElasticDriver.start"),
    ("horovod.runner.elastic.driver", "ElasticDriver.stop"),
    ("horovod.runner.elastic.driver", "ElasticDriver.finished"),
    ("horovod.runner.elastic.registration", "WorkerStateRegistry._wait"),
    ("horovod.runner.http.http_server", "RendezvousHTTPServer.handle_error"),
    ("horovod.runner.http.http_server", "RendezvousHTTPServer.init"),
    ("horovod.runner.common.util.safe_shell_exec", "multiprocessing"),
    ("horovod.runner.common.util.safe_shell_exec", "_exec_middleman"),
    ("horovod.runner.common.util.safe_shell_exec", "terminate_executor_shell_and_children"),
)
DRIVER_FIELDS = (
    # (module, class, instance attribute set in __init__)
    ("horovod.runner.elastic.driver", "ElasticDriver", "_rendezvous"),
    ("horovod.runner.elastic.driver", "ElasticDriver", "_host_assignments"),
    ("horovod.runner.elastic.driver", "ElasticDriver", "_host_manager"),
    ("horovod.runner.elastic.driver", "ElasticDriver", "_min_num_proc"),
    ("horovod.runner.elastic.driver", "ElasticDriver", "_wait_hosts_cond"),
    ("horovod.runner.elastic.driver", "ElasticDriver", "_worker_registry"),
    ("horovod.runner.elastic.discovery", "HostDiscoveryScript", "_discovery_script"),
    ("horovod.runner.elastic.discovery", "HostDiscoveryScript", "_default_slots"),
    ("horovod.runner.http.http_server", "RendezvousHTTPServer", "cache"),
    ("horovod.runner.http.http_server", "RendezvousHTTPServer", "cache_lock"),
    ("horovod.runner.http.http_server", "RendezvousServer", "_httpd"),
    ("horovod.runner.elastic.registration", "WorkerStateRegistry", "_driver"),
    ("horovod.runner.elastic.registration", "WorkerStateRegistry", "_barrier"),
)
WORKER_TARGETS = (
    # worker side: `backends/horovod/state.py`, `run.py`, and the ordered optimizer
    ("horovod.torch.elastic.state", "TorchState"),
    ("horovod.torch.elastic.state", "StateHandler"),
    ("horovod.torch.elastic.state", "ModelStateHandler"),
    ("horovod.torch.elastic.state", "OptimizerStateHandler"),
    ("horovod.common.elastic", "notification_manager"),
    # the sync takes rank 0's committed attributes as ObjectState.sync does (`state.py`)
    ("horovod.common.elastic", "ObjectState._set_attrs"),
    ("horovod.common.exceptions", "HorovodInternalError"),
    ("horovod.common.exceptions", "HostsUpdatedInterrupt"),
    # a leaving worker asks the rendezvous for its slot as init does (`dropped_slot.py`)
    ("horovod.runner.elastic.rendezvous", "GET_RANK_AND_SIZE"),
    # a standby's first init waits for its release (`launch/warm/standby.py`)
    ("horovod.common.basics", "HorovodBasics.init"),
    # --deterministic's ordered optimizer (`backends/horovod/ordered.py`)
    ("horovod.torch.optimizer", "_DistributedOptimizer._allreduce_grad_async"),
    ("horovod.torch.optimizer", "_DistributedOptimizer.synchronize"),
    # every pending operation's tensors pinned, so Horovod's loop never waits for the GIL
    # (`pinned_handles.py`)
    ("horovod.torch.mpi_ops", "_handle_map"),
)
WORKER_FIELDS = (
    ("horovod.torch.elastic.state", "TorchState", "_handlers"),
    ("horovod.torch.elastic.state", "ModelStateHandler", "_saved_model_state"),
    ("horovod.torch.elastic.state", "OptimizerStateHandler", "_saved_optimizer_state"),
    ("horovod.common.elastic", "State", "_host_messages"),
    ("horovod.common.elastic", "ObjectState", "_saved_state"),
    ("horovod.torch.optimizer", "_DistributedOptimizer", "_handles"),
    ("horovod.torch.optimizer", "_DistributedOptimizer", "_allreduce_delay"),
    ("horovod.torch.optimizer", "_DistributedOptimizer", "_synchronized"),
    ("horovod.torch.optimizer", "_DistributedOptimizer", "backward_passes_per_step"),
)


def _missing(targets: tuple[tuple[str, str], ...],
             fields: tuple[tuple[str, str, str], ...]) -> list[str]:
    out = []
    for module, dotted in targets:
        try:
            obj: object = importlib.import_module(module)
            for part in dotted.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError):
            out.append(f"{module}.{dotted}")
    for module, cls, attr in fields:
        try:
            klass = getattr(importlib.import_module(module), cls)
            init = inspect.getsource(klass.__init__)
        except (ImportError, AttributeError, OSError, TypeError):
            out.append(f"{module}.{cls}")
            continue
        if not re.search(rf"self\.{re.escape(attr)}\s*[,=]", init):
            out.append(f"{module}.{cls}().{attr}")
    return out


def replace(owner: object, name: str, new: object) -> object:
    """Puts ``new`` in place of ``owner.name`` and returns the original: the one way the
    project patches Horovod. A target not declared above is a programming error (it would
    escape `check_compatible`), so it stops here, at install, not minutes into a job."""
    module = getattr(owner, "__module__", None) or getattr(owner, "__name__", "")
    if isinstance(owner, type(importlib)):  # a module: its own name
        module = owner.__name__
        dotted = name
    else:
        dotted = f"{owner.__qualname__}.{name}"  # type: ignore[attr-defined]
    declared = {(m, d) for m, d in (*DRIVER_TARGETS, *WORKER_TARGETS)}
    if (module, dotted) not in declared:
        raise LaunchError(f"internal: {module}.{dotted} is patched but not declared in "
                          "backends/horovod/compat.py")
    original = getattr(owner, name)
    setattr(owner, name, new)
    return original


def kv_get(driver: Any, scope: str) -> dict[str, bytes]:
    """One scope of the driver's rendezvous key-value store (what workers PUT there)."""
    httpd = driver._rendezvous._httpd
    with httpd.cache_lock:
        return dict(httpd.cache.get(scope, {}))


def kv_set(driver: Any, scope: str, key: str, value: bytes | None) -> None:
    """Sets (None: removes) one key of the driver's rendezvous key-value store."""
    httpd = driver._rendezvous._httpd
    with httpd.cache_lock:
        bucket = httpd.cache.setdefault(scope, {})
        if value is None:
            bucket.pop(key, None)
        else:
            bucket[key] = value


def check_compatible(*, driver: bool) -> str:
    """Returns the Horovod version; raises LaunchError (one line) on an untested release or a
    missing target. ``driver``: the launcher-side targets, else the worker side's. Each side
    checks only its own: the worker targets import `horovod.torch`, and with it torch, which
    cost the driver 1.5 s of every launch and relaunch (idle; more on a busy host) and is
    otherwise never imported there. Every worker checks its side in its `hvd.init()`."""
    try:
        import horovod
    except ImportError:
        raise LaunchError("Horovod is not installed; run `make install` "
                          "(scripts/install.sh builds it)") from None
    version = str(getattr(horovod, "__version__", "?"))
    if version not in TESTED_VERSIONS:
        raise LaunchError(f"Horovod {version} is not a tested release (tested: "
                          f"{', '.join(TESTED_VERSIONS)}); install horovod[pytorch]=="
                          f"{TESTED_VERSIONS[-1]} (`make install`)")
    missing = (_missing(DRIVER_TARGETS, DRIVER_FIELDS) if driver
               else _missing(WORKER_TARGETS, WORKER_FIELDS))
    if missing:
        raise LaunchError(f"Horovod {version} lacks {missing[0]}"
                          + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                          + ", which hvd_resilient patches; reinstall with `make install`")
    return version
