"""The rollout data contract: what generation hands to training, exactly. Pure torch + stdlib, CPU or GPU.

A `Rollout` is one completion (token ids, vLLM's sampling log-probs, reward, advantage, finish reason,
policy version), a `RolloutBatch` the G of one prompt; `collate` pads rollouts, `pack` lays them end to
end (what Trainer runs). Tests: tests/test_data.py. With P prompt and C completion tokens:

    rollout.token_ids      (1, P+C)   prompt + completion, ready for model(rollout.token_ids)
    get_logprobs(model(rollout.token_ids).logits, rollout.token_ids)
                           (1, P+C-1) entry i scores token i+1; the last C score the completion
    rollout.old_logprobs   (1, C)     vLLM's sampling log-probs: entry j matches entry P-1+j above
    rollout.mask           (1, C)     1 where the token counts (loss_mask as a tensor)
"""

from __future__ import annotations

import json
import math
import numbers
import os
from array import array
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from minirl.core import compute_advantages


@dataclass
class Rollout:
    """One sampled completion and everything training needs to score it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    sampling_logprobs: list[float]      # log p_sampler(completion token j | prefix), one per token
    reward: float
    advantage: float = 0.0
    finish_reason: str | None = None    # vLLM's: "stop" (EOS or stop string), "length", "abort"
    policy_version: int = 0             # number of weight syncs the generating engine had received
    loss_mask: list[int] | None = None  # 1 per completion token that counts; None: all of them
    prompt: str | None = None
    completion: str | None = None
    uid: Any = None                     # the prompt this completion answers (a dataset index, say)
    device: str = "cpu"
    info: dict = field(default_factory=dict)

    def __post_init__(self):
        C = len(self.completion_ids)
        for what, n in (("sampling log-probs", len(self.sampling_logprobs)),
                        ("loss_mask entries", C if self.loss_mask is None else len(self.loss_mask))):
            if n != C:
                raise ValueError(f"{n} {what} for {C} completion tokens (uid={self.uid!r})")
        if self.loss_mask is not None and not set(self.loss_mask) <= {0, 1}:
            raise ValueError(f"loss_mask entries must be 0 or 1, got {set(self.loss_mask) - {0, 1}} "
                             f"(uid={self.uid!r}): pack() counts any nonzero entry as 1, collate() as its value")
        if not self.prompt_ids:
            raise ValueError(f"empty prompt (uid={self.uid!r}): a causal LM needs >= 1 prompt token")
        if not all(map(math.isfinite, [self.reward, self.advantage, *self.sampling_logprobs])):
            raise ValueError(f"reward {self.reward}, advantage {self.advantage} or a sampling log-prob is "
                             f"NaN or inf (uid={self.uid!r}): a non-finite value would make the loss, then "
                             "every weight, NaN; map failed rewards to a number and keep vLLM's log-probs")

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def token_ids(self) -> torch.Tensor:
        """(1, P+C) int64 on `device`: prompt then completion, for model(token_ids)."""
        return torch.tensor([self.prompt_ids + self.completion_ids], device=self.device)

    @property
    def old_logprobs(self) -> torch.Tensor:
        """(1, C) float32 on `device`: the sampling log-probs of the completion tokens."""
        return torch.tensor([self.sampling_logprobs], dtype=torch.float32, device=self.device)

    @property
    def mask(self) -> torch.Tensor:
        """(1, C) float32 on `device`: loss_mask as a tensor (ones when loss_mask is None)."""
        m = self.loss_mask if self.loss_mask is not None else [1] * len(self.completion_ids)
        return torch.tensor([m], dtype=torch.float32, device=self.device)

    def as_padding(self) -> "Rollout":
        """A copy that counts for nothing (loss_mask all 0), so data-parallel ranks run equal passes."""
        return replace(self, loss_mask=[0] * len(self.completion_ids), info={**self.info, "padding": True})

    def to(self, device) -> "Rollout":
        """Set the device its tensors are built on; returns self."""
        self.device = str(device)
        return self


@dataclass
class RolloutBatch:
    """The completions of one prompt (a GRPO group)."""

    rollouts: list[Rollout]
    uid: Any = None

    def __len__(self):
        return len(self.rollouts)

    def __iter__(self):
        return iter(self.rollouts)

    def __getitem__(self, i):
        return self.rollouts[i]

    @property
    def num_tokens(self) -> int:       # split_by_tokens balances RolloutBatches by it too
        return sum(r.num_tokens for r in self.rollouts)

    @property
    def rewards(self) -> list[float]:
        return [r.reward for r in self.rollouts]

    @property
    def policy_version(self) -> int:
        """The oldest policy version among the completions."""
        return min(r.policy_version for r in self.rollouts)

    def compute_advantages(self, *, normalize_std: bool = False, eps: float = 1e-6) -> "RolloutBatch":
        """Set each advantage to reward - group mean (GRPO), / group std if normalize_std. Returns self."""
        adv = compute_advantages(self.rewards, len(self.rollouts), normalize_std=normalize_std, eps=eps)
        for r, a in zip(self.rollouts, adv.tolist()):
            r.advantage = a
        return self


# -------------------------------------------------------------------------------- from vLLM outputs
def _check_reward(value, prompt, completion, source: str = "reward_fn") -> float:
    value = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{source} returned {value!r} ({type(value).__name__}) for prompt {prompt!r}, "
                        f"completion {completion!r}: it must return a finite float")
    if not math.isfinite(float(value)):
        raise ValueError(f"{source} returned {value} for prompt {prompt!r}, completion "
                         f"{completion!r}: rewards must be finite (map failures to a number, e.g. 0.0)")
    return float(value)


def check_per_prompt(n: int, **seqs: Sequence | None) -> None:
    """ValueError unless each sequence given (metadata, uids...) has one entry per prompt."""
    for name, seq in seqs.items():
        if seq is not None and len(seq) != n:
            raise ValueError(f"{len(seq)} {name} entries for {n} prompts: give one per prompt")


def _group_by_prompt(outputs: list, group_size: int) -> list[list]:
    """[(output, completion)] groups: each n=group_size output alone, or n=1 outputs of the same prompt
    (in any order) in runs of group_size; a group never mixes prompts and never falls short."""
    counts = {len(o.outputs) for o in outputs}
    if counts - {group_size} and counts - {1}:
        raise ValueError(f"outputs with {sorted(counts)} completions each do not form groups of "
                         f"{group_size}: use SamplingParams(n={group_size}), or n=1 with each prompt "
                         f"{group_size} times")
    if counts <= {group_size}:
        return [[(o, c) for c in o.outputs] for o in outputs]
    by_prompt: dict = {}
    for i, o in enumerate(outputs):
        by_prompt.setdefault((o.prompt, tuple(o.prompt_token_ids or ())), []).append(i)
    for (prompt, _), idx in by_prompt.items():
        if len(idx) % group_size:
            raise ValueError(f"prompt {prompt!r} has {len(idx)} n=1 completions, not a multiple of "
                             f"group_size={group_size}: generate each prompt exactly {group_size} times "
                             f"(or SamplingParams(n={group_size})); groups never mix prompts")
    runs = sorted(idx[i:i + group_size] for idx in by_prompt.values() for i in range(0, len(idx), group_size))
    return [[(outputs[i], outputs[i].outputs[0]) for i in run] for run in runs]   # by first output


def parse_vllm_outputs(outputs: Sequence, group_size: int, reward_fn: Callable, *,
                       metadata: Sequence | None = None, uids: Sequence | None = None,
                       policy_version: int = 0, device="cpu", tokenizer=None) -> list[RolloutBatch]:
    """vLLM `RequestOutput`s (n=group_size per prompt, or each prompt group_size times with n=1;
    logprobs=0) -> one RolloutBatch per group, ordered by each group's first output. reward_fn(prompt,
    completion[, metadata[i]]) is called once per completion, in order, and must return a finite real
    (not a bool); what it raises is re-raised naming the prompt. uids: one per group (default: its
    index). policy_version: the weights' version that generated them (WeightManager.policy_version);
    device: where the Rollouts' tensors are made. `tokenizer` decodes detokenize=False completions."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1 (completions per prompt), got {group_size!r}")
    if not callable(reward_fn):
        raise TypeError(f"reward_fn must be callable as reward_fn(prompt, completion[, metadata]), "
                        f"got {type(reward_fn).__name__}")
    if isinstance(outputs, (str, bytes, dict)):
        raise TypeError(f"parse_vllm_outputs takes the list llm.generate(...) returns, got a "
                        f"{type(outputs).__name__}")
    outputs = list(outputs)
    for o in outputs:
        if not all(hasattr(o, a) for a in ("outputs", "prompt", "prompt_token_ids")):
            raise TypeError(f"parse_vllm_outputs takes vLLM RequestOutputs (what llm.generate returns), got "
                            f"{type(o).__name__} {o!r:.80}")
    groups = _group_by_prompt(outputs, group_size)
    pairs = [pair for group in groups for pair in group]      # decoded below in this order
    check_per_prompt(len(groups), metadata=metadata, uids=uids)
    version, dev = int(policy_version), str(device)
    untexted = [list(c.token_ids) for _, c in pairs if not c.text and c.token_ids]   # detokenize=False
    texts = iter(tokenizer.batch_decode(untexted, skip_special_tokens=True)
                 if tokenizer is not None and untexted else ())
    batches = []
    for gi, group in enumerate(groups):
        uid = gi if uids is None else uids[gi]
        rollouts = []
        for out, comp in group:
            if comp.logprobs is None:
                raise ValueError(f"no sampling log-probs for prompt {out.prompt!r} (uid={uid!r}): "
                                 "generate with SamplingParams(..., logprobs=0)")
            lps = [comp.logprobs[i][t].logprob for i, t in enumerate(comp.token_ids)]  # {id: Logprob}
            text = comp.text if comp.text or not comp.token_ids or tokenizer is None else next(texts)
            args = (out.prompt, text) if metadata is None else (out.prompt, text, metadata[gi])
            try:
                value = reward_fn(*args)
            except Exception as e:
                raise RuntimeError(f"reward_fn raised {type(e).__name__}: {e} on prompt {out.prompt!r}, "
                                   f"completion {text!r} (uid={uid!r})") from e
            rollouts.append(Rollout(
                prompt_ids=list(out.prompt_token_ids), completion_ids=list(comp.token_ids),
                sampling_logprobs=lps, reward=_check_reward(value, out.prompt, text),
                finish_reason=comp.finish_reason, policy_version=version, prompt=out.prompt,
                completion=text, uid=uid, device=dev))
        batches.append(RolloutBatch(rollouts, uid=uid))
    return batches


