"""One elastic `horovodrun` job over a namespaced cluster, its checks and its timings."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tests.support.exactly_once import assert_exactly_once
from tests.support.jobs import PYTHON, VENV_BIN, Job, events, wait_for, write_discovery
from tests.support.netns import Cluster, Host
from tests.support.paths import ROOT, SCRIPTS
from tests.support.runs import commits, final_digests, sizes_seen

JOB = str(SCRIPTS / "elastic_job.py")
N_SAMPLES = 2048  # elastic_job.py's data set
# Horovod applies this one timeout to collectives AND to the rendezvous in which survivors
# wait for a readmitted worker to cold-start (ssh, Python, torch, Horovod: 3-5.5 s here under
# load). With 5 s, 2 of 8 runs lost the whole job at readmission (docs/chaos.md), so 15 s;
# HVD_CHAOS_GLOO_TIMEOUT=5 reproduces the tighter setting.
GLOO_TIMEOUT = int(os.environ.get("HVD_CHAOS_GLOO_TIMEOUT", "15"))
HOROVOD_ARGS = ["--gloo-timeout-seconds", str(GLOO_TIMEOUT),
                "--blacklist-cooldown-range", "2", "4"]
REPORT_ENV = "HVD_CHAOS_REPORT"  # a file that collects each scenario's measurements (JSONL)


class ElasticRun:
    def __init__(self, chaos: Any, cluster: Cluster, name: str, *, expect_sizes: list[int],
                 commit_every: int = 5, steps_at_each: int = 20, slots: int = 1,
                 fault: str | None = None, job_args: tuple[str, ...] = (),
                 health_filter: bool = False, hosts: list[Host] | None = None,
                 np: int | None = None, min_np: int = 1,
                 horovod_args: tuple[str, ...] = tuple(HOROVOD_ARGS),
                 env: dict[str, str] | None = None, supervised: int | None = None,
                 checkpoint: str = "", checkpoint_every: int = 20) -> None:
        """`hosts`: the hosts discovery lists (default all); `np`: workers to start and the
        most the job may grow to (default every slot); `supervised`: launch through
        `hvd-resilient run --max-restarts N` instead of a bare horovodrun; `checkpoint`: a
        file:// or s3:// URL for durable checkpoints every `checkpoint_every` steps."""
        self.cluster = cluster
        self.name = name
        self.commit_every = commit_every
        self.dir: Path = chaos.tmp / name
        self.run = self.dir / "run"
        self.run.mkdir(parents=True)
        self.hosts_file, discover = write_discovery(self.dir, cluster.hostfile(hosts, slots))
        if health_filter:  # keep only hosts whose sshd accepts a TCP connection
            discover.write_text(
                f"#!/bin/sh\nexec {PYTHON} {ROOT}/discovery/health-filter --port {cluster.port} "
                f"--timeout 0.5 -- {PYTHON} {ROOT}/discovery/hostfile {self.hosts_file}\n")
        n = np or len(hosts or cluster.hosts) * slots
        train = [PYTHON, JOB, "--run-dir", str(self.run),
                 "--expect-sizes", ",".join(map(str, expect_sizes)),
                 "--steps-at-each", str(steps_at_each), "--commit-every", str(commit_every),
                 *job_args]
        if checkpoint:
            train += ["--checkpoint-url", checkpoint, "--checkpoint-every", str(checkpoint_every)]
        if supervised is None:
            cmd = [str(VENV_BIN / "horovodrun"), "-np", str(n), "--min-np", str(min_np),
                   "--max-np", str(n), "--host-discovery-script", str(discover),
                   *cluster.horovodrun_args(), *horovod_args, *train]
        else:  # ssh port and key come from the run's ssh wrapper (first on PATH)
            cmd = [str(VENV_BIN / "hvd-resilient"), "run", "--discovery", str(discover),
                   "--np", str(n), "--min-np", str(min_np), "--max-np", str(n),
                   "--network-interface", cluster.iface,
                   "--gloo-timeout-seconds", str(GLOO_TIMEOUT), "--run-id", name,
                   "--run-dir", str(self.run), "--max-restarts", str(supervised),
                   *(["--checkpoint", checkpoint] if checkpoint else []), "--", *train]
        extra = dict(env or {})
        if fault:
            extra["HVD_RESILIENT_FAULT"] = fault
        env = cluster.env(chaos.jobs.env(**extra))
        self.job: Job = chaos.jobs.start(cmd, env=env, cwd=self.dir, name=name)
        cluster.adopt(self.job.proc.pid)
        self.marks: dict[str, float] = {}  # what the test did, when (time.time())

    # -- reading the run ------------------------------------------------------------------
    def events(self) -> list[dict]:
        return events(self.run / "events.jsonl")

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events() if e["event"] == kind]

    def commits(self) -> list[dict]:
        return commits(self.run)

    def wait(self, predicate: Any, timeout: float, what: str) -> Any:
        return wait_for(predicate, timeout, what, self.job)

    def wait_commit(self, size: int, min_step: int = 0, timeout: float = 120.0,
                    after: float = 0.0) -> dict:
        """The first commit at `size` with step >= min_step (and ts >= after)."""
        def found() -> dict | None:
            for c in self.commits():
                if c["size"] == size and c["step"] >= min_step and c["ts"] >= after:
                    return c
            return None
        return self.wait(found, timeout, f"a commit at size {size}, step >= {min_step}")

    def pid_of_rank(self, rank: int) -> int:
        """The pid of the latest worker that started as `rank`."""
        starts = [e for e in self.of("start") if e["rank"] == rank]
        assert starts, f"no start event for rank {rank}"
        return int(starts[-1]["pid"])

    def host_of_rank(self, rank: int) -> Host:
        pid = self.pid_of_rank(rank)
        h = self.cluster.host_of_pid(pid)
        assert h is not None, f"rank {rank} (pid {pid}) runs in none of the cluster's hosts"
        return h

    # -- the checks every scenario makes --------------------------------------------------
    def check(self, expected_sizes: list[int], timeout: float = 240.0) -> dict:
        try:
            code = self.job.wait(timeout)
        except AssertionError as e:  # a hang: the output's tail is one rank's stacks at best
            raise AssertionError(f"{e}\n{self.story()}") from None
        assert code == 0, f"job exited {code}:\n{self.job.output()[-4000:]}"
        assert sizes_seen(self.run) == expected_sizes, (
            f"rank 0 saw sizes {sizes_seen(self.run)}, expected {expected_sizes}")
        epochs = assert_exactly_once(self.run, N_SAMPLES)
        digests = final_digests(self.run)
        final = expected_sizes[-1]
        assert sorted(digests) == list(range(final)), f"done events from ranks {sorted(digests)}"
        assert len(set(digests.values())) == 1, f"ranks disagree after recovery: {digests}"
        for r in self.of("restore"):
            assert 0 <= r["lost_steps"] <= self.commit_every, (
                f"lost more than one commit interval ({self.commit_every} steps): {r}")
        return {"epochs_checked": epochs}

    def story(self, last: int = 40) -> str:
        """The run's last events, one short line each, relative to the first mark: what every
        rank did before a job hung (its output's tail holds one rank's stacks at best)."""
        t0 = min(self.marks.values(), default=0.0)
        evs = self.events()
        commits = [e for e in evs if e["event"] == "commit"]
        lines = []
        for e in [e for e in evs if e["event"] != "commit"][-last:] + commits[-1:]:
            rest = {k: v for k, v in e.items()
                    if k not in ("ts", "event", "run_id", "lease_epoch", "params_sha256")}
            lines.append(f"{e['ts'] - t0:+8.2f} {e['event']} {json.dumps(rest)[:160]}")
        return "last events (seconds after the fault):\n" + "\n".join(lines)

    def timings(self, fault_key: str = "fault") -> dict[str, Any]:
        """Seconds from the fault to what followed, read from the events."""
        t0 = self.marks[fault_key]
        evs = self.events()
        after = [e for e in evs if e["ts"] >= t0]

        def first(pred: Any) -> float | None:
            ts = [e["ts"] for e in after if pred(e)]
            return round(min(ts) - t0, 2) if ts else None

        sizes = [c["size"] for c in evs if c["event"] == "commit" and c["ts"] < t0]
        before = sizes[-1] if sizes else None
        shrink = [e for e in after if e["event"] == "reset" and e["new_size"] < e["old_size"]]
        small = min((e["new_size"] for e in shrink), default=None)
        return {
            "scenario": self.name,
            "size_before": before,
            "failure_detected_first_s": first(lambda e: e["event"] == "failure_detected"),
            "failure_detected_last_s": (
                round(max(e["ts"] for e in after if e["event"] == "failure_detected") - t0, 2)
                if any(e["event"] == "failure_detected" for e in after) else None),
            "errors": sorted({e.get("error", "")[:90] for e in after
                              if e["event"] == "failure_detected"}),
            "reset_to_smaller_s": first(lambda e: e["event"] == "reset"
                                        and e["new_size"] < e["old_size"]),
            "first_commit_smaller_s": first(lambda e: e["event"] == "commit"
                                            and small is not None and e["size"] == small),
            "grown_back_commit_s": first(lambda e: e["event"] == "commit" and before is not None
                                         and e["size"] == before
                                         and any(s["ts"] < e["ts"] for s in shrink)),
            "restores": len([e for e in after if e["event"] == "restore"]),
            "lost_steps": sorted({e["lost_steps"] for e in after if e["event"] == "restore"}),
            "resets": [(e["old_size"], e["new_size"]) for e in after
                       if e["event"] == "reset" and e["rank"] == 0],
            "marks_s": {k: round(v - t0, 2) for k, v in self.marks.items()},
        }

    def report(self, numbers: dict[str, Any]) -> None:
        print(f"\n[chaos] {json.dumps(numbers)}")
        path = os.environ.get(REPORT_ENV)
        if path:
            with open(path, "a") as fh:
                fh.write(json.dumps(numbers) + "\n")
