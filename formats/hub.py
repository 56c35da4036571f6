"""Models named as users name them: a Hugging Face id (``org/name``, ``org/name@revision``) or a path.

A path that exists is always a path, so ``bundled/tiny`` stays local. Anything else shaped like an
id is a repository in the local Hugging Face cache (``HF_HUB_CACHE``, ``HF_HOME``), downloaded
into it first when online; offline (``HF_HUB_OFFLINE=1``, or no network) only the cache is read.
Every way this can fail (a repository missing, gated or private, a revision unknown, no network,
no cache entry) is one line naming the id, never a traceback. This is the one place ids become
folders: every command that takes a model, and a recipe's ``model:`` and ``reference:``, comes here.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from core.errors import InputError

# the files a model needs (config, weights, tokenizer, chat template): not a repository's other
# copies of the weights (.bin, .pth, .gguf, .onnx), which can be many times the model's size
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
CONFIG = "config.json"

_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[^\s@]+))?")
_CACHED = "models--"  # huggingface_hub's cache folder of a model repository: models--org--name


@dataclass(frozen=True)
class HubId:
    """A model repository on the Hugging Face Hub, at a revision (None: its main branch)."""

    repo: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo + (f"@{self.revision}" if self.revision else "")


def parse_hub_id(text: str) -> HubId | None:
    """``text`` as an id if it is shaped like one (``org/name``, ``org/name@revision``), else None;
    whether a path of that name exists is the caller's question (see ``hub_id``)."""
    match = _ID.fullmatch(text)
    if match is None or any(bad in match["repo"] for bad in ("--", "..")) or match["repo"].endswith((".", "-")):
        return None
    return HubId(match["repo"], match["revision"])


def hub_id(name: str | os.PathLike) -> HubId | None:
    """The id ``name`` stands for; None when it is a path: one that exists, or one not shaped as an id."""
    return None if Path(name).exists() else parse_hub_id(str(name))


def local_model(name: str | os.PathLike, config_only: bool = False) -> Path:
    """Where the model ``name`` is on disk: ``name`` itself when it is a path, else the cache's
    folder of the id's snapshot, fetched first when online (with ``config_only``, only its
    config.json: all a memory estimate reads)."""
    ident = hub_id(name)
    if ident is None:
        return Path(name)
    from huggingface_hub import constants, hf_hub_download, snapshot_download
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, HfHubHTTPError, HFValidationError,
                                        LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError)

    offline = constants.HF_HUB_OFFLINE  # read per call: huggingface_hub reads the variable once, at import
    cache = constants.HF_HUB_CACHE
    try:
        if config_only:
            return Path(hf_hub_download(ident.repo, CONFIG, revision=ident.revision, local_files_only=offline)).parent
        return Path(snapshot_download(ident.repo, revision=ident.revision, allow_patterns=MODEL_FILES,
                                      local_files_only=offline))
    except LocalEntryNotFoundError:
        why = "offline (HF_HUB_OFFLINE=1), nothing is downloaded" if offline else "the Hugging Face Hub cannot be reached"
        raise InputError(f"{ident}: no such file or folder, and not in the Hugging Face cache at {cache}; {why}") from None
    except GatedRepoError:
        raise InputError(f"{ident}: a gated repository; accept its terms at https://huggingface.co/{ident.repo} "
                         "and log in (hf auth login, or HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise InputError(f"{ident}: no such file or folder, nor a repository on the Hugging Face Hub (a private "
                         "one needs a login: hf auth login, or HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise InputError(f"{ident}: the repository has no revision '{ident.revision}'") from None
    except EntryNotFoundError:
        raise InputError(f"{ident}: the repository has no {CONFIG}") from None
    except HFValidationError as e:
        raise InputError(f"{ident}: not a valid Hugging Face id ({str(e).splitlines()[0]})") from None
    except HfHubHTTPError as e:
        raise InputError(f"{ident}: the Hugging Face Hub refused ({str(e).splitlines()[0]})") from None
    except OSError as e:
        raise InputError(f"{ident}: cannot download into the Hugging Face cache ({cache}): {e.strerror or e}") from None


def cached_repo(path: Path) -> str | None:
    """The repository id whose cached snapshot ``path`` is (``.../models--org--name/snapshots/<commit>``), else None."""
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith(_CACHED):
        return path.parent.parent.name[len(_CACHED):].replace("--", "/")
    return None


def model_name(path: Path) -> str:
    """The name a model goes by in file names and metadata: a cached repository's name rather
    than its snapshot's commit hash, else the file's or folder's own."""
    repo = cached_repo(path)
    return repo.rsplit("/", 1)[-1] if repo else path.name