# ----------------------------------------------------------------------------- training tensors
class _Tensors:
    def to(self, device):
        """A copy of this batch with every tensor field on `device`."""
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})


@dataclass
class TrainBatch(_Tensors):
    """Rollouts right-padded; (B, T-1) fields align with get_logprobs(model(input_ids).logits, input_ids)."""

    input_ids: torch.Tensor        # (B, T) int64
    attention_mask: torch.Tensor   # (B, T) int64, 1 on real tokens
    old_logprobs: torch.Tensor     # (B, T-1) fp32, sampling log-probs at completion positions
    loss_mask: torch.Tensor        # (B, T-1) fp32, 1 where a completion token counts
    advantages: torch.Tensor       # (B,) fp32
    num_tokens: int                # counted (loss_mask) tokens


def _rollouts(rollouts: Iterable, where: str) -> list[Rollout]:
    """rollouts as a list, refusing anything else (a RolloutBatch inside: flatten the groups first)."""
    rollouts = list(rollouts)
    if bad := next((r for r in rollouts if not isinstance(r, Rollout)), None):
        raise TypeError(f"{where}() takes Rollouts, got a {type(bad).__name__}: pass "
                        "[r for batch in batches for r in batch] to flatten RolloutBatches")
    return rollouts


def collate(rollouts: Iterable[Rollout], *, pad_token_id: int = 0, device=None) -> TrainBatch:
    """Right-pad rollouts into one TrainBatch on `device` (default: the first rollout's)."""
    rollouts = _rollouts(rollouts, "collate")
    if not rollouts:
        raise ValueError("collate() got no rollouts")
    B, T = len(rollouts), max(r.num_tokens for r in rollouts)
    ids = torch.full((B, T), pad_token_id, dtype=torch.long)
    att = torch.zeros(B, T, dtype=torch.long)
    old, mask = torch.zeros(B, T - 1), torch.zeros(B, T - 1)    # log-prob-shaped: entry P-1 scores token P
    for i, r in enumerate(rollouts):
        P, C = len(r.prompt_ids), len(r.completion_ids)
        ids[i, :P + C] = torch.tensor(r.prompt_ids + r.completion_ids)
        att[i, :P + C] = 1
        old[i, P - 1:P - 1 + C] = torch.tensor(r.sampling_logprobs)
        mask[i, P - 1:P - 1 + C] = 1 if r.loss_mask is None else torch.tensor(r.loss_mask, dtype=mask.dtype)
    return TrainBatch(ids, att, old, mask, torch.tensor([r.advantage for r in rollouts], dtype=torch.float32),
                      int(mask.sum())).to(device if device is not None else rollouts[0].device)


