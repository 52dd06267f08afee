"""Checkpoints: the policy in Hugging Face format, and the full training state for exact resume.

    ckpt = Checkpointer("runs/x/checkpoints", keep=3)
    ckpt.save(step, model, optimizer, state={"policy_version": v, ...}, compat={...}, hf_from=path)
    state = ckpt.load(model, optimizer, compat={...})       # the latest complete checkpoint

A checkpoint (runs/x/checkpoints/step_00000012/) holds dcp/ (model + optimizer), rng_rank<r>.json,
state.json (step, the caller's JSON state, compat), objects.pt (the caller's other objects),
optionally hf/ (the policy), and MANIFEST.json (every file's size and sha256), written last; the
README's "Checkpoints" section says what is checked. Collective: every rank calls save / load.
"""

import base64
import hashlib
import io
import json
import pickle
import os
import random
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

from minirl.data import Rollout, RolloutBatch, _key
from minirl.distributed import on_rank0
from minirl.hub import PromptItem
from minirl.weights import reshard

_SAFE_TYPES = [Rollout, RolloutBatch, PromptItem]   # what objects.pt may hold besides plain data and tensors


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete, corrupt, or does not fit the run resuming from it."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier():
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _on_rank0(call, what: str) -> None:
    """call() on rank 0 alone, then every rank goes on, or raises what it raised (disk full: the others
    waited at the next barrier until the group's timeout)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    on_rank0(call, SimpleNamespace(rank=_rank(), world_size=world), what, share=False)


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def _rng_state() -> dict:
    """Every RNG state as JSON: python's Mersenne state, numpy's keys, torch's (and CUDA's) bytes."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    s = {"python": random.getstate(), "numpy": [name, keys.tolist(), pos, has_gauss, cached],     # tuples: lists
         "torch": _b64(torch.get_rng_state())}
    if torch.cuda.is_available():
        s["cuda"] = [_b64(t) for t in torch.cuda.get_rng_state_all()]
    return s


def _set_rng_state(s: dict) -> None:
    version, internal, gauss = s["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, *rest = s["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(_unb64(s["torch"]))
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(t) for t in s["cuda"]])


def _safe_load(data: bytes):
    """torch.load(weights_only=True) allowing _SAFE_TYPES too; others raise pickle.UnpicklingError."""
    with torch.serialization.safe_globals(_SAFE_TYPES):
        return torch.load(io.BytesIO(data), weights_only=True)


def _why(e: Exception) -> str:
    """The first line of e, or the type torch's weights-only unpickler refused."""
    if m := re.search(r"Unsupported global: GLOBAL (\S+)", str(e)):
        return f"{m.group(1)} is not an allowed type"
    return str(e).splitlines()[0][:300]


def _agreed(make):
    """make() on every rank, before anything is written; CheckpointError on all of them if it raised one on
    any (a rank raising alone left the others at the next barrier until its timeout)."""
    try:
        value, error = make(), None
    except CheckpointError as e:
        value, error = None, e
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, None if error is None else str(error))
        if error is None and (first := next(((r, e) for r, e in enumerate(errors) if e), None)):
            raise CheckpointError(f"rank {first[0]}: {first[1]}")
    if error is not None:
        raise error
    return value


def _state_json(meta: dict) -> str:
    try:
        return json.dumps(meta)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"cannot checkpoint state={meta['state']!r:.200} ({e}): keep it to JSON (dicts, lists, "
                              "str, numbers, None); pass other objects as objects=...") from None


def _objects_blob(objects: dict) -> bytes:
    """objects.pt's bytes, refused now if loading would refuse them later."""
    buf = io.BytesIO()
    try:
        torch.save(objects, buf)          # a lambda, a lock: AttributeError, TypeError, PicklingError
        _safe_load(buf.getvalue())
    except Exception as e:
        allowed = ", ".join(t.__name__ for t in _SAFE_TYPES)
        raise CheckpointError(f"cannot checkpoint these objects ({_why(e)}): keep them to dicts, lists, str, "
                              f"numbers, tensors and {allowed}") from None
    return buf.getvalue()


