"""The CheckpointStore contract, run against every backend (local disk and a real S3 server),
plus the S3 failure modes an operator meets: missing bucket, bad or absent credentials,
forbidden writes, an unreachable endpoint."""

from __future__ import annotations

import hashlib
import logging
import os
import random

import pytest
import xxhash

from hvd_resilient.checkpoint.stores import (
    CheckpointStore,
    SizeMismatchError,
    StoreConfigError,
    StoreNotFoundError,
    StorePermissionError,
    TransientStoreError,
    open_store,
)

MiB = 1 << 20


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path) -> CheckpointStore:
    if request.param == "file":
        st = open_store(f"file://{tmp_path}/store")
    else:
        # Small parts so that a few tens of MB exercise multipart upload and ranged GETs.
        st = open_store(request.getfixturevalue("s3_url"), part_size=5 * MiB, threads=4)
    yield st
    st.close()


def _blob(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def test_put_get_roundtrip_and_overwrite(store: CheckpointStore) -> None:
    store.put("a/x.bin", b"hello")
    assert store.get("a/x.bin") == b"hello"
    store.put("a/x.bin", bytearray(b"second"))  # overwrite, other buffer types
    store.put("a/y.bin", memoryview(b"view"))
    store.put("a/empty", b"")
    assert store.get("a/x.bin") == b"second"
    assert store.get("a/y.bin") == b"view"
    assert store.get("a/empty") == b""
    assert store.get_into("a/x.bin", 6) == b"second"
    assert store.get_into("a/empty", 0) == b""


def test_list_is_a_string_prefix_match(store: CheckpointStore) -> None:
    for key in ["a/1", "a/2", "a/sub/3", "ab", "b/1"]:
        store.put(key, key.encode())
    assert store.list("a/") == ["a/1", "a/2", "a/sub/3"]
    assert store.list("a") == ["a/1", "a/2", "a/sub/3", "ab"]
    assert store.list("a/s") == ["a/sub/3"]
    assert store.list() == ["a/1", "a/2", "a/sub/3", "ab", "b/1"]
    assert store.list("zzz") == []


def test_exists_and_idempotent_delete(store: CheckpointStore) -> None:
    store.put("d/1", b"1")
    store.put("d/2", b"2")
    assert store.exists("d/1") and not store.exists("d/nope")
    store.delete(["d/1", "d/never-existed"])
    assert not store.exists("d/1")
    assert store.list("d/") == ["d/2"]
    store.delete([])
    store.delete(["d/2"])
    assert store.list() == []


def test_not_found_and_size_mismatch(store: CheckpointStore) -> None:
    with pytest.raises(StoreNotFoundError, match="nope"):
        store.get("nope")
    with pytest.raises(StoreNotFoundError):
        store.get_into("nope", 10)
    store.put("k", b"12345")
    with pytest.raises(SizeMismatchError):
        store.get_into("k", 4)
    with pytest.raises(SizeMismatchError):
        store.get_into("k", 6)


def test_large_object_multipart_and_ranged(store: CheckpointStore, tmp_path) -> None:
    data = _blob(23 * MiB + 12345)  # not a multiple of the part size
    store.put("big/blob", data)
    assert store.get_into("big/blob", len(data)) == data
    assert store.get("big/blob") == data
    src = tmp_path / "src.bin"
    src.write_bytes(data[: 11 * MiB])
    store.put_file("big/file", str(src))
    assert store.get("big/file") == data[: 11 * MiB]
    with pytest.raises(SizeMismatchError):
        store.get_into("big/blob", len(data) - 1)


def test_get_into_a_reused_buffer(store: CheckpointStore) -> None:
    data = _blob(12 * MiB + 7, seed=3)  # above the S3 fixture's multipart threshold
    store.put("big", data)
    store.put("small", b"abc")
    buf = bytearray(len(data))
    out = store.get_into("big", len(data), memoryview(buf))
    assert out.obj is buf and buf == data
    small = memoryview(buf)[:3]
    assert bytes(store.get_into("small", 3, small)) == b"abc"
    with pytest.raises(ValueError, match="out holds 3 bytes, expected 4"):
        store.get_into("small", 4, small)
    with pytest.raises(SizeMismatchError):
        store.get_into("big", len(data) - 1, memoryview(buf)[:-1])


@pytest.mark.parametrize("size", [3 * MiB + 5, 23 * MiB + 1])  # one GET / ranged GETs (S3)
def test_get_hashed_matches_the_digest_of_the_object(store: CheckpointStore, size: int) -> None:
    data = _blob(size, seed=4)
    store.put("obj", data)
    sha256, xxh3 = hashlib.sha256(data).hexdigest(), xxhash.xxh3_128(data).hexdigest()
    buf, digest = store.get_hashed("obj", size)  # sha256 unless told: what data shards record
    assert buf == data and digest == sha256
    out = memoryview(bytearray(size))
    buf, digest = store.get_hashed("obj", size, out)
    assert buf is out and digest == sha256
    buf, digest = store.get_hashed("obj", size, out, algorithm="xxh3_128")
    assert buf is out and buf == data and digest == xxh3
    assert store.get_hashed("obj", size, algorithm="sha256")[1] == sha256
    with pytest.raises(SizeMismatchError):
        store.get_hashed("obj", size - 1)
    with pytest.raises(SizeMismatchError):
        store.get_hashed("obj", size - 1, algorithm="xxh3_128")
    with pytest.raises(ValueError, match="unknown digest algorithm 'md5'"):
        store.get_hashed("obj", size, algorithm="md5")


def test_s3_feeds_ranges_in_order_while_they_arrive(s3_server, s3_url) -> None:
    """The streamed hash must see the object in order even though ranges complete out of
    order on parallel threads."""
    st = open_store(s3_url, part_size=5 * MiB, threads=6)
    data = _blob(27 * MiB + 3, seed=5)
    st.put("ranged", data)
    view = memoryview(bytearray(len(data)))
    pieces: list[bytes] = []
    assert st._read_into("ranged", view, lambda piece: pieces.append(bytes(piece))) is True
    assert b"".join(pieces) == data and len(pieces) == 6
    st.close()


def test_s3_large_put_really_is_multipart(s3_server, s3_url) -> None:
    st = open_store(s3_url, part_size=5 * MiB)
    st.put("m", _blob(12 * MiB))
    bucket, _, prefix = s3_url[len("s3://"):].partition("/")
    etag = s3_server.client().head_object(Bucket=bucket, Key=f"{prefix}/m")["ETag"]
    assert etag.strip('"').endswith("-3")  # 3 parts of <= 5 MiB


def test_invalid_keys_are_refused(store: CheckpointStore) -> None:
    for bad in ["", "/abs", "a/../b", "a//b", "./a", "a\\b"]:
        with pytest.raises(ValueError):
            store.put(bad, b"x")


def test_file_store_writes_atomically_and_cleans_up(tmp_path) -> None:
    st = open_store(str(tmp_path / "s"))  # a plain path works too
    assert st.url == f"file://{tmp_path}/s"
    st.put("step/one", b"1")
    assert sorted(os.listdir(tmp_path / "s" / "step")) == ["one"]  # no temp file left
    (tmp_path / "s" / "step" / ".one.tmp-deadbeef").write_bytes(b"torn")  # a crashed writer
    assert st.list() == ["step/one"]
    st.delete(["step/one"])
    assert st.list() == []


def test_file_store_prunes_empty_folders(tmp_path) -> None:
    st = open_store(f"file://{tmp_path}/s")
    st.put("a/b/c", b"1")
    st.delete(["a/b/c"])
    assert os.listdir(tmp_path / "s") == []


def test_bad_urls_give_one_clear_line(tmp_path) -> None:
    for url, words in [
        ("gs://bucket/x", "unsupported checkpoint URL scheme 'gs'"),
        ("s3:///nobucket", "has no bucket"),
        ("s3://AKID:hunter2@bucket/x", "embeds credentials"),
        ("", "empty"),
    ]:
        with pytest.raises(StoreConfigError) as e:
            open_store(url)
        assert words in str(e.value) and "\n" not in str(e.value)
        assert "hunter2" not in str(e.value)
    (tmp_path / "f").write_text("x")
    with pytest.raises(StoreConfigError, match="not a directory"):
        open_store(str(tmp_path / "f"))


# ---- S3 configuration and permission errors -----------------------------------------------


def _assert_clean(e: BaseException, *secrets: str) -> None:
    text = f"{e}|{e!r}"
    assert "\n" not in str(e)
    for s in secrets:
        assert s not in text


def test_missing_bucket_is_a_config_error(s3_server) -> None:
    with pytest.raises(StoreConfigError) as e:
        open_store("s3://no-such-bucket-here/run1")
    assert "bucket 'no-such-bucket-here' does not exist" in str(e.value)
    assert s3_server.endpoint in str(e.value)
    _assert_clean(e.value, s3_server.secret_key, s3_server.access_key)


@pytest.mark.parametrize("which", ["secret", "key"])
def test_bad_credentials_are_a_config_error(s3_server, s3_url, monkeypatch, which) -> None:
    bad_secret = "wrong-secret-0123456789"
    bad_key = "AKWRONG0123456789"
    if which == "secret":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", bad_secret)
    else:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", bad_key)
    with pytest.raises(StoreConfigError) as e:
        open_store(s3_url)
    assert "rejected the AWS credentials" in str(e.value)
    _assert_clean(e.value, bad_secret, bad_key, s3_server.secret_key, s3_server.access_key)


def test_missing_credentials_are_a_config_error(s3_url, monkeypatch, tmp_path) -> None:
    for var in ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"]:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with pytest.raises(StoreConfigError, match="no usable AWS credentials"):
        open_store(s3_url)


def test_forbidden_write_is_a_permission_error_not_not_found(s3_server, s3_url, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.reader_access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.reader_secret_key)
    st = open_store(s3_url, retries=0)  # the reader may list, so the startup check passes
    assert st.list() == []
    with pytest.raises(StorePermissionError) as e:
        st.put("x", b"1")
    assert "access denied" in str(e.value)
    _assert_clean(e.value, s3_server.reader_secret_key, s3_server.reader_access_key)
    assert s3_server.reader_secret_key not in repr(st)


def test_server_side_encryption_roundtrip(s3_server, s3_url) -> None:
    st = open_store(s3_url, sse="AES256", part_size=5 * MiB)
    st.put("small", b"secret-ish")
    st.put("large", _blob(11 * MiB))
    assert st.get("small") == b"secret-ish"
    assert st.get("large") == _blob(11 * MiB)
    with pytest.raises(StoreConfigError):
        open_store(s3_url, sse="rot13")


def test_unreachable_endpoint_is_transient_and_retried(s3_url, free_port_url, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="hvd_resilient.checkpoint.stores.base")
    with pytest.raises(TransientStoreError) as e:
        open_store(
            s3_url, endpoint_url=free_port_url, retries=2, backoff_base=0.01,
            max_attempts=1, connect_timeout=1,
        )
    assert "cannot reach" in str(e.value) and free_port_url in str(e.value)
    retries = [r for r in caplog.records if "retry" in r.getMessage()]
    assert len(retries) == 2


@pytest.fixture
def free_port_url() -> str:
    import socket

    with socket.socket() as s:  # bound, never listening: connections are refused
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}"