@dataclass
class PackedBatch(_Tensors):
    """Whole rollouts end to end in one unpadded row (what Trainer runs); positions restart per rollout
    and `cu_seqlens` marks each start. Per-token fields hold one entry per scored token (loss_mask 1,
    row order): the logits at row position scored[i] score targets[i]."""

    input_ids: torch.Tensor        # (1, L) int64
    position_ids: torch.Tensor     # (1, L) int64, 0.. for each rollout
    cu_seqlens: torch.Tensor       # (S+1,) int32, where rollout s starts and ends in the row
    max_seqlen: int
    scored: torch.Tensor           # (n,) int64 row positions whose logits score a token
    targets: torch.Tensor          # (n,) int64, = input_ids[0, scored + 1]
    old_logprobs: torch.Tensor     # (n,) fp32 sampling log-probs of the targets
    advantages: torch.Tensor       # (n,) fp32, each token its rollout's advantage
    seq_index: torch.Tensor        # (n,) int64, which rollout (0..S-1) each token belongs to
    rollouts: list
    ref_logprobs: torch.Tensor | None = None   # (n,) fp32, the reference policy's (Trainer sets it)
    entropy: torch.Tensor | None = None        # (n,) fp32, of each target's distribution (Trainer sets it)
    temperature: float = 1.0                   # what the logits are divided by for the log-probs (Trainer sets it)

    @property
    def num_tokens(self) -> int:
        return int(self.scored.numel())


