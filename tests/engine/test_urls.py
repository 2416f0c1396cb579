"""What looks like a URL (s3stream.urls) and its three users: object store URLs, WAL locations
and metadata URLs. A mistyped URL is refused (ConfigError naming it and the accepted forms) and
leaves nothing behind; a path stays a path, whatever characters it has."""
from __future__ import annotations

import os

import pytest
from hypothesis import given, settings, strategies as st

import s3stream
from s3stream.errors import ConfigError
from s3stream.metadata import open_metadata
from s3stream.objectstore import LocalObjectStore, open_object_store
from s3stream.urls import looks_like_url, url_scheme
from s3stream.engine.walopen import file_path, open_node_wal

SCHEME_FIRST = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
SCHEME_REST = SCHEME_FIRST + "0123456789+-."
schemes = st.builds(lambda a, b: a + b, st.sampled_from(SCHEME_FIRST), st.text(SCHEME_REST, min_size=1, max_size=10))
#: Path text without a colon (a colon is what could make a path read as a URL).
plain = st.text(st.characters(blacklist_characters=":\x00", blacklist_categories=("Cs",)), max_size=30)


def scheme_of(value: str) -> str | None:
    return url_scheme(value, what="location", schemes=("file", "s3"), accepted="file:///path or s3://bucket")


# ---- the rule --------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", [
    "data/wal", "./s3:/bkt/x", "wal", "/abs/s3:/x", "C:\\data\\wal", "C:/data/wal", "c:wal",
    "backup:2024/wal", "2024-01-01T10:00/wal", "foo:bar", "s3/bucket/x", "data//wal", "mailto:x", "",
])
def test_paths_stay_paths(path):
    assert not looks_like_url(path)
    assert scheme_of(path) is None


@pytest.mark.parametrize("value, message", [
    ("s3:/bkt/x", "'s3:' must be followed by two slashes"),
    ("s3:bkt", "'s3:' must be followed by two slashes"),
    ("S3:/bkt", "'S3:' must be followed by two slashes"),
    ("s3:", "must be followed by two slashes"),
    ("file:/abs/dir", "'file:' must be followed by two slashes"),
    ("s3//bkt/x", "without the ':' after 's3'"),
    ("S3//x", "without the ':' after 'S3'"),
    ("http://host/x", "unsupported location scheme 'http'"),
    ("foo:/x", "unsupported location scheme 'foo'"),
    ("gs://bucket", "unsupported location scheme 'gs'"),
    ("sqlite:///m.db", "unsupported location scheme 'sqlite'"),
    (" s3://bkt", "spaces around it"),
    ("s3://bkt\n", "spaces around it"),
])
def test_what_looks_like_a_url_but_is_not_accepted_is_refused(value, message):
    assert looks_like_url(value.strip())
    with pytest.raises(ConfigError) as e:
        scheme_of(value)
    assert message in str(e.value) and repr(value) in str(e.value)
    assert "file:///path or s3://bucket" in str(e.value)          # the accepted forms


@pytest.mark.parametrize("value, scheme", [("s3://bkt/x", "s3"), ("S3://BKT", "s3"), ("file:///x", "file"),
                                           ("FILE:///x", "file"), ("file://localhost/x", "file")])
def test_accepted_urls_give_their_scheme(value, scheme):
    assert scheme_of(value) == scheme


@settings(max_examples=300, deadline=None)
@given(scheme=schemes, rest=plain)
def test_a_scheme_then_a_slash_is_a_url(scheme, rest):
    """RFC 3986's scheme of 2+ characters, ':' and '/' is a URL: accepted only as scheme:// of an
    accepted scheme, else refused naming the value."""
    value = f"{scheme}:/{rest}"
    assert looks_like_url(value)
    if scheme.lower() in ("file", "s3") and rest.startswith("/") and value.strip() == value:
        assert scheme_of(value) == scheme.lower()
    else:
        with pytest.raises(ConfigError, match="file:///path or s3://bucket"):
            scheme_of(value)


