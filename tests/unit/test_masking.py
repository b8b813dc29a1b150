"""One masking rule for credentials, wherever text leaves a process (hvd_resilient.masking)."""

from __future__ import annotations

import json
import logging

import pytest

from hvd_resilient.checkpoint.stores import StoreConfigError, open_store, redact_url
from hvd_resilient.config import CheckpointOptions, TrainConfig
from hvd_resilient.events import EventLog
from hvd_resilient.masking import (
    has_credentials,
    install_log_scrubber,
    is_secret_name,
    mask_env,
    mask_text,
    mask_url,
)

SECRET = "wJalrXUtnFEMI-K7MDENG"


@pytest.mark.parametrize("url,shown", [
    (f"s3://AKIAX:{SECRET}@bucket/x", "s3://***@bucket/x"),
    (f"file://user:{SECRET}@/data/ckpt", "file://***@/data/ckpt"),
    (f"http://user:{SECRET}@host:8080/p@x", "http://***@host:8080/p@x"),
    # an AWS secret with '/' written raw: parsers see host AKIAX, port "ab"; still masked
    (f"s3://AKIAX:ab/{SECRET}@bucket/x", "s3://***@bucket/x"),
    (f"s3://AKIAX:{SECRET}@evil@bucket/x", "s3://***@bucket/x"),  # '@' inside the password
    (f"s3://{SECRET}@bucket/x", "s3://***@bucket/x"),  # a token alone
])
def test_urls_with_credentials_are_masked(url, shown):
    assert mask_url(url) == shown
    assert has_credentials(url)
    assert redact_url(url) == shown  # the store's name for the same rule


@pytest.mark.parametrize("url", [
    "s3://bucket/prefix", "file:///data/a@b/ckpt", "s3://bucket/dir@2024/x",
    "http://host:8080/a@b", "file:///plain", "not a url @ all",
])
def test_urls_without_credentials_are_left_alone(url):
    assert mask_url(url) == url and not has_credentials(url)


def test_every_url_in_free_text_and_secret_assignments():
    text = (f"failed (s3://K:{SECRET}@b/x),file://u:{SECRET}@/y; "
            f"env AWS_SECRET_ACCESS_KEY={SECRET} OMP_NUM_THREADS=2 '{f's3://K:{SECRET}@q'}'")
    out = mask_text(text)
    assert SECRET not in out
    assert "s3://***@b/x" in out and "file://***@/y" in out and "'s3://***@q'" in out
    assert "AWS_SECRET_ACCESS_KEY=***" in out and "OMP_NUM_THREADS=2" in out


def test_secret_names_by_word_not_by_substring():
    for name in ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "aws_session_token", "DB_PASSWORD",
                 "api_key", "GITHUB_TOKEN", "credentials"):
        assert is_secret_name(name), name
    for name in ("tokens_per_second", "HVD_RESILIENT_CHECKPOINT_URL", "keep_last", "PATH"):
        assert not is_secret_name(name), name
    env = mask_env({"AWS_SECRET_ACCESS_KEY": SECRET, "AWS_ENDPOINT_URL":
                    f"http://u:{SECRET}@127.0.0.1:1", "HVD_RESILIENT_RUN_ID": "r"})
    assert env == {"AWS_SECRET_ACCESS_KEY": "***", "AWS_ENDPOINT_URL": "http://***@127.0.0.1:1",
                   "HVD_RESILIENT_RUN_ID": "r"}


def test_event_log_scrubs_every_string_whatever_the_caller_passes(tmp_path):
    log = EventLog(tmp_path / "e.jsonl", rank=0, size=1)
    log.emit("checkpoint_failed", error=f"put s3://K:{SECRET}@b/x/step-1 failed",
             nested={"urls": [f"file://u:{SECRET}@/c"]}, what=ValueError(f"s3://K:{SECRET}@b"),
             aws_secret_access_key=SECRET, tokens_per_second=3.0)
    text = (tmp_path / "e.jsonl").read_text()
    assert SECRET not in text
    rec = json.loads(text)
    assert rec["error"] == "put s3://***@b/x/step-1 failed"
    assert rec["nested"] == {"urls": ["file://***@/c"]} and rec["what"] == "s3://***@b"
    assert rec["aws_secret_access_key"] == "***" and rec["tokens_per_second"] == 3.0


def test_train_config_as_recorded_is_masked():
    cfg = TrainConfig(run_dir="/tmp/x", checkpoint=CheckpointOptions(url=f"s3://K:{SECRET}@b/x"))
    assert cfg.to_dict()["checkpoint"]["url"] == "s3://***@b/x"
    assert cfg.checkpoint.url.endswith("@b/x")  # the object itself is unchanged


def test_store_config_errors_are_masked_whoever_raises_them():
    with pytest.raises(StoreConfigError) as e:
        open_store(f"s3://K:{SECRET}@bucket/x")
    assert SECRET not in str(e.value) and "s3://***@bucket/x" in str(e.value)
    assert SECRET not in str(StoreConfigError(f"bad endpoint http://u:{SECRET}@h"))


def test_log_records_are_masked(caplog):
    install_log_scrubber()
    logger = logging.getLogger("hvd_resilient.test_masking")
    with caplog.at_level(logging.INFO, logger="hvd_resilient.test_masking"):
        logger.info("opening %s", f"s3://K:{SECRET}@b/x")
        try:
            raise RuntimeError(f"cannot open s3://K:{SECRET}@b/x")
        except RuntimeError:
            logger.exception("failed")
    assert SECRET not in caplog.text
    assert "opening s3://***@b/x" in caplog.text and "cannot open s3://***@b/x" in caplog.text
