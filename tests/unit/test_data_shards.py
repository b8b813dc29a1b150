"""Webdataset shards: written with webdataset, read back by id here and by webdataset itself;
the fast tar scan agrees with tarfile; a bad shard is named, never read as good data."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest
import webdataset as wds

from hvd_resilient.data.errors import BadShardError, DataError
from hvd_resilient.data.shards import (
    INDEX_KEY,
    ShardedDataset,
    read_index,
    scan_tar,
    write_shards,
)


def samples(n: int, tag: str = ""):
    for i in range(n):
        yield {"__key__": f"s{i:05d}", "txt": f"{tag}text {i}", "cls": i}


def test_written_shards_read_back_by_id_here_and_by_webdataset(tmp_path: Path):
    url = (tmp_path / "data").as_uri()
    index = write_shards(samples(250), url, samples_per_shard=100)
    assert [s.samples for s in index.shards] == [100, 100, 50]
    assert read_index(url).shards == index.shards
    ds = ShardedDataset(url, decode=lambda s: (int(s["cls"]), s["txt"].decode()))
    assert len(ds) == 250
    assert [ds[i] for i in (0, 99, 100, 249)] == [(0, "text 0"), (99, "text 99"),
                                                  (100, "text 100"), (249, "text 249")]
    assert ds.shard_name(150).endswith("/shard-000001.tar")
    theirs = list(wds.WebDataset(str(tmp_path / "data" / "shard-000001.tar"),
                                 shardshuffle=False))
    assert [x["__key__"] for x in theirs] == [f"s{i:05d}" for i in range(100, 200)]
    assert theirs[5]["txt"] == ds.raw(105)["txt"]


def test_local_files_without_an_index_are_counted(tmp_path: Path):
    url = (tmp_path / "d").as_uri()
    write_shards(samples(30), url, samples_per_shard=12)
    files = sorted(str(p) for p in (tmp_path / "d").glob("*.tar"))
    ds = ShardedDataset(files)
    assert len(ds) == 30 and ds.raw(29)["cls"] == b"29"


def test_rewriting_the_same_data_is_accepted_other_data_refused(tmp_path: Path):
    """Every rank of a job may prepare the same shards: identical bytes agree."""
    url = (tmp_path / "d").as_uri()
    first = write_shards(samples(20), url, samples_per_shard=8)
    assert write_shards(samples(20), url, samples_per_shard=8).shards == first.shards
    with pytest.raises(DataError, match="already holds other shards"):
        write_shards(samples(20, tag="other "), url, samples_per_shard=8)


def test_a_location_without_index_holds_no_shards(tmp_path: Path):
    with pytest.raises(DataError, match=INDEX_KEY):
        read_index((tmp_path / "nothing").as_uri())


def tar_bytes(members: list[tuple[str, bytes]], fmt: int, mtime: float = 0.0) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size, ti.mtime = len(data), mtime
            tf.addfile(ti, io.BytesIO(data))
        d = tarfile.TarInfo("a/dir")
        d.type = tarfile.DIRTYPE
        tf.addfile(d)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_the_fast_scan_agrees_with_tarfile(tmp_path: Path, fmt: int):
    long = "d/" + "x" * 150 + ".txt"  # a long name: ustar prefix, GNU 'L', or pax path
    members = [("k1.txt", b"one"), ("k1.cls", b"1"), (long, b"y" * 1000), ("e.bin", b"")]
    if fmt == tarfile.USTAR_FORMAT:
        members[2] = ("p" * 120 + "/k2.txt", b"y" * 1000)
    path = tmp_path / "t.tar"
    path.write_bytes(tar_bytes(members, fmt, mtime=1.5 if fmt == tarfile.PAX_FORMAT else 0))
    fd = os.open(path, os.O_RDONLY)
    try:
        ours = scan_tar(fd, "t.tar")
    finally:
        os.close(fd)
    with tarfile.open(path) as tf:
        theirs = [(m.name, m.offset_data, m.size) for m in tf.getmembers() if m.isfile()]
    assert ours == theirs


@pytest.mark.parametrize("damage", ["truncate", "garbage", "missing"])
def test_a_damaged_shard_is_named_when_read(tmp_path: Path, damage: str):
    url = (tmp_path / "d").as_uri()
    write_shards(samples(30), url, samples_per_shard=10)
    shard = tmp_path / "d" / "shard-000001.tar"
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:3000])
    elif damage == "garbage":
        shard.write_bytes(b"not a tar at all" * 100)
    else:
        shard.unlink()
    ds = ShardedDataset(url)
    assert ds.raw(5)["cls"] == b"5"  # the other shards still read
    with pytest.raises(BadShardError) as err:
        ds.raw(15)
    assert err.value.shard.endswith("shard-000001.tar")
