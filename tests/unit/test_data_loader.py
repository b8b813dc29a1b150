"""The loader without worker processes (num_workers=0): plans follow the sampler through
restores and resizes, bad samples are skipped and counted or stop the job with one line, the
training process's random streams are left as they were. The same code with worker processes
is in tests/integration/test_data_loader.py."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest
import torch

from hvd_resilient.config import DataOptions, TrainConfig, settings
from hvd_resilient.data.errors import DataError
from hvd_resilient.data.loader import ElasticLoader
from hvd_resilient.errors import ConfigError
from hvd_resilient.events import EventLog
from hvd_resilient.state.sampler import ElasticDataSampler


class Numbers:
    """Sample i is (i, a random draw): the draw shows how the sample's generator was seeded."""

    def __init__(self, n: int, bad: set[int] | None = None) -> None:
        self.n, self.bad = n, bad or set()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i in self.bad:
            raise ValueError(f"cannot decode {i}")
        return torch.tensor([float(i), torch.rand(()).item()])


def drive(loader: ElasticLoader, s: ElasticDataSampler, plan: list[tuple[str, int]]
          ) -> tuple[list[int], list[tuple[int, float]]]:
    """Runs steps as rank 0 of the world sizes in `plan` ("step", W) or ("restore", k: back to
    the commit taken at step k); returns every id the final history used (rank 0 from the
    loaded data, the other ranks from the sampler) and rank 0's (id, draw) pairs."""
    commits: dict[int, tuple[dict, int, int]] = {}
    used: list[int] = []
    draws: list[tuple[int, float]] = []
    step = 0
    for what, arg in plan:
        if what == "restore":
            sd, n_used, n_draws = commits[arg]
            s.load_state_dict(copy.deepcopy(sd))
            del used[n_used:], draws[n_draws:]
            step = arg
            continue
        if s.epoch_done():
            break
        commits[step] = (copy.deepcopy(s.state_dict()), len(used), len(draws))
        b = loader.next_batch(0, arg)
        if b.used:
            ids = b.data[:, 0].long().tolist()
            assert ids == b.used
            draws += list(zip(ids, b.data[:, 1].tolist(), strict=True))
            used += ids
        used += [i for r in range(1, arg) for i in s.next_slice(r, arg, 4).indices]
        s.next_slice(0, arg, 4)
        s.advance(b.global_count)
        step += 1
    return used, draws


def test_restores_and_resizes_start_new_plans_and_lose_nothing():
    s = ElasticDataSampler(60, seed=3)
    loader = ElasticLoader(Numbers(60), s, batch_size=4)
    plan = [("step", 2)] * 3 + [("step", 3)] * 2 + [("restore", 4)] + [("step", 1)] * 2 + \
        [("step", 2)] * 20
    used, _ = drive(loader, s, plan)
    assert sorted(used) == list(range(60))
    assert loader.replans == 3  # to size 3; back to the commit (now at size 1); to size 2
    loader.close()


def test_augmentation_draws_depend_on_the_sample_not_on_when_it_is_loaded():
    runs = []
    for plan in ([("step", 1)] * 30, [("step", 2)] * 5 + [("restore", 2)] + [("step", 3)] * 30):
        s = ElasticDataSampler(40, seed=1)
        with ElasticLoader(Numbers(40), s, batch_size=4, seed=7) as loader:
            runs.append(dict(drive(loader, s, plan)[1]))
    common = set(runs[0]) & set(runs[1])
    assert len(common) > 5
    assert all(runs[0][i] == runs[1][i] for i in common)


def test_loading_leaves_the_training_process_random_streams_alone():
    s = ElasticDataSampler(20)
    loader = ElasticLoader(Numbers(20), s, batch_size=4)
    torch.manual_seed(123)
    random.seed(5)
    loader.next_batch(0, 1)
    after = (torch.rand(()).item(), random.random())
    torch.manual_seed(123)
    random.seed(5)
    assert after == (torch.rand(()).item(), random.random())


def test_an_empty_slice_gets_a_filler_weighted_zero():
    s = ElasticDataSampler(3, shuffle=False)  # 3 samples, 4 ranks: rank 3 has none
    loader = ElasticLoader(Numbers(3), s, batch_size=8)
    b = loader.next_batch(3, 4)
    assert b.indices == [] and b.used == [] and b.weight == 0.0
    assert b.data.shape == (1, 2), "one real sample, for the forward and backward"


def events_of(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_bad_samples_skipped_are_counted_in_events(tmp_path: Path):
    log = tmp_path / "events.jsonl"
    s = ElasticDataSampler(12, shuffle=False)
    loader = ElasticLoader(Numbers(12, bad={1, 2, 9}), s, batch_size=4,
                           options=DataOptions(on_bad_sample="skip"), events=EventLog(log))
    seen = []
    while not s.epoch_done():
        b = loader.next_batch(0, 1)
        seen += b.used
        assert b.weight == len(b.used) / 4
        s.advance(b.global_count)
    assert seen == [0, 3, 4, 5, 6, 7, 8, 10, 11]
    bad = [e for e in events_of(log) if e["event"] == "bad_sample"]
    assert [e["count"] for e in bad] == [2, 1] and bad[-1]["skipped_total"] == 3
    assert bad[0]["samples"][0] == {"index": 1, "shard": None,
                                    "error": "ValueError: cannot decode 1"}
    assert loader.skipped == 3


def test_a_bad_sample_is_fatal_by_default_with_one_line_naming_it(tmp_path: Path):
    s = ElasticDataSampler(12, shuffle=False)
    loader = ElasticLoader(Numbers(12, bad={6}), s, batch_size=4,
                           events=EventLog(tmp_path / "e.jsonl"))
    s.advance(loader.next_batch(0, 1).global_count)
    with pytest.raises(DataError) as err:
        loader.next_batch(0, 1)
    msg = str(err.value)
    assert "\n" not in msg and "sample 6" in msg and "ValueError: cannot decode 6" in msg
    assert "--data-on-bad-sample skip" in msg
    assert err.value.exit_code == 78
    fatal = [e for e in events_of(tmp_path / "e.jsonl") if e["event"] == "bad_sample"]
    assert fatal and fatal[0]["action"] == "fatal"


def test_the_data_section_is_a_config_section_with_checked_values():
    names = {st.name for st in settings() if st.section == "data"}
    assert {"data_num_workers", "data_prefetch_factor", "data_pin_memory",
            "data_persistent_workers", "data_on_bad_sample"} <= names
    cfg = TrainConfig.from_sources(env={"HVD_RESILIENT_DATA_NUM_WORKERS": "3"},
                                   data={"on_bad_sample": "skip"})
    assert (cfg.data.num_workers, cfg.data.on_bad_sample) == (3, "skip")
    with pytest.raises(ConfigError, match="data_on_bad_sample"):
        DataOptions(on_bad_sample="ignore")
    with pytest.raises(ConfigError, match="data_num_workers"):
        TrainConfig.from_sources(env={}, data_num_workers=-1)
