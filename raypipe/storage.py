"""Checkpoint storage anywhere: a local directory, or a URI that `pyarrow.fs` resolves (s3://,
gs://, hdfs://, abfs://, file://).

`location(text)` gives a `pathlib.Path` for a local path and a `StoragePath` for a URI. A
StoragePath carries the part of `Path`'s API that checkpoints use (`/`, `name`, `parent`,
`exists`, `read_bytes`, `iterdir`, ...) plus `write_bytes` and `rmtree`, so the checkpoint code
reads the same for both. Object stores have no rename: a file is written straight to its place,
and `raypipe.checkpoint` makes the manifest, written last, the commit marker.

Credentials come from the filesystem's usual sources on every node (AWS_* variables, an
instance role, gcloud's), or from the URI itself (`s3://KEY:SECRET@bucket/ck?endpoint_override=
host:port&scheme=http` for an S3-compatible server); `str()` of a StoragePath, for messages, leaves
out the secret and the options, and `uri` keeps both for the actors, which open the same location.
"""

from __future__ import annotations

from typing import Any, Iterator
from urllib.parse import urlsplit

from raypipe.errors import ConfigError


def is_uri(text: Any) -> bool:
    """Whether a checkpoint location names a filesystem by scheme (`s3://...`) rather than a local path."""
    return isinstance(text, str) and "://" in text


def location(text: Any) -> Any:
    """A local `Path`, or a `StoragePath` for a URI."""
    from pathlib import Path

    if isinstance(text, StoragePath):
        return text
    return StoragePath(text) if is_uri(text) else Path(text)


def check_available(uri: str, field: str) -> None:
    """Raises ConfigError when a URI needs pyarrow and it is not installed."""
    import importlib.util

    if importlib.util.find_spec("pyarrow") is None:
        raise ConfigError(f"TrainConfig.{field}={redact(uri)!r} is invalid: a URI location needs pyarrow "
                          f"(pip install 'raypipe-train[storage]'), or give a directory path.")


def redact(uri: str) -> str:
    """The URI with the secret of `user:secret@` left out, for messages."""
    parts = urlsplit(uri)
    if parts.password is None:
        return uri
    netloc = f"{parts.username}:***@{parts.hostname}{f':{parts.port}' if parts.port else ''}"
    return parts._replace(netloc=netloc).geturl()


def read_text(path: str) -> str | None:
    """The text of a file (a local path or a URI) as this process's node sees it; None if it cannot
    (missing, not mounted on this node, no credentials here)."""
    try:
        return location(path).read_text()
    except Exception:  # noqa: BLE001 - every reason is "cannot read" to the caller
        return None


class StoragePath:
    """A file or directory on a `pyarrow.fs` filesystem, named by URI."""

    def __init__(self, uri: str, _fs: Any = None, _path: str | None = None) -> None:
        parts = urlsplit(uri)
        self._base, self._query = f"{parts.scheme}://{parts.netloc}", parts.query
        self._key = parts.path.rstrip("/")
        if _fs is None:
            from pyarrow import fs

            try:
                _fs, _path = fs.FileSystem.from_uri(uri)
            except Exception as error:
                raise ConfigError(f"checkpoint location {redact(uri)!r} cannot be opened: {error}") from None
        self._fs, self._path = _fs, _path.rstrip("/")

    @property
    def uri(self) -> str:
        """The full URI (credentials included): what another process opens the same location by."""
        return f"{self._base}{self._key}{f'?{self._query}' if self._query else ''}"

    def __str__(self) -> str:  # for messages: no secret, no connection options
        return redact(f"{self._base}{self._key}")

    def __repr__(self) -> str:
        return f"StoragePath({str(self)!r})"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, StoragePath) and other.uri == self.uri

    def __hash__(self) -> int:
        return hash(self.uri)

    def __truediv__(self, rel: str) -> "StoragePath":
        rel = str(rel).strip("/")
        return StoragePath(f"{self._base}{self._key}/{rel}{f'?{self._query}' if self._query else ''}",
                           self._fs, f"{self._path}/{rel}")

    @property
    def name(self) -> str:
        return self._path.rsplit("/", 1)[-1]

    @property
    def parent(self) -> "StoragePath":
        key, path = self._key.rsplit("/", 1)[0], self._path.rsplit("/", 1)[0]
        return StoragePath(f"{self._base}{key}{f'?{self._query}' if self._query else ''}", self._fs, path)

    def with_name(self, name: str) -> "StoragePath":
        return self.parent / name

    def with_suffix(self, suffix: str) -> "StoragePath":
        stem = self.name.rsplit(".", 1)[0] if "." in self.name else self.name
        return self.with_name(stem + suffix)

    @property
    def suffix(self) -> str:
        return f".{self.name.rsplit('.', 1)[1]}" if "." in self.name else ""

    def _type(self) -> Any:
        return self._fs.get_file_info(self._path).type

    def exists(self) -> bool:
        from pyarrow.fs import FileType

        return self._type() != FileType.NotFound

    def is_file(self) -> bool:
        from pyarrow.fs import FileType

        return self._type() == FileType.File

    def is_dir(self) -> bool:
        from pyarrow.fs import FileType

        return self._type() == FileType.Directory

    def size(self) -> int:
        return self._fs.get_file_info(self._path).size

    def iterdir(self) -> Iterator["StoragePath"]:
        from pyarrow.fs import FileSelector

        for info in self._fs.get_file_info(FileSelector(self._path, allow_not_found=True)):
            yield self / info.path.rsplit("/", 1)[-1]

    def read_bytes(self) -> bytes:
        with self._fs.open_input_stream(self._path) as f:
            return f.read()

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def write_bytes(self, data: bytes) -> None:
        """Writes the whole object at once (an object store shows it complete or not at all)."""
        parent = self._path.rsplit("/", 1)[0]
        self._fs.create_dir(parent, recursive=True)
        with self._fs.open_output_stream(self._path) as f:
            f.write(data)

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        self._fs.create_dir(self._path, recursive=True)

    def delete(self) -> None:
        """Deletes this file (object)."""
        self._fs.delete_file(self._path)

    def rmtree(self) -> None:
        """Deletes the directory and everything under it (nothing when it is absent)."""
        if self.exists():
            self._fs.delete_dir(self._path)
