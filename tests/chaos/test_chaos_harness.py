"""The namespace harness itself, without Horovod: hosts, ssh, faults, teardown, stale sweep."""

from __future__ import annotations

import json
import os
import socket
import subprocess

import psutil
import pytest

from tests.support import netns
from tests.support.jobs import wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(120)]


def ssh(c, h, command: str, timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run(c.ssh_cmd(h, command), capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def leftovers(run_id: str) -> list[str]:
    out = [n for n in netns._list_netns() if run_id in n]
    out += [n for n in netns._list_links() if run_id in n]
    if netns.ETC_NETNS.is_dir():
        out += [str(d) for d in netns.ETC_NETNS.iterdir() if run_id in d.name]
    if (netns.REGISTRY / f"{run_id}.json").exists():
        out.append(f"registry {run_id}")
    return out


@pytest.mark.ci_chaos
def test_hosts_reach_each_other_over_ssh_and_are_removed_afterwards(chaos):
    c = chaos.cluster(2)
    a, b = c.hosts
    r = ssh(c, a, f"getent hosts {socket.gethostname()}; ssh -F {c.ssh_config} {b.addr} "
                  "'cat /proc/self/net/dev'")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == a.addr, "the hostname must resolve to the host's address"
    assert c.iface in r.stdout, "every host carries the bridge's interface name"
    sleeper = subprocess.Popen(c.ssh_cmd(b, "sleep 300"), stdin=subprocess.DEVNULL)
    try:
        remote = wait_for(lambda: c.named(b, "sleep"), 20, "the remote sleep")
        assert c.host_of_pid(remote[0]) == b
        assert c.host_of_pid(os.getpid()) is None
    finally:
        sleeper.kill()
        sleeper.wait(10)
    run_id = c.run_id
    assert leftovers(run_id)
    c.close()
    assert leftovers(run_id) == []
    assert not psutil.pid_exists(remote[0]) or psutil.Process(remote[0]).status() == "zombie"


def test_partition_heal_and_kill_host(chaos):
    c = chaos.cluster(2)
    a, b = c.hosts
    c.partition(b)
    r = ssh(c, a, f"ssh -F {c.ssh_config} -o ConnectTimeout=2 {b.addr} true")
    assert r.returncode != 0, "a partitioned host answered"
    c.heal(b)
    wait_for(lambda: ssh(c, a, f"ssh -F {c.ssh_config} {b.addr} true").returncode == 0,
             30, "the healed host to answer")
    sleeper = subprocess.Popen(c.ssh_cmd(b, "sleep 300"), stdin=subprocess.DEVNULL)
    try:
        wait_for(lambda: c.named(b, "sleep"), 20, "the remote sleep")
        _, killed = c.kill_host(b)
        assert len(killed) >= 2 and c.pids(b) == []
        assert c.sshd_pid(b) in netns.netns_pids(b.ns), "kill_host kept sshd"
        assert sleeper.wait(20) != 0
    finally:
        sleeper.kill()
        sleeper.wait(10)
    _, killed = c.kill_host(b, keep_sshd=False)
    assert netns.netns_pids(b.ns) == []
    assert ssh(c, b, "true", timeout=20).returncode != 0, "sshd survived kill_host"
    c.restart_sshd(b)
    assert ssh(c, b, "true").returncode == 0
    assert c.slow(b)
    c.unslow(b)


def test_stale_run_of_a_dead_owner_is_swept(chaos):
    """What a SIGKILLed test run leaves (registry entry, namespace, links, /etc/netns) goes."""
    chaos.require()
    dead = subprocess.Popen(["true"])
    dead.wait()
    run_id = "0bad" + os.urandom(1).hex()
    ns = f"{netns.PREFIX}-{run_id}-0"
    with netns._registry_lock():
        (netns.REGISTRY / f"{run_id}.json").write_text(json.dumps(
            {"pid": dead.pid, "create_time": 0.0, "subnet": "198.19.255.0/24"}))
        if not netns.ETC_NETNS.exists():
            (netns.REGISTRY / "made-etc-netns").touch()
    try:
        subprocess.run(["ip", "netns", "add", ns], check=True, timeout=30)
        subprocess.run(["ip", "link", "add", f"hvc{run_id}", "type", "bridge"], check=True,
                       timeout=30)
        subprocess.run(["ip", "link", "add", f"hvc{run_id}p0", "type", "veth", "peer", "name",
                        f"hvt{run_id}0"], check=True, timeout=30)
        subprocess.run(["ip", "link", "set", f"hvt{run_id}0", "netns", ns], check=True,
                       timeout=30)
        (netns.ETC_NETNS / ns).mkdir(parents=True, exist_ok=True)
        sleeper = subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "300"],
                                   stdin=subprocess.DEVNULL)
        wait_for(lambda: netns.netns_pids(ns), 20, "the stale namespace's process")
        assert run_id in netns.sweep_stale()
        sleeper.wait(20)  # gone (reaped by the sweep's psutil.wait_procs: no status to check)
        assert leftovers(run_id) == []
    finally:
        netns._teardown(run_id)
