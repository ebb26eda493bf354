"""Rules for strings from a config that become storage paths or get saved and logged.

One place for each rule, used by the config's validation (infra/config.py) and again by the storage
layer (infra/storage.py), so a value refused in a config file is refused the same way when a store
is opened directly (the CLI's `runs show`, scripts).

- A *name* (experiment, eval set) becomes one folder under the storage root: `..` or `a/b` would
  write outside the experiment's folder, so a name is exactly one path segment.
- A *location* (a path or URL) is saved verbatim in config.yaml, in every checkpoint and in every
  Prefect flow run's parameters; a key or signature inside it would leak there, so it is refused.
  Credentials come from the AWS chain at use time instead.
"""
from __future__ import annotations

import re
from urllib.parse import parse_qsl

SEGMENT_PATTERN = r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*$"
SEGMENT_RULE = "letters, digits, '_', '.', '-', not starting with '.' (e.g. 'my-run-1')"
CREDENTIAL_CHAIN = ("use the AWS credential chain instead: env AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                    "~/.aws/credentials, or an instance role")

# Query parameters that carry a key, a signature or a token: AWS presigned URLs (X-Amz-Credential,
# X-Amz-Signature, X-Amz-Security-Token; the older AWSAccessKeyId + Signature), Azure SAS (sig),
# GCS signed URLs (X-Goog-Signature), and generic token/secret/api-key parameters. Names are compared
# lower-cased without '-' and '_'.
_SECRET_PARTS = ("credential", "signature", "secret", "token", "password", "passwd", "accesskey", "apikey",
                 "privatekey")
_SECRET_NAMES = {"sig", "key", "auth", "authorization"}
# `scheme://user:password@host` where the password holds a '/' (AWS secrets often do): urlsplit then
# sees the netloc `user:pass` and no '@'; a port (`host:9000/path@x`) is not a password.
_USERINFO_WITH_SLASH = re.compile(r"[^/@:?#]*:(?!\d+(?:[/?#]|$))[^@?#]*@")


def segment_problem(name: str) -> str | None:
    """Why `name` is not one safe path segment, or None when it is."""
    if not name:
        return "it is empty"
    if "/" in name or "\\" in name:
        return "it contains a path separator"
    if name.startswith("."):
        return "it starts with '.' ('.' and '..' name the folder itself or its parent)"
    if not re.fullmatch(SEGMENT_PATTERN, name):
        return "it has characters other than letters, digits, '_', '.', '-'"
    return None


def check_segment(name: str, what: str) -> str:
    """`name` unchanged, or ValueError saying which rule it breaks (`what`: the field, for the message)."""
    problem = segment_problem(name)
    if problem is not None:
        raise ValueError(f"{what} {name!r} must be a single path segment (it names a storage folder), but "
                         f"{problem}; use {SEGMENT_RULE}")
    return name


def credential_problem(location: str) -> str | None:
    """Which part of a path or URL holds credentials (never the credential itself), or None."""
    head, _, query = location.partition("?")
    if "://" in head:
        rest = head.split("://", 1)[1]
        if "@" in rest.split("/", 1)[0] or _USERINFO_WITH_SLASH.match(rest):
            return "a user:password@ part in the URL"
    for key, _ in parse_qsl(query.partition("#")[0], keep_blank_values=True):
        flat = key.lower().replace("-", "").replace("_", "")
        if flat in _SECRET_NAMES or any(part in flat for part in _SECRET_PARTS):
            return f"the query parameter {key!r}"
    return None


def credentials_message(what: str, problem: str) -> str:
    """The refusal of a location with credentials: names the field and the part, not the secret."""
    return (f"{what} embeds credentials ({problem}); they would be saved in config.yaml, checkpoints and "
            f"flow-run parameters. Remove them and {CREDENTIAL_CHAIN}")
