"""One config system: the training settings and `hvd-resilient run`'s options come from the same
machinery (`hvd_resilient.settings`); each training setting has one name, and any other is
refused as unknown; what used to be written into the environment and read back is passed down;
the store registry is the one truth about checkpoint URLs."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import pytest

from hvd_resilient import log
from hvd_resilient.checkpoint import stores
from hvd_resilient.config import SCHEMA, RecoveryOptions, TrainConfig, settings
from hvd_resilient.errors import ConfigError
from hvd_resilient.launch import cli
from hvd_resilient.launch.run_settings import RUN
from tests.support.paths import ROOT


def _parse(argv: list[str], env: dict[str, str] | None = None) -> TrainConfig:
    p = argparse.ArgumentParser()
    TrainConfig.add_arguments(p)
    return TrainConfig.from_sources(p.parse_args(argv), env=env or {})


# -- checkpoint settings in one section, each under one name ---------------------------------
def test_checkpoint_settings_are_one_section_with_one_name_each(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("checkpoint_keep_last: 7\ncheckpoint:\n  snapshot_reuse: false\n"
                 "  grace_seconds: 5\nmemory_tier:\n  dir: /tmp/m1\n")
    cfg = _parse(["--config", str(f)])
    assert (cfg.checkpoint.keep_last, cfg.checkpoint.snapshot_reuse,
            cfg.checkpoint.grace_seconds, cfg.memory_tier.dir) == (7, False, 5.0, "/tmp/m1")
    # the environment beats the file, the flags beat both
    cfg = _parse(["--config", str(f), "--checkpoint-keep-last", "9", "--no-checkpoint-resume"],
                 {"HVD_RESILIENT_CHECKPOINT_KEEP_LAST": "8",
                  "HVD_RESILIENT_MEMORY_TIER_DIR": "/tmp/m2",
                  "HVD_RESILIENT_CHECKPOINT_STORE_WAIT_SECONDS": "2"})
    assert (cfg.checkpoint.keep_last, cfg.memory_tier.dir, cfg.checkpoint.resume,
            cfg.checkpoint.store_wait_seconds) == (9, "/tmp/m2", False, 2.0)
    overrides = TrainConfig.from_sources(env={}, checkpoint_keep_last=2, checkpoint_every=3)
    assert (overrides.checkpoint.keep_last, overrides.checkpoint.every) == (2, 3)


def test_a_setting_has_no_second_name(tmp_path):
    """No release shipped with another spelling, so none is read: a name that is not the
    setting's is an unknown field, refused in one line (with the setting as the guess where
    the names are close)."""
    assert not hasattr(settings()[0], "aliases") and not hasattr(SCHEMA, "env_aliases")
    f = tmp_path / "c.json"
    for given, said in (
            ({"keep_last": 7}, "unknown field keep_last (did you mean checkpoint_keep_last?)"),
            ({"store": {"memory_dir": "/t"}}, "unknown field store_memory_dir (did you mean "
                                              "memory_tier_dir?)"),
            ({"resume": False}, "unknown field resume; known: batch_size, ")):
        f.write_text(json.dumps(given))
        with pytest.raises(ConfigError) as in_file:
            _parse(["--config", str(f)])
        with pytest.raises(ConfigError) as in_code:
            TrainConfig.from_sources(env={}, **given)
        for e in (in_file, in_code):
            assert said in str(e.value) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(SystemExit):  # argparse: unrecognized arguments, as for any typo
        _parse(["--keep-last", "9"])
    assert not hasattr(TrainConfig.from_sources(env={}), "checkpoint_url")


def test_the_memory_tier_is_its_own_section():
    cfg = TrainConfig.from_sources(env={"HVD_RESILIENT_MEMORY_TIER_SCOPE": "fresh1",
                                        "HVD_RESILIENT_MEMORY_TIER_ENABLED": "0"})
    assert (cfg.memory_tier.scope, cfg.memory_tier.enabled) == ("fresh1", False)
    assert cfg.to_dict()["memory_tier"]["scope"] == "fresh1" and "memory_dir" not in \
        cfg.to_dict()["store"]
    with pytest.raises(ConfigError, match="memory_tier_dir must be an absolute path"):
        TrainConfig.from_sources(env={}, memory_tier={"dir": "relative"})


def test_every_knob_has_a_setting_that_reaches_its_owner():
    cfg = TrainConfig.from_sources(env={"HVD_RESILIENT_RECOVERY_HOST_CHECK_EVERY": "5",
                                        "HVD_RESILIENT_FAULT": "kill:rank=1:step=3"})
    assert cfg.recovery.host_check_every == 5 and cfg.fault == "kill:rank=1:step=3"
    with pytest.raises(ConfigError, match="recovery_host_check_every must be >= 0"):
        TrainConfig.from_sources(env={"HVD_RESILIENT_RECOVERY_HOST_CHECK_EVERY": "-1"})
    pytest.importorskip("horovod.torch")
    from hvd_resilient import backends

    backend = backends.get("horovod", recovery=RecoveryOptions(host_check_every=5),
                           deterministic=True)
    assert (backend.host_check_every, backend.deterministic) == (5, True)


def test_a_bad_value_names_its_source_in_one_line(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"batch_size": "many"}))
    for argv, env, says in [
        (["--batch-size", "abc"], {}, "config: batch_size must be a whole number, got 'abc' "
                                      "(--batch-size)"),
        ([], {"HVD_RESILIENT_SHUFFLE": "maybe"}, "config: shuffle must be true or false, got "
                                                 "'maybe' (from HVD_RESILIENT_SHUFFLE)"),
        (["--config", str(f)], {}, f"config: config file {f}: batch_size must be a whole "
                                   "number, got 'many'"),
    ]:
        with pytest.raises(ConfigError) as e:
            _parse(argv, env)
        assert str(e.value) == says


# -- hvd-resilient run: the same machinery ---------------------------------------------------
def _resolve(argv: list[str]):
    return cli.resolve(cli.build_parser().parse_args(argv))


def test_run_options_defaults_file_then_flags(tmp_path):
    defaults, launcher = _resolve(["--", "python", "t.py"])
    assert (launcher.name, defaults.np, defaults.max_restarts, launcher.own.slot_hosts,
            launcher.own.blacklist_cooldown_range) == ("horovod", 2, 3, True, (10, 30))
    f = tmp_path / "run.yaml"
    f.write_text("np: 3\nlauncher: horovod\nmax-restarts: 5\nno_slot_hosts: true\n"
                 "blacklist_cooldown_range: [1, 2]\ncommand: python train.py --epochs 2\n")
    opts, launcher = _resolve(["--config", str(f)])
    assert (opts.np, launcher.name, opts.max_restarts, launcher.own.slot_hosts,
            launcher.own.blacklist_cooldown_range, opts.command) == (
        3, "horovod", 5, False, (1, 2), [sys.executable, "train.py", "--epochs", "2"])
    opts, launcher = _resolve(["--config", str(f), "--np", "4", "--slot-hosts", "--", "python",
                               "x.py"])
    # a bare `python` is this environment's interpreter (launch/interpreter.py)
    assert (opts.np, launcher.own.slot_hosts, opts.command) == (4, True, [sys.executable, "x.py"])
    # a launcher's own options may be grouped under its name in a file
    f.write_text("launcher: torchrun\ntorchrun: {nnodes: '1:2', torchrun-restarts: 0}\n")
    opts, launcher = _resolve(["--config", str(f), "--", "python", "x.py"])
    assert (launcher.name, launcher.own.nnodes, launcher.own.torchrun_restarts) == (
        "torchrun", "1:2", 0)


@pytest.mark.parametrize("text, says", [
    ("np: three\n", "np must be a whole number, got 'three'"),
    ("np: true\n", "np must be a whole number, got True"),
    ("launcher: slurm\n", "launcher must be one of horovod, mpi, torchrun, inplace, got 'slurm'"),
    ("backend: mpi\n", "unknown field backend"),
    ("blacklist_cooldown_range: 5\n", "blacklist_cooldown_range must be a list of two numbers"),
    ("command: {a: 1}\n", "command must be a list of words or one string"),
    ("dry_run: maybe\n", "dry_run must be true or false, got 'maybe'"),
    ("max_restart: 0\n", "unknown field max_restart (did you mean max_restarts?)"),
])
def test_a_bad_run_config_file_stops_with_one_line(tmp_path, text, says):
    f = tmp_path / "run.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        _resolve(["--config", str(f), "--", "python", "t.py"])
    assert str(e.value).startswith(f"run: config file {f}: {says}"), str(e.value)
    assert "\n" not in str(e.value)


def test_a_bad_run_flag_stops_with_one_line():
    with pytest.raises(ConfigError, match=r"^run: np must be a whole number, got 'x' \(--np\)$"):
        _resolve(["--np", "x", "--", "python", "t.py"])
    with pytest.raises(ConfigError, match="run: --checkpoint: unsupported checkpoint URL scheme "
                                          "'ftp' in 'ftp://x'; use file:///path or s3://"):
        _resolve(["--checkpoint", "ftp://x", "--", "python", "t.py"])


def test_every_run_option_is_a_setting_with_a_flag():
    flags = {o for a in cli.build_parser()._actions for o in a.option_strings}
    for st in RUN.settings:
        assert st.positional or st.flag in flags, st.name
        assert st.env is None, "run options come from files and flags only"


def test_fresh_start_sets_the_checkpoints_aside_under_the_managers_tag(tmp_path, monkeypatch):
    from hvd_resilient.checkpoint import CheckpointManager
    from hvd_resilient.checkpoint import supersede as supersede_module

    url = (tmp_path / "ck").as_uri()
    CheckpointManager(url).save(10, 0, 1, {"state.pt": b"x"})
    monkeypatch.setattr(supersede_module, "default_supersede_tag", lambda: "superseded-test")
    line = cli.fresh_start(url)
    assert f"{url}/superseded-test" in line and "steps 10" in line
    assert (tmp_path / "ck" / "superseded-test").is_dir()


# -- read once at the edge, passed down ------------------------------------------------------
def test_log_setup_reads_no_environment(monkeypatch):
    monkeypatch.setenv("HVD_RESILIENT_OBSERVABILITY_LOG_LEVEL", "DEBUG")
    logger = logging.getLogger("hvd_resilient")
    before = logger.level
    try:
        log.setup(rank_fn=lambda: 0)
        assert logger.level == logging.INFO
        log.setup(rank_fn=lambda: 0, level="DEBUG")
        assert logger.level == logging.DEBUG
    finally:
        logger.setLevel(before)
    assert TrainConfig.from_sources(env={"HVD_RESILIENT_OBSERVABILITY_LOG_LEVEL": "debug"}
                                    ).observability.log_level == "DEBUG"


def test_no_module_below_the_edge_reads_what_the_config_read():
    """The switches the config reads are read nowhere else (they come down as arguments)."""
    root = ROOT / "hvd_resilient"
    for name in ("HVD_RESILIENT_DETERMINISTIC", "HVDR_USER_FUSION_THRESHOLD",
                 "HVD_RESILIENT_OBSERVABILITY_LOG_LEVEL", "MASTER_ADDR"):
        users = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                       if f'"{name}"' in p.read_text())  # as a string in code, not in prose
        allowed = {"MASTER_ADDR": ["backends/torchrun/backend.py"]}.get(name, [])
        assert users == allowed, (name, users)


# -- the store registry ----------------------------------------------------------------------
def test_the_registry_names_the_supported_urls_and_every_message_uses_it():
    assert stores.SUPPORTED_URLS == "file:///path or s3://bucket/prefix"
    assert stores.SUPPORTED_URLS == " or ".join(stores.store_class(s).url_form
                                                for s in stores.REGISTRY)
    spelled = [str(p) for p in (ROOT / "hvd_resilient").rglob("*.py")
               if "file:///path or s3://" in p.read_text()]
    assert not spelled, f"spell the supported URLs with stores.SUPPORTED_URLS: {spelled}"


def test_each_store_parses_its_own_url_and_open_store_only_dispatches(tmp_path, monkeypatch):
    assert stores.check_url(str(tmp_path)) == "file"  # a plain path is a file path
    assert stores.check_url("s3://b/p") == "s3"
    for url, says in [("s3:///p", "has no bucket; use s3://bucket/prefix"),
                      ("file://host/p", "names host 'host'; use file:///path"),
                      ("mem://x", f"unsupported checkpoint URL scheme 'mem' in 'mem://x'; use "
                                  f"{stores.SUPPORTED_URLS}")]:
        with pytest.raises(stores.StoreConfigError, match=says):
            stores.check_url(url)
    # a registered scheme is opened through its class, nothing else to change
    monkeypatch.setitem(stores.REGISTRY, "mem", f"{__name__}:MemStore")
    store = stores.open_store("mem://bucket/key", flavour="x")
    assert isinstance(store, MemStore) and (store.where, store.flavour) == ("bucket", "x")


def test_store_settings_are_checked_once_by_the_store_that_reads_them():
    assert stores.store_options("s3://b/p", {"sse": "", "sse_kms_key_id": "k"}) == {
        "sse": "aws:kms", "sse_kms_key_id": "k"}
    with pytest.raises(stores.StoreSettingError) as e:
        stores.store_options("file:///x", {"sse": "AES256", "sse_kms_key_id": ""})
    assert e.value.setting == "sse" and "read by s3:// checkpoint stores only" in str(e.value)
    from hvd_resilient.checkpoint.stores.s3 import S3Store

    with pytest.raises(stores.StoreSettingError, match="sse must be AES256 or aws:kms"):
        S3Store("b", sse="rot13", check=False)  # the constructor asks the same check


class MemStore(stores.CheckpointStore):
    """A store registered by this test: what a third kind of store needs to provide."""

    url_form = "mem://where"

    def __init__(self, where: str, flavour: str = "") -> None:
        super().__init__()
        self.where, self.flavour, self.url = where, flavour, f"mem://{where}"

    @classmethod
    def url_args(cls, parts, url):
        return {"where": parts.netloc}

    def _put(self, key, data):  # pragma: no cover - never called
        raise NotImplementedError

    _get = _list = _delete = _exists = _put


def test_the_reference_page_is_generated_by_the_module_it_names():
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert "python -m hvd_resilient.reference" in page
    assert Path(ROOT / "hvd_resilient" / "reference.py").is_file()
