"""Pushing a saved router folder to the Hub as one commit that leaves the repo's router files exactly the saved
ones, refused before anything is uploaded when the repo holds something that is not a TIDE router."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from huggingface_hub import CommitInfo, CommitOperationAdd, CommitOperationDelete, HfApi
from huggingface_hub.errors import RevisionNotFoundError
from huggingface_hub.utils import HFValidationError, validate_repo_id

from ..errors import TideArgumentError, TideRouterFileError
from .files import ROUTER_MODEL_TYPE, WEIGHT_FILES

DEFAULT_COMMIT_MESSAGE = "Upload TideRouter"


def check_repo_id(repo_id: object, what: str = "repo_id") -> None:
    """`repo_id` is a valid Hub repo id: said before a save or a calibration, not after it."""
    try:
        validate_repo_id(repo_id)  # type: ignore[arg-type]  # it names a non-string too
    except HFValidationError as exc:
        raise TideArgumentError(f"{what} {repo_id!r} is not a Hub repo id: {exc}") from exc


def check_repo_holds_a_router(api: HfApi, repo_id: str, revision: str, files: list[str],
                              token: bool | str | None) -> None:
    """Refuse (`TideRouterFileError`) a repo whose config.json is not a TIDE router's, or that holds weights
    without a config.json: the push would replace a model's config or weights, as a local save never does."""
    if "config.json" not in files:
        weights = sorted(f for f in files if WEIGHT_FILES.fullmatch(f))
        if weights:
            raise TideRouterFileError(f"refusing to push a TIDE router to {repo_id}: it holds weights "
                                      f"({', '.join(weights)}) but no TIDE router config.json; push to a new repo "
                                      "or one holding a TIDE router")
        return
    with tempfile.TemporaryDirectory() as cache:  # the user's HF cache is not filled with a stranger's config
        path = api.hf_hub_download(repo_id, "config.json", revision=revision, token=token, cache_dir=cache)
        try:
            model_type = json.loads(Path(path).read_text()).get("model_type")
        except (ValueError, AttributeError):
            model_type = None  # not JSON, or not a JSON object: not a router's config either
    if model_type != ROUTER_MODEL_TYPE:
        raise TideRouterFileError(f"refusing to push a TIDE router to {repo_id}: it holds something else (its "
                                  f"config.json has model_type {model_type!r}, not {ROUTER_MODEL_TYPE!r}), whose "
                                  "config the push would replace; push to a new repo or one holding a TIDE router")


def push_folder(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    commit_message: str | None = None,
    commit_description: str | None = None,
    private: bool | None = None,
    token: bool | str | None = None,
    revision: str | None = None,
    create_pr: bool = False,
) -> CommitInfo:
    """Upload the files of `folder` (a saved router) to `repo_id` as one commit that also deletes the router
    weight files the save did not write (an unsharded push's model.safetensors under a sharded one): the repo's
    router then loads as saved, never a new config with old weights. Other files of the repo stay."""
    check_repo_id(repo_id)
    api = HfApi(library_name="tide_hf")
    repo_id = api.create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
    new_branch = False
    try:  # the branch or pull request the commit goes to; a new branch starts from the default one
        info = api.repo_info(repo_id, revision=revision, token=token)
    except RevisionNotFoundError:
        if revision is None or revision.startswith("refs/pr"):
            raise
        info, new_branch = api.repo_info(repo_id, token=token), True
    remote = [s.rfilename for s in info.siblings or []]
    check_repo_holds_a_router(api, repo_id, info.sha, remote, token)
    local = sorted(p.name for p in Path(folder).iterdir() if p.is_file())
    stale = [f for f in remote if WEIGHT_FILES.fullmatch(f) and f not in local]
    operations = [CommitOperationDelete(path_in_repo=f) for f in stale]
    operations += [CommitOperationAdd(path_in_repo=f, path_or_fileobj=str(Path(folder) / f)) for f in local]
    if new_branch:
        api.create_branch(repo_id, branch=revision, revision=info.sha, token=token, exist_ok=True)
    return api.create_commit(
        repo_id,
        operations,
        commit_message=commit_message or DEFAULT_COMMIT_MESSAGE,
        commit_description=commit_description,
        token=token,
        revision=revision,
        create_pr=create_pr,
        parent_commit=info.sha,  # a push in between fails instead of being undone
    )
