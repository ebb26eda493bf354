"""Keys that sign checkpoint manifests (issue 13, point 4): where the HMAC key comes from.

Why sign: resuming runs DeepSpeed's `engine.load_checkpoint`, which unpickles optim/*.pt
(`torch.load(weights_only=False)`), and the sha256 records that guard the download (MANIFEST.json,
COMMITTED) sit in the same bucket: whoever can write the bucket could plant a pickle and fix the
records up. So every commit also writes SIGNATURE, an HMAC-SHA256 over the exact MANIFEST.json bytes
with a key that never goes to storage, config.yaml, logs or Prefect parameters. The driver checks it
before any rank fetches a file (infra/store/checkpoint.py `check`) and hands the ranks the verified
{path: sha256} table; the ranks never read MANIFEST.json from the bucket, so the key stays on the driver.

The key, first match wins:
  1. `checkpoint.signing_key_secret`: the name of a Prefect Secret block (loaded only when named);
  2. the environment variable REFLOW_CHECKPOINT_KEY, read by the driver and then removed from its
     environment (`hold_env_key`), so that Ray's processes and other children never inherit it;
  3. this machine's key for the experiment, generated on its first save: <keys dir>/<experiment>.key
     (mode 0600; <keys dir> is $REFLOW_KEYS_DIR, else <Prefect home>/reflow-keys).
The key is the text itself (at least 32 characters), so a key file's content works as
REFLOW_CHECKPOINT_KEY on another machine. Its id (a hash of it, safe to print) is stored in SIGNATURE,
so a run resumed with another key is told which key it needs.

Why a generated key by default, rather than unsigned checkpoints behind an opt-in: signing is on for
every run with nothing to set up, and resume keeps working wherever the run was saved. Resuming on
another machine fails with the missing key id and how to provide it (1., 2., or copy the file), never
by loading unsigned pickles. Verifying accepts the configured key and every key file in the keys dir
(each one a secret this machine made), so resuming another experiment's checkpoint, or switching to
REFLOW_CHECKPOINT_KEY later, keeps working.

Because one key verifies many experiments' checkpoints, a key proves who saved a checkpoint, not
where it belongs: the signed MANIFEST.json names the experiment and step, and infra/store/checkpoint.py
accepts a signature only in that experiment's checkpoints/iter_<step> folder (issue 51). Another
experiment's checkpoint is resumed by its own URL, never as a copy in this one's checkpoints/.
"""
from __future__ import annotations

import hashlib
import logging
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

log = logging.getLogger("reflow.checkpoint")
KEY_ENV = "REFLOW_CHECKPOINT_KEY"
KEYS_DIR_ENV = "REFLOW_KEYS_DIR"
MIN_KEY_CHARS = 32
NEW_KEY_HINT = "python -c 'import secrets; print(secrets.token_hex(32))'"


class SigningKeyError(RuntimeError):
    """A configured signing key cannot be used (missing Secret block, too short, unsafe key file)."""


def key_id(key: bytes) -> str:
    """A short public name for a key (a hash of it: naming the key does not reveal it)."""
    return hashlib.sha256(b"reflow checkpoint key id\0" + key).hexdigest()[:16]


def keys_dir() -> Path:
    """Where this machine keeps generated keys: $REFLOW_KEYS_DIR, else <Prefect home>/reflow-keys."""
    if os.environ.get(KEYS_DIR_ENV):
        return Path(os.environ[KEYS_DIR_ENV]).expanduser()
    home = os.environ.get("PREFECT_HOME")
    if not home:
        from prefect.settings import get_current_settings

        home = str(get_current_settings().home)
    return Path(home).expanduser() / "reflow-keys"


def _usable(text: str, source: str) -> bytes:
    key = text.strip()
    if len(key) < MIN_KEY_CHARS:
        raise SigningKeyError(f"the checkpoint signing key from {source} has {len(key)} characters; use at least "
                              f"{MIN_KEY_CHARS} random ones, e.g. the output of `{NEW_KEY_HINT}`")
    return key.encode()


def _read_key_file(path: Path) -> bytes:
    if path.stat().st_mode & 0o077:
        raise SigningKeyError(f"checkpoint signing key file {path} can be read or written by other users; "
                              f"run `chmod 600 {path}`")
    return _usable(path.read_text(), str(path))