@settings(max_examples=300, deadline=None)
@given(path=plain, letter=st.sampled_from(SCHEME_FIRST), tail=plain)
def test_paths_without_a_scheme_prefix_are_paths(path, letter, tail):
    """No colon, a drive letter, or './' first: a path, never refused (unless it starts with a
    known scheme and '//', a URL missing its colon)."""
    for value in (path, f"{letter}:{tail}", f"{letter}:\\{tail}", f"./{path}:/{tail}", f"a/{letter}x:/{tail}"):
        if value.strip().lower().startswith(("s3//", "file//", "sqlite//", "postgres//", "postgresql//", "objects+")):
            continue
        assert scheme_of(value) is None, value


@settings(max_examples=200, deadline=None)
@given(scheme=schemes, rest=st.text(st.characters(blacklist_characters="/:", blacklist_categories=("Cs",)),
                                    min_size=1, max_size=20))
def test_an_unknown_scheme_without_a_slash_is_a_path(scheme, rest):
    """`name:rest` with no slash after the colon is a file name with a colon, unless the name is
    a scheme s3stream knows (`s3:bucket` is a mistyped URL)."""
    value = f"{scheme}:{rest}"
    if scheme.lower() in ("file", "s3", "sqlite", "postgres", "postgresql") or scheme.lower().startswith("objects+"):
        with pytest.raises(ConfigError):
            scheme_of(value)
    else:
        assert scheme_of(value) is None


# ---- object stores -----------------------------------------------------------------------------------

@pytest.mark.parametrize("url", ["s3:/bkt/x", "s3:bkt", "S3//bkt/x", "file:/abs/dir", "http://host/x", "ftp:/x"])
def test_object_store_refuses_a_mistyped_url_and_makes_no_directory(url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        open_object_store(url)
    assert repr(url) in str(e.value) and "s3://bucket[/prefix]" in str(e.value)
    assert os.listdir(tmp_path) == []


def test_object_store_takes_a_directory_named_like_a_url_written_as_a_relative_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = open_object_store("./s3:/bkt")
    assert isinstance(store, LocalObjectStore) and (tmp_path / "s3:" / "bkt").is_dir()
    store.close()


# ---- WALs ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("location", ["http://host/wal", "s3:/bkt/wal", "s3//bkt/wal", "file:/abs/wal", "ftp:/x/wal"])
def test_wal_refuses_a_mistyped_url_and_makes_no_file(location, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for call in (lambda: file_path(location), lambda: open_node_wal(location, node_id=1)):
        with pytest.raises(ConfigError) as e:
            call()
        assert repr(location) in str(e.value) and "objects+URL" in str(e.value)
    assert os.listdir(tmp_path) == []


def test_wal_paths_and_file_urls_stay_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert file_path("data/wal") == str(tmp_path / "data" / "wal")
    assert file_path("./s3:/wal") == str(tmp_path / "s3:" / "wal")
    assert file_path(f"file://{tmp_path}/w") == file_path(f"FILE://{tmp_path}/w") == str(tmp_path / "w")


def test_a_client_with_a_mistyped_wal_url_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="'s3:' must be followed by two slashes"):
        s3stream.StreamClient(1, "s3:/bkt/wal", f"file://{tmp_path}/objects", f"sqlite:///{tmp_path}/meta.db")
    assert not (tmp_path / "s3:").exists()


# ---- metadata ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("url, message", [
    ("postgresql:/host/db", "'postgresql:' must be followed by two slashes"),
    ("postgres:host/db", "'postgres:' must be followed by two slashes"),
    ("postgresql//host/db", "without the ':'"),
    ("sqlite:/m.db", "'sqlite:' must be followed by two slashes"),
    ("s3://bkt/meta.db", "unsupported metadata URL scheme 's3'"),
    ("http://host/meta.db", "unsupported metadata URL scheme 'http'"),
])
def test_metadata_refuses_a_mistyped_url_and_makes_no_file(url, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        open_metadata(url)
    assert message in str(e.value) and "sqlite:////absolute/path.db" in str(e.value)
    assert os.listdir(tmp_path) == []


def test_metadata_urls_hide_a_password_even_when_malformed():
    with pytest.raises(ConfigError) as e:
        open_metadata("postgresql:/user:s3cr3t@host/db")
    assert "s3cr3t" not in str(e.value) and "user:***@host" in str(e.value)


def test_a_metadata_file_whose_name_has_a_colon_stays_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = open_metadata("run:1.db")
    store.close()
    assert (tmp_path / "run:1.db").is_file()