def split_by_tokens(rollouts: Sequence[Rollout], parts: int, *, max_tokens: int | None = None
                    ) -> list[list[Rollout]]:
    """Greedy longest-first split into `parts` lists of about equal token counts (each rollout to the lightest
    part; with max_tokens, to the first with room, else a new one). Deterministic; input order kept."""
    if max_tokens is None and parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    bins: list[list[int]] = [[] for _ in range(parts)]
    load = [0] * parts
    for i in sorted(range(len(rollouts)), key=lambda i: -rollouts[i].num_tokens):      # longest first
        n = rollouts[i].num_tokens
        b = (load.index(min(load)) if max_tokens is None
             else next((k for k, l in enumerate(load) if l + n <= max_tokens), len(load)))
        if b == len(bins):                        # with max_tokens: no part has room, open one
            bins.append([])
            load.append(0)
        bins[b].append(i)
        load[b] += n
    return [[rollouts[i] for i in sorted(b)] for b in bins if b or max_tokens is None]


def pack(rollouts: Sequence[Rollout], max_tokens: int) -> list[PackedBatch]:
    """Pack rollouts into rows of at most max_tokens tokens (first-fit decreasing; a rollout
    longer than max_tokens gets a row of its own). Tensors are built on the rollouts' device."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    out = []
    for row in split_by_tokens(_rollouts(rollouts, "pack"), 0, max_tokens=max_tokens):
        ids, pos, cu, scored, targets, old, adv, seq = (array("q"), array("q"), array("i", [0]), array("q"),
                                                         array("q"), array("f"), array("f"), array("q"))
        for s, r in enumerate(row):
            P, C, o = len(r.prompt_ids), len(r.completion_ids), cu[-1]
            ids += array("q", r.prompt_ids + r.completion_ids)
            pos += array("q", range(P + C))
            cu.append(o + P + C)
            if r.loss_mask is None:                        # logits at P-1+j score completion token j
                scored += array("q", range(o + P - 1, o + P - 1 + C))
                targets += array("q", r.completion_ids)
                old += array("f", r.sampling_logprobs)
            else:
                js = [j for j, m in enumerate(r.loss_mask) if m]
                scored += array("q", (o + P - 1 + j for j in js))
                targets += array("q", (r.completion_ids[j] for j in js))
                old += array("f", (r.sampling_logprobs[j] for j in js))
            n = len(scored) - len(adv)
            adv += array("f", [r.advantage]) * n
            seq += array("q", [s]) * n
        out.append(PackedBatch(
            _tensor(ids).view(1, -1), _tensor(pos).view(1, -1), _tensor(cu),
            max(b - a for a, b in zip(cu, cu[1:])), _tensor(scored), _tensor(targets), _tensor(old),
            _tensor(adv), _tensor(seq), list(row)).to(row[0].device))
    return out


def _tensor(a: array) -> torch.Tensor:
    """A CPU tensor over an array's buffer (no per-element conversion, as torch.tensor(list) does)."""
    dtype = {"q": torch.int64, "i": torch.int32, "f": torch.float32}[a.typecode]
    return torch.frombuffer(a, dtype=dtype) if len(a) else torch.empty(0, dtype=dtype)


