"""The config's sections (store, recovery, observability): one place reads them, from file <
environment < flags, and hands them down; a worker under `hvd-resilient run` cannot pick its
own run folder or checkpoint URL."""

from __future__ import annotations

import argparse
import json

import pytest

from hvd_resilient.config import TrainConfig
from hvd_resilient.errors import ConfigError


def _parse(argv: list[str], env: dict[str, str]) -> TrainConfig:
    p = argparse.ArgumentParser()
    TrainConfig.add_arguments(p)
    return TrainConfig.from_sources(p.parse_args(argv), env=env)


def test_a_section_comes_from_file_then_environment_then_flags(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"checkpoint_url": "s3://b/p",
                             "recovery": {"heartbeat_timeout_seconds": 4, "pg_timeout_seconds": 9},
                             "store_sse": "AES256"}))
    cfg = _parse(["--config", str(f)], {})
    assert (cfg.recovery.heartbeat_timeout_seconds, cfg.recovery.pg_timeout_seconds) == (4, 9)
    assert cfg.store.sse == "AES256"
    cfg = _parse(["--config", str(f)], {"HVD_RESILIENT_RECOVERY_HEARTBEAT_TIMEOUT_SECONDS": "2"})
    assert cfg.recovery.heartbeat_timeout_seconds == 2
    cfg = _parse(["--config", str(f), "--recovery-heartbeat-timeout-seconds", "0"],
                 {"HVD_RESILIENT_RECOVERY_HEARTBEAT_TIMEOUT_SECONDS": "2"})
    assert cfg.recovery.heartbeat_timeout_seconds == 0
    assert cfg.to_dict()["recovery"]["pg_timeout_seconds"] == 9  # recorded in `start`


def test_encryption_reaches_the_s3_store_and_is_refused_where_it_cannot_apply():
    cfg = TrainConfig.from_sources(env={"HVD_RESILIENT_CHECKPOINT_URL": "s3://b/p",
                                        "HVD_RESILIENT_STORE_SSE_KMS_KEY_ID": "key-1"})
    assert cfg.store.sse == "aws:kms"  # a key implies KMS
    options = cfg.store.store_options(cfg.checkpoint.url)
    assert options == {"sse": "aws:kms", "sse_kms_key_id": "key-1"}
    from hvd_resilient.checkpoint.stores.s3 import S3Store

    store = S3Store("b", "p", check=False, **options)  # no bucket probe: nothing is sent
    assert store._sse_args == {"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": "key-1"}
    with pytest.raises(ConfigError, match="store_sse is read by s3:// checkpoint stores only, "
                                          "not by file:// ones, got 'AES256' .--store-sse"):
        TrainConfig.from_sources(env={"HVD_RESILIENT_STORE_SSE": "AES256"})
    with pytest.raises(ConfigError, match="store_sse must be AES256 or aws:kms .or empty"):
        TrainConfig.from_sources(env={"HVD_RESILIENT_CHECKPOINT_URL": "s3://b/p",
                                      "HVD_RESILIENT_STORE_SSE": "rot13"})
    with pytest.raises(ConfigError, match="store_sse_kms_key_id needs sse=aws:kms"):
        TrainConfig.from_sources(env={"HVD_RESILIENT_CHECKPOINT_URL": "s3://b/p",
                                      "HVD_RESILIENT_STORE_SSE": "AES256",
                                      "HVD_RESILIENT_STORE_SSE_KMS_KEY_ID": "k"})


@pytest.mark.parametrize("setting, flag, value", [
    ("run_dir", "--run-dir", "/elsewhere"),
    ("checkpoint_url", "--checkpoint-url", "s3://b/other"),
    ("run_id", "--run-id", "other"),
])
def test_a_supervised_worker_cannot_choose_its_own_run_folder_or_checkpoints(
        tmp_path, setting, flag, value):
    env = {"HVD_RESILIENT_SUPERVISED": "1", "HVD_RESILIENT_RUN_ID": "r",
           "HVD_RESILIENT_RUN_DIR": str(tmp_path / "run"),
           "HVD_RESILIENT_CHECKPOINT_URL": "s3://b/p"}
    with pytest.raises(ConfigError, match=f"sets {setting}=.* but hvd-resilient run uses"):
        _parse([flag, value], env)
    same = {"run_dir": str(tmp_path / "run") + "/", "checkpoint_url": "s3://b/p/",
            "run_id": "r"}[setting]
    assert _parse([flag, same], env).run_id == "r"  # the same value, spelled differently
    assert _parse([flag, value], {**env, "HVD_RESILIENT_SUPERVISED": "0"})  # unsupervised


def test_bad_recovery_values_stop_with_one_line():
    with pytest.raises(ConfigError, match="recovery_heartbeat_timeout_seconds must be 0"):
        TrainConfig.from_sources(env={"HVD_RESILIENT_RECOVERY_HEARTBEAT_TIMEOUT_SECONDS": "0.1"})
    with pytest.raises(ConfigError, match="unknown field recovery_heartbeat "):
        TrainConfig.from_sources(recovery={"heartbeat": 1})
