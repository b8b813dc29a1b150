"""examples/gpt.py end to end: shards written to SeaweedFS by launcher rank 0, streamed back by
two ranks through loader workers, a loss below the unigram baseline, and a second launch that
finds the shards already there."""

from __future__ import annotations

import json

import pytest

from tests.support.jobs import PYTHON, events, horovodrun_elastic, write_discovery
from tests.support.paths import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]
GPT = str(ROOT / "examples" / "gpt.py")


@pytest.mark.extended  # shards streamed from S3: test_data_elastic; the GPT example: the demo
def test_gpt_streams_its_shards_from_s3_and_learns(tmp_path, jobs, s3_url, s3_server):
    jobs.extra_env.update(s3_server.env())
    _, discover = write_discovery(tmp_path, "localhost:2")
    small = ["--corpus-mb", "1", "--dim", "64", "--layers", "2", "--batch-size", "16",
             "--data-num-workers", "2", "--data-url", f"{s3_url}/text", "--log-every", "20"]
    run = tmp_path / "run"
    job = jobs.start(horovodrun_elastic(discover, 2, 2, 2) + [
        PYTHON, GPT, "--run-id", "gpt", "--run-dir", str(run), "--max-steps", "120",
        "--checkpoint-url", f"{s3_url}/ckpt", *small], name="gpt")
    assert job.wait(400) == 0, job.output()[-3000:]
    assert "wrote " in job.output(), "launcher rank 0 should have written the shards"
    r = json.loads((run / "result.json").read_text())
    assert r["world_size"] == 2 and r["steps"] == 120
    # the unigram baseline of Python source bytes is ~3.1 nats; 120 small steps get well under
    assert r["held_out_loss"] < r["unigram_baseline"] - 0.3, r
    evs = events(run / "events.jsonl")
    assert not [e for e in evs if e["event"] in ("bad_sample", "bad_shard")]
    done = [e for e in evs if e["event"] == "done"]
    assert len(done) == 2 and len({e["params_sha256"] for e in done}) == 1

    again = tmp_path / "again"  # same text, same location: read, not written again
    job = jobs.start(horovodrun_elastic(discover, 2, 2, 2) + [
        PYTHON, GPT, "--run-id", "gpt2", "--run-dir", str(again), "--max-steps", "5", *small],
        name="again")
    assert job.wait(300) == 0, job.output()[-3000:]
    assert "wrote " not in job.output()