def _generated_key(directory: Path, experiment: str) -> bytes:
    """This machine's key for `experiment`, created on first use. Written to a private temp file, then
    hard-linked into place: a concurrent first save keeps whichever key landed first, never half a file."""
    path = directory / f"{experiment}.key"
    if not path.exists():
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = directory / f".{experiment}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(secrets.token_hex(32) + "\n")
        try:
            os.link(tmp, path)
            # Information, not a warning: a new experiment gets its key this way by design (the CLI's summary
            # says where it is too).
            log.info("checkpoint signing: experiment %s's checkpoints are signed with a new key (id %s) kept in %s, "
                     "readable by you only; it proves on resume that a checkpoint was saved here. To resume on "
                     "another machine, copy the file there or set %s to its content there.",
                     experiment, key_id(_read_key_file(path)), path, KEY_ENV)
        except FileExistsError:  # deliberate: another process generated it first; use that one
            pass
        finally:
            tmp.unlink()
    return _read_key_file(path)


@dataclass(frozen=True)
class Keyring:
    """The key that signs this run's checkpoints and the keys that verify them. Built inside the task
    that needs it (tasks/checkpoint.py), never passed as a Prefect parameter; repr omits the key."""

    experiment: str
    directory: Path
    configured: bytes | None = field(default=None, repr=False)
    source: str = ""  # where `configured` came from, for messages
    trust_unsigned: bool = False

    def signing_key(self) -> tuple[str, bytes]:
        """(key id, key): the configured key, else this machine's key for the experiment (created now if new)."""
        key = self.configured if self.configured is not None else _generated_key(self.directory, self.experiment)
        return key_id(key), key

    def _local(self) -> list[Path]:
        return sorted(self.directory.glob("*.key")) if self.directory.is_dir() else []

    def find(self, kid: str) -> tuple[bytes, str] | None:
        """(key, where it is kept) of the held key with id `kid`, or None."""
        if self.configured is not None and key_id(self.configured) == kid:
            return self.configured, self.source
        for path in self._local():
            key = _read_key_file(path)
            if key_id(key) == kid:
                return key, str(path)
        return None

    def held(self) -> str:
        """The key ids held here and where they are kept (for error messages; no key material)."""
        held = [f"{key_id(self.configured)} from {self.source}"] if self.configured is not None else []
        held += [f"{key_id(_read_key_file(p))} in {p}" for p in self._local()]
        return "; ".join(held) or f"none: {KEY_ENV} is not set and {self.directory} holds no key files"


# $REFLOW_CHECKPOINT_KEY as this process found it, once `hold_env_key` took it out of the environment.
_HELD: list[str] = []


def hold_env_key() -> None:
    """Move $REFLOW_CHECKPOINT_KEY from this process's environment into this module's memory, where `keyring`
    still finds it. Called by the driver before it starts children (the CLI first thing; `ray_connect.connect`
    before Ray starts): a local Ray cluster's processes, engines and trainer ranks included, Prefect's temporary
    server and any subprocess inherit the driver's environment, and none of them needs the key (the driver
    verifies checkpoints and hands the ranks the verified digests: infra/store/checkpoint.py). Repeated calls keep
    the first key unless the variable is set again (then the new one)."""
    value = os.environ.pop(KEY_ENV, None)
    if value:
        _HELD[:] = [value]


def keyring(experiment: str, secret_block: str | None = None, trust_unsigned: bool = False) -> Keyring:
    """The keys for `experiment`: a Prefect Secret block when one is named, else $REFLOW_CHECKPOINT_KEY,
    else this machine's generated key (see the module docstring)."""
    configured, source = None, ""
    if secret_block:
        source = f"Prefect Secret block {secret_block!r} (checkpoint.signing_key_secret)"
        configured = _usable(_secret_value(secret_block, source), source)
    elif os.environ.get(KEY_ENV) or _HELD:
        source = f"${KEY_ENV}"
        configured = _usable(os.environ.get(KEY_ENV) or _HELD[0], source)
    return Keyring(experiment, keys_dir(), configured, source, trust_unsigned)


def key_location(experiment: str, secret_block: str | None = None) -> str:
    """Where the key that signs `experiment`'s checkpoints is kept, as `keyring` would choose it (for a summary: no
    key material, and nothing is loaded or created)."""
    if secret_block:
        return f"Prefect Secret block {secret_block!r}"
    if os.environ.get(KEY_ENV) or _HELD:
        return f"${KEY_ENV}"
    return str(keys_dir() / f"{experiment}.key")


def _secret_value(name: str, source: str) -> str:
    from prefect.blocks.system import Secret

    try:
        value = cast(Secret, Secret.load(name)).get()  # called from sync code: the block, not a coroutine
    except ValueError as e:  # Prefect's "Unable to find block document named ..."
        raise SigningKeyError(f"{source} could not be loaded ({str(e).splitlines()[0]}); create it, e.g. "
                              f"`Secret(value=<key>).save({name!r})` from prefect.blocks.system, or unset "
                              f"checkpoint.signing_key_secret") from None
    if not isinstance(value, str):
        raise SigningKeyError(f"{source} holds a {type(value).__name__}, not a key string")
    return value