# ------------------------------------- save / load (JSON lines: one rollout a line, exact floats)
def save_rollouts(path: str | os.PathLike, batches: Iterable[RolloutBatch]) -> Path:
    """Write batches to a JSONL file (atomically: a temp file renamed into place)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            for bi, batch in enumerate(batches):
                if not isinstance(batch, RolloutBatch):
                    raise TypeError(f"save_rollouts takes RolloutBatches, got {type(batch).__name__} at {bi}")
                for r in batch:
                    d = {k: v for k, v in asdict(r).items() if k != "device"}
                    line = {"batch": bi, "batch_uid": batch.uid, "batch_size": len(batch), **d}
                    f.write(json.dumps(line) + "\n")
    except BaseException:            # nothing half-written left beside the file
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    return path


def _key(v):
    """A uid as it was saved: JSON writes a tuple as a list, and a uid is hashable (never a list)."""
    return tuple(_key(x) for x in v) if isinstance(v, list) else v


def load_rollouts(path: str | os.PathLike, *, device=None) -> list[RolloutBatch]:
    """Read batches written by save_rollouts; floats round-trip exactly. A batch with fewer rollouts
    than were saved (a file cut short) raises ValueError rather than returning a short group."""
    batches: dict[int, RolloutBatch] = {}
    sizes: dict[int, int] = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                d = json.loads(line)
                bi, uid, sizes[bi] = d.pop("batch"), _key(d.pop("batch_uid")), d.pop("batch_size", None)
                r = Rollout(**d | {"uid": _key(d.get("uid"))}, device=str(device or "cpu"))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{n}: not a rollout written by save_rollouts ({e})") from e
            batches.setdefault(bi, RolloutBatch([], uid=uid)).rollouts.append(r)
    for bi, b in batches.items():
        if len(b) != (sizes[bi] or len(b)):
            raise ValueError(f"{path}: batch {bi} (uid={b.uid!r}) has {len(b)} of its {sizes[bi]} rollouts: "
                             "the file was cut short or edited; re-save it or drop that batch")
    return [batches[k] for k in sorted(batches)]
