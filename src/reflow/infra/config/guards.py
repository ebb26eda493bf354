"""Rules for strings from a config that become storage paths or get saved and logged.

One place for each rule, used by the config's validation (infra/config/schema.py) and again by the storage
layer (infra/store/storage.py), so a value refused in a config file is refused the same way when a store
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
TOKEN_ENV = ("give the reward server's token in an environment variable of the driver and name that variable in "
             "reward.token_env (sent as a bearer token, never saved)")

# Query parameters that carry a key, a signature or a token: AWS presigned URLs (X-Amz-Credential,
# X-Amz-Signature, X-Amz-Security-Token; the older AWSAccessKeyId + Signature), Azure SAS (sig),
# GCS signed URLs (X-Goog-Signature), and generic token/secret/api-key parameters. Names are compared
# lower-cased without '-' and '_'.
_SECRET_PARTS = ("credential", "signature", "secret", "token", "password", "passwd", "accesskey", "apikey",
                 "privatekey")
_SECRET_NAMES = {"sig", "key", "auth", "authorization"}
# Words of a key name that mark it as a credential wherever they stand (`reward.token`, `token_env`); other
# parts count inside a name too (`aws_secret_access_key` holds "secret", `wandb_api_key` "apikey").
_SECRET_WORDS = {"token", "secret", "password", "passwd", "credential", "credentials", "signature", "sig", "auth",
                 "authorization", "apikey", "bearer", "cookie"}
# A path segment naming what the next segment is (`https://host/api/token/<token>`), and what a token looks
# like there: long, letters and digits both (a folder named `token/short` or a word is no token).
_PATH_SECRET_WORDS = {"token", "tokens", "accesstoken", "authtoken", "apikey", "apikeys", "secret", "secrets",
                      "password", "signature", "sig", "key", "keys"}
_RANDOM = re.compile(r"(?=[^/]*[0-9])(?=[^/]*[A-Za-z])[A-Za-z0-9._~+=%-]{16,}")
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://[^/?#\s]*(\S*)")
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


def secret_name(name: str) -> bool:
    """Whether a key or parameter name looks like it holds a credential (`token`, `aws_secret_access_key`,
    `X-Amz-Signature`, `api_key`, `sig`); `max_new_tokens` or `prompt_key` do not."""
    words = [w for w in re.split(r"[^a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()) if w]
    flat = "".join(words)
    return (flat in _SECRET_NAMES or any(w in _SECRET_WORDS for w in words)
            or any(part in flat for part in _SECRET_PARTS if part != "token"))  # not `max_new_tokens`


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
    url = _URL.fullmatch(location)
    return _url_problem(url.group(1).lower(), url.group(2)) if url else None


def _url_problem(scheme: str, rest: str) -> str | None:
    """A token in the fragment or the path of a URL (a string that is one URL, nothing around it)."""
    rest, hashed, fragment = rest.partition("#")
    if hashed and scheme in ("http", "https"):  # never sent to the server: there, a fragment has no use at all
        return "a '#' fragment: HTTP never sends one to the server, so it could only carry a token into storage"
    if any(secret_name(key) for key, _ in parse_qsl(fragment, keep_blank_values=True)):
        return "a credential in the '#' fragment"
    segments = rest.partition("?")[0].split("/")[1:]  # after the host (or bucket)
    for i, segment in enumerate(segments):
        name, eq, _ = segment.partition("=")
        if eq and secret_name(name):
            return f"a path segment {name + '=…'!r}"
        if (segment.lower().replace("-", "").replace("_", "") in _PATH_SECRET_WORDS and i + 1 < len(segments)
                and _RANDOM.fullmatch(segments[i + 1])):
            return f"a token after {'/' + segment + '/'!r} in the path"
    return None


def credentials_message(what: str, problem: str) -> str:
    """The refusal of a location with credentials: names the field and the part, not the secret."""
    fix = TOKEN_ENV if what == "reward.url" else CREDENTIAL_CHAIN
    return (f"{what} embeds credentials ({problem}); they would be saved in config.yaml, checkpoints and "
            f"flow-run parameters. Remove them and {fix}")
