"""Bad configuration stops before anything trains, with one line naming the field."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from hvd_resilient.config import TrainConfig
from hvd_resilient.errors import FATAL_EXIT_CODE, ConfigError
from hvd_resilient.launch.horovod.command import ElasticLaunch
from tests.support.jobs import PYTHON
from tests.support.paths import ROOT


def parse(argv: list[str], env: dict[str, str] | None = None) -> TrainConfig:
    p = argparse.ArgumentParser()
    TrainConfig.add_arguments(p)
    return TrainConfig.from_sources(p.parse_args(argv), env=env or {})


def test_defaults_fill_run_dir_and_checkpoint_url(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = parse(["--run-id", "r1"])
    assert cfg.run_dir == str(tmp_path / "runs" / "r1")
    assert cfg.checkpoint.url == (tmp_path / "runs" / "r1" / "checkpoints").as_uri()


def test_precedence_file_env_flags(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("epochs: 3\nbatch_size: 8\ncommit-every: 4\n")
    cfg = parse(["--config", str(f), "--batch-size", "16"],
                env={"HVD_RESILIENT_COMMIT_EVERY": "6", "HVD_RESILIENT_SHUFFLE": "false"})
    assert (cfg.epochs, cfg.batch_size, cfg.commit_every, cfg.shuffle) == (3, 16, 6, False)


@pytest.mark.parametrize("argv,needle", [
    (["--commit-every", "-3"], "commit_every must be >= 1, got -3 (--commit-every"),
    (["--checkpoint-every", "-1"], "checkpoint_every must be >= 0"),
    (["--batch-size", "abc"], "batch_size must be a whole number, got 'abc' (--batch-size)"),
    (["--lr-scaling", "sqrt"], "lr_scaling must be one of none, linear"),
    (["--checkpoint-url", "gs://b/x"], "checkpoint_url: unsupported checkpoint URL scheme 'gs'"
                                       " in 'gs://b/x'; use file:///path or s3://bucket/prefix"),
    (["--run-id", "a/b"], "run_id must be a non-empty name"),
])
def test_bad_values_name_the_field(argv, needle):
    with pytest.raises(ConfigError) as e:
        parse(argv)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_unknown_field_and_unreadable_file(tmp_path):
    f = tmp_path / "c.json"
    f.write_text('{"epoch": 3}')
    with pytest.raises(ConfigError, match="unknown field.*epoch"):
        parse(["--config", str(f)])
    with pytest.raises(ConfigError, match="cannot read config file"):
        parse(["--config", str(tmp_path / "missing.yaml")])
    f.write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid"):
        parse(["--config", str(f)])


def test_launch_validation(tmp_path):
    script = tmp_path / "d.sh"
    script.write_text("#!/bin/sh\necho localhost:2\n")
    with pytest.raises(ConfigError, match="is not an executable file"):
        ElasticLaunch(np=2, min_np=1, max_np=4, discovery_script=str(script))
    script.chmod(0o755)
    with pytest.raises(ConfigError, match=r"--min-np \(4\) is larger than --max-np \(2\)"):
        ElasticLaunch(np=2, min_np=4, max_np=2, discovery_script=str(script))
    with pytest.raises(ConfigError, match="--np 5 must lie between"):
        ElasticLaunch(np=5, min_np=1, max_np=4, discovery_script=str(script))
    ElasticLaunch(np=2, min_np=1, max_np=4, discovery_script=str(script))


def test_bad_config_stops_the_example_with_one_line_before_training(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([PYTHON, str(ROOT / "examples" / "digits.py"), "--commit-every", "0",
                        "--run-dir", str(tmp_path / "r")],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == FATAL_EXIT_CODE  # a launcher must not restart it
    assert r.stderr.strip().splitlines() == [
        "hvd-resilient: error: config: commit_every must be >= 1, got 0 "
        "(--commit-every / HVD_RESILIENT_COMMIT_EVERY)"
    ]
    assert not (tmp_path / "r").exists(), "nothing may be written before the config is valid"
    assert sys.executable


def test_unknown_field_names_the_closest_known_one(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("commit_evry: 3\nepochs: 2\n")
    with pytest.raises(ConfigError) as e:
        parse(["--config", str(f)])
    msg = str(e.value)
    assert "unknown field commit_evry (did you mean commit_every?)" in msg and "\n" not in msg
    f.write_text("zzz: 1\n")  # nothing close: no guess, the known fields are listed
    with pytest.raises(ConfigError, match=r"unknown field zzz; known: batch_size, ") as e:
        parse(["--config", str(f)])
    assert "did you mean" not in str(e.value)


def test_credentials_in_the_checkpoint_url_are_refused_masked():
    secret = "s3cr3t-Value/with+slash"
    for url in (f"s3://AKIAX:{secret}@bucket/x", f"file://u:{secret}@/data/c"):
        with pytest.raises(ConfigError) as e:
            parse(["--checkpoint-url", url, "--run-dir", "/tmp/r"])
        assert "embeds credentials" in str(e.value) and "***@" in str(e.value)
        assert "s3cr3t" not in str(e.value)


def test_config_file_typo_stops_the_example_with_one_line(tmp_path):
    f = tmp_path / "train.yaml"
    f.write_text("epochs: 1\nchekpoint_every: 5\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([PYTHON, str(ROOT / "examples" / "digits.py"), "--config", str(f),
                        "--run-dir", str(tmp_path / "r")],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == FATAL_EXIT_CODE
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"hvd-resilient: error: config: config file {f}: unknown field "
                           "chekpoint_every "
                           "(did you mean checkpoint_every?)"), line
    assert not (tmp_path / "r").exists()
