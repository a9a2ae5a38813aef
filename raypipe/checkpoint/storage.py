"""Checkpoint storage anywhere: a local directory, or a URI that `pyarrow.fs` resolves (s3://,
gs://, hdfs://, abfs://, file://).

`location(text)` gives a `pathlib.Path` for a local path and a `StoragePath` for a URI. A
StoragePath carries the part of `Path`'s API that checkpoints use (`/`, `name`, `parent`,
`exists`, `read_bytes`, `iterdir`, ...) plus `write_bytes` and `rmtree`, so the checkpoint code
reads the same for both. Object stores have no rename: a file is written straight to its place,
and `raypipe.checkpoint.layout` makes the manifest, written last, the commit marker.

Credentials come from the filesystem's usual sources on every node (AWS_* variables, an
instance role, gcloud's), or from the URI itself (`s3://KEY:SECRET@bucket/ck?endpoint_override=
host:port&scheme=http` for an S3-compatible server); `str()` of a StoragePath, for messages, leaves
out the secret and the options, and `uri` keeps both for the actors, which open the same location.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import quote, unquote

from raypipe.core.errors import ConfigError


def is_uri(text: object) -> bool:
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
        raise ConfigError(
            f"TrainConfig.{field}={redact(uri)!r} is invalid: a URI location needs pyarrow "
            f"(pip install 'raypipe-train[storage]'), or give a directory path."
        )


@dataclass(frozen=True)
class UriParts:
    """A location URI cut into its parts: `scheme://[user[:secret]@]rest[?query]`.

    `rest` is the host (or bucket) and the path. The userinfo is everything before the *last*
    `@` after `://`, so a secret may hold `/`, `+`, `=`, `?`, `#` and `@` (AWS secrets often hold
    `/`); such a part is taken as userinfo only when it has a `:` or no `/` (a path may hold `@`).
    `%XX` escapes in the user and secret are decoded.
    """

    scheme: str
    user: str | None
    secret: str | None
    rest: str
    query: str

    def shown(self, query: bool = True) -> str:
        """The URI for messages and records: the secret (a lone user too) as `***`, secret-looking
        query options too."""
        who = "" if self.user is None else (f"{self.user}:***@" if self.secret is not None else "***@")
        options = "&".join(_shown_option(o) for o in self.query.split("&") if o) if query else ""
        return f"{self.scheme}://{who}{self.rest}{f'?{options}' if options else ''}"

    def opened(self) -> str:
        """The URI as a URI parser reads it: the user and secret %-escaped."""
        who = (
            ""
            if self.user is None
            else quote(self.user, safe="") + ("" if self.secret is None else ":" + quote(self.secret, safe="")) + "@"
        )
        return f"{self.scheme}://{who}{self.rest}{f'?{self.query}' if self.query else ''}"

    def secrets(self) -> list[str]:
        """Every form in which the secret could appear in a message (raw and %-escaped)."""
        values = [v for v in (self.secret, None if self.secret is not None else self.user) if v]
        return sorted({form for v in values for form in (v, quote(v, safe=""), quote(v))}, key=len, reverse=True)


_SECRET_OPTION = re.compile(r"secret|password|token|credential|session|access_key|key$", re.IGNORECASE)


def _shown_option(option: str) -> str:
    name, _, value = option.partition("=")
    return f"{name}=***" if value and _SECRET_OPTION.search(name) else option


def split_uri(text: str) -> UriParts:
    """`text` cut into `UriParts` (see there for the rules).

    Raises:
        ConfigError: `text` has no `scheme://` or no location after its credentials; the message
            shows no secret.
    """
    scheme, sep, after = text.partition("://")
    if not sep or not scheme:
        raise ConfigError(f"{_blind(text)!r} is not a URI (scheme://location)")
    user = secret = None
    if "@" in after:
        userinfo, rest = after.rsplit("@", 1)
        if ":" in userinfo or "/" not in userinfo:
            user, colon, secret = userinfo.partition(":")
            user, secret = unquote(user), (unquote(secret) if colon else None)
            after = rest
    rest, _, query = after.partition("?")
    if not rest.strip("/"):
        shown = UriParts(scheme, user, secret, "", "").shown()
        raise ConfigError(
            f"{shown!r} names no bucket or host after its credentials: write scheme://KEY:SECRET@bucket/path"
        )
    return UriParts(scheme, user, secret, rest, query)


def _blind(text: str) -> str:
    """A string that failed to parse as a URI, with anything that may be a secret hidden."""
    return re.sub(r"(?<=://)[^@]*@", "***@", text) if "@" in text else text


def redact(text: str) -> str:
    """A location as it may be shown or stored: a URI's secret (and secret query options) as `***`;
    a local path unchanged. Every message, record and logger parameter goes through this."""
    if not is_uri(text):
        return text
    try:
        return split_uri(text).shown()
    except ConfigError:
        return _blind(text)


def scrub(message: str, uri: str) -> str:
    """`message` (e.g. a library's error text about `uri`) with `uri`'s secret replaced by `***`."""
    try:
        parts = split_uri(uri)
    except ConfigError:
        return _blind(message)
    for form in parts.secrets():
        message = message.replace(form, "***")
    return message


def redact_values(value: Any) -> Any:
    """`value` (a dict, list or scalar, e.g. a config's fields) with `redact` applied to every URI
    string in it: for trainer.json, logger parameters and printed configs."""
    if isinstance(value, dict):
        return {k: redact_values(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_values(v) for v in value)
    return redact(value) if is_uri(value) else value


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
        parts = split_uri(uri)
        host, slash, key = parts.rest.partition("/")
        self._parts = replace(parts, rest=host)  # scheme, credentials, bucket, options: all but the key
        self._key = f"/{key}".rstrip("/") if slash else ""
        if _fs is None:
            from pyarrow import fs

            try:
                _fs, _path = fs.FileSystem.from_uri(self.uri)
            except Exception as error:  # noqa: BLE001 - pyarrow's message may quote the URI: scrubbed
                raise ConfigError(
                    f"checkpoint location {str(self)!r} cannot be opened: {scrub(str(error), uri)}"
                ) from None
        self._fs, self._path = _fs, _path.rstrip("/")

    def _at(self, key: str) -> UriParts:
        return replace(self._parts, rest=f"{self._parts.rest}{key}")

    @property
    def uri(self) -> str:
        """The full URI (credentials %-escaped, options kept): what another process opens the same
        location by. Never shown: `str()` is what messages use."""
        return self._at(self._key).opened()

    def __str__(self) -> str:  # for messages: no secret, no connection options
        return self._at(self._key).shown(query=False)

    def __repr__(self) -> str:
        return f"StoragePath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StoragePath) and other.uri == self.uri

    def __hash__(self) -> int:
        return hash(self.uri)

    def __truediv__(self, rel: str) -> StoragePath:
        rel = str(rel).strip("/")
        return StoragePath(self._at(f"{self._key}/{rel}").opened(), self._fs, f"{self._path}/{rel}")

    @property
    def name(self) -> str:
        return self._path.rsplit("/", 1)[-1]

    @property
    def parent(self) -> StoragePath:
        key, path = self._key.rsplit("/", 1)[0], self._path.rsplit("/", 1)[0]
        return StoragePath(self._at(key).opened(), self._fs, path)

    def with_name(self, name: str) -> StoragePath:
        return self.parent / name

    def with_suffix(self, suffix: str) -> StoragePath:
        stem = self.name.rsplit(".", 1)[0] if "." in self.name else self.name
        return self.with_name(stem + suffix)

    @property
    def suffix(self) -> str:
        return f".{self.name.rsplit('.', 1)[1]}" if "." in self.name else ""

    def _type(self) -> object:
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

    def iterdir(self) -> Iterator[StoragePath]:
        from pyarrow.fs import FileSelector

        for info in self._fs.get_file_info(FileSelector(self._path, allow_not_found=True)):
            yield self / info.path.rsplit("/", 1)[-1]

    def read_bytes(self) -> bytes:
        with self._fs.open_input_stream(self._path) as f:
            return f.read()

    def read_range(self, offset: int, size: int) -> bytes:
        """`size` bytes from `offset` (a file's header without reading the file)."""
        with self._fs.open_input_file(self._path) as f:
            return f.read_at(size, offset)

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

    def files(self) -> list[str]:
        """The paths, relative to this directory, of every file under it."""
        from pyarrow.fs import FileSelector, FileType

        infos = self._fs.get_file_info(FileSelector(self._path, recursive=True, allow_not_found=True))
        return [i.path[len(self._path) + 1 :] for i in infos if i.type == FileType.File]

    def move(self, target: StoragePath) -> None:
        """Moves this file to `target` on the same filesystem (in an object store a copy, then a delete)."""
        self._fs.move(self._path, target._path)

    def delete(self) -> None:
        """Deletes this file (object)."""
        self._fs.delete_file(self._path)

    def rmtree(self) -> None:
        """Deletes the directory and everything under it (nothing when it is absent)."""
        if self.exists():
            self._fs.delete_dir(self._path)