def _digest(p: Path) -> str:
    with open(p, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _files(root: Path) -> dict[str, Path]:
    return {str(p.relative_to(root)): p for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "MANIFEST.json"}


def _manifest(root: Path) -> dict:
    return {"format": 2, "files": {k: {"size": p.stat().st_size, "sha256": _digest(p)}
                                   for k, p in _files(root).items()}}


def verify(path: str | os.PathLike) -> Path:
    """Raise CheckpointError unless `path` is a complete checkpoint whose files match its manifest."""
    path = Path(path)
    try:
        want = json.loads((path / "MANIFEST.json").read_text())
    except FileNotFoundError:
        if not path.is_dir():
            raise CheckpointError(f"no checkpoint at {path}: no such directory") from None
        if held := sorted(p.name for p in path.glob("step_*") if p.is_dir()):
            raise CheckpointError(f"{path} holds checkpoints ({', '.join(held[-3:])}), it is not one: pass one "
                                  "of them, or path=None for the latest") from None
        raise CheckpointError(f"checkpoint {path} is incomplete (no MANIFEST.json): it was interrupted "
                              "while being written; delete it, or resume from an earlier one") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"checkpoint {path}: MANIFEST.json is corrupt ({e})") from e
    if not isinstance(want, dict) or want.get("format") != 2:
        raise CheckpointError(f"checkpoint {path} has no content checksums (written by an older minirl): "
                              "it cannot be verified; resume from a newer one, or start from its hf/ export")
    want, have = want["files"], _files(path)
    missing = sorted(set(want) - set(have))
    wrong = sorted(f for f in want if f in have and have[f].stat().st_size != want[f]["size"])
    changed = sorted(f for f in want if f in have and f not in wrong and _digest(have[f]) != want[f]["sha256"])
    if missing or wrong or changed:
        raise CheckpointError(f"checkpoint {path} is corrupt: missing {missing[:3]}, wrong size {wrong[:3]}, "
                              f"checksum mismatch {changed[:3]}; delete it, or resume from an earlier one")
    return path


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The (FSDP2) model's full state dict, its master weights, on rank 0's CPU (empty on the other
    ranks). Collective."""
    reshard(model)
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=dist.is_initialized(),
                                                                cpu_offload=True))


def export_hf(model: torch.nn.Module, out_dir: str | os.PathLike, *, tokenizer_from: str) -> None:
    """Write the (FSDP2) model as a Hugging Face directory (safetensors, config, tokenizer copied from
    `tokenizer_from`) on rank 0, gathering the full state dict to rank 0's CPU only. Collective."""
    sd = full_state_dict(model)
    if _rank() != 0:
        return
    dtype = getattr(model.config, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    model.save_pretrained(out_dir, state_dict={k: v.to(dtype) for k, v in sd.items()}, safe_serialization=True)
    from transformers import AutoTokenizer
    AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(out_dir)


class Checkpointer:
    """Numbered checkpoints under `root`, the newest `keep` kept (see module docstring)."""

    def __init__(self, root: str | os.PathLike, *, keep: int = 3):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root, self.keep = Path(root), keep

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first (directories being written are ignored)."""
        return sorted(p for p in self.root.glob("step_*") if (p / "MANIFEST.json").exists())

    def latest(self) -> Path | None:
        return (self.complete() or [None])[-1]

    def save(self, step: int, model, optimizer, *, state: dict | None = None, compat: dict | None = None,
             objects: dict | None = None, hf_from=None) -> Path:
        """Collective: save everything for resume (frozen parameters excepted), and the HF policy if
        hf_from: its tokenizer's source (a path), or a callable writing the HF directory it is given."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0 (it names the checkpoint directory), got {step!r}")
        final, tmp = self.root / f"step_{step:08d}", self.root / f".tmp_step_{step:08d}"
        meta = {"step": step, "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                "state": state or {}, "compat": compat or {}}
        blob, state_json = _agreed(lambda: (_objects_blob(objects) if objects else None, _state_json(meta)))
        if final.exists():                  # every rank: one raising alone left the others at the barrier
            raise CheckpointError(f"checkpoint {final} already exists")
        _on_rank0(lambda: (shutil.rmtree(tmp, ignore_errors=True), tmp.mkdir(parents=True)), f"make {tmp}")
        reshard(model)
        trained = StateDictOptions(ignore_frozen_params=True)     # frozen weights (a LoRA base) stay out
        msd, osd = get_state_dict(model, optimizer, options=trained)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp / "dcp"))
        (tmp / f"rng_rank{_rank()}.json").write_text(json.dumps(_rng_state()))
        if callable(hf_from):               # a writer of its own (LoRA: the merged model), collective
            hf_from(tmp / "hf")
        elif hf_from is not None:
            export_hf(model, tmp / "hf", tokenizer_from=hf_from)
        _barrier()

        def seal():                         # the manifest last: a checkpoint without one is incomplete
            (tmp / "state.json").write_text(state_json)
            if blob is not None:
                (tmp / "objects.pt").write_bytes(blob)
            (tmp / "MANIFEST.json").write_text(json.dumps(_manifest(tmp)))
            os.replace(tmp, final)
            for old in self.complete()[:-self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        _on_rank0(seal, f"write {final}")
        return final

    def load(self, model, optimizer, *, path: str | os.PathLike | None = None,
             compat: dict | None = None) -> dict:
        """Restore model, optimizer and RNG states from `path` (default: the latest complete one); returns
        read_state(path). A `compat` entry (model, tokenizer, settings) unlike the saved one raises."""
        if path is None and (path := self.latest()) is None:
            raise CheckpointError(f"no complete checkpoint under {self.root}")
        state = read_state(path)                              # every file checked against the manifest, once
        saved = json.loads((Path(path) / "state.json").read_text()).get("compat", {})
        if diff := {k: (saved[k], v) for k, v in (compat or {}).items() if k in saved and saved[k] != v}:
            raise CheckpointError(f"checkpoint {path} does not fit this run: "
                                  + "; ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in diff.items()))
        reshard(model)
        trained = StateDictOptions(ignore_frozen_params=True)
        sd = dict(zip(("model", "optim"), get_state_dict(model, optimizer, options=trained)))
        dcp.load(sd, checkpoint_id=str(Path(path) / "dcp"))     # every trained tensor, or an error
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"],
                       options=StateDictOptions(ignore_frozen_params=True, strict=False))   # frozen: as loaded
        rng = Path(path) / f"rng_rank{_rank()}.json"
        if rng.exists():          # absent when resuming on more ranks than were saved
            _set_rng_state(json.loads(rng.read_text()))
        return state


def tokenizer_hash(model_dir: str) -> str | None:
    """A short hash of a model directory's tokenizer files (None for hub names)."""
    p = Path(model_dir)
    if not p.is_dir():
        return None
    h = hashlib.sha1()
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                 "tokenizer.model", "special_tokens_map.json"):
        if (p / name).exists():
            h.update(name.encode() + (p / name).read_bytes())
    return h.hexdigest()[:12]


def saved_step(path: str | os.PathLike) -> int:
    """The step a complete checkpoint holds, read from its state.json alone (no checksums: cheap)."""
    return json.loads((Path(path) / "state.json").read_text())["step"]


def read_state(path: str | os.PathLike) -> dict:
    """A checkpoint's {"step", "state", "objects", "path"} without any model (for an async generator)."""
    path = verify(path)
    meta = json.loads((path / "state.json").read_text())
    objects = path / "objects.pt"
    try:
        loaded = _safe_load(objects.read_bytes()) if objects.exists() else {}
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{objects} holds a type outside minirl's allow-list; not loaded, as loading "
                              f"it could run code from the file ({_why(e)})") from None
    return {"step": meta["step"], "state": meta["state"], "path": str(path), "objects": loaded}


def checkpointed_queue(checkpoint) -> tuple:
    """(path, trained uids, queued [(PromptItem, RolloutBatch)], failed {uid: cause}) of an async run's
    checkpoint (a directory, or a Checkpointer root: its latest), as TrainWorker.save_checkpoint wrote them."""
    path = checkpoint if (Path(checkpoint) / "state.json").exists() else Checkpointer(checkpoint).latest()
    if path is None:
        raise FileNotFoundError(f"no complete checkpoint under {checkpoint}")
    ck = read_state(path)
    queue = ck["objects"].get("queue", {})
    return ck["path"], trained_uids(ck), queue.get("buffered", []), queue.get("failed", {})


def trained_uids(ck: dict) -> list:
    """The prompt uids an async trainer trained, of read_state's dict: as they were (objects.pt), or
    from the JSON state of a checkpoint written before they moved there (a list read back as the tuple it was)."""
    if "trained_uids" in ck["objects"]:
        return list(ck["objects"]["trained_uids"])
    return [_key(u) for u in ck["state"].get("trained_uids", [])]
