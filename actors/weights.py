"""WeightPusher: the async trainer's side of a weight sync, over Ray.

    pusher = WeightPusher(trainer, queue, "object_store" | "collective")
    timings = pusher.push()      # collective over the training ranks; rank 0 ships

- object_store: rank 0 packs each gathered bucket (minirl.transport.pack_bucket), ray.puts it
  once and every generator fetches it; the queue keeps the latest refs with the trainer's probe
  log-probs (`published`), from which new or restarted generators bootstrap, checked.
- collective: a standalone NCCL (gloo on CPU) group of rank 0 + every generator, rebuilt when the
  membership changes; each bucket is broadcast as one flat buffer per dtype.
Verified by default like the co-located sync: the trainer's probe forward does the gathering,
and each generator reports its engine's probe log-probs and whether its weights changed.
Hardware: CPU or GPUs.
"""

from __future__ import annotations

import time
import uuid

import ray

from actors import placement
from minirl.distributed import on_rank0
from minirl.weights import check_sync, probe_gap

PROBE_TEXT = "The quick brown fox jumps over the lazy dog. 0123456789 = 3+4"


class WeightPusher:
    def __init__(self, trainer, queue, transport: str = "object_store", *, verify: bool = True,
                 timeout_s: float = 600.0, tolerance: float | None = None):
        if transport not in ("object_store", "collective"):
            raise ValueError(f"transport={transport!r}: choose 'object_store' or 'collective'")
        self.trainer, self.queue, self.transport, self.timeout = trainer, queue, transport, timeout_s
        self.tolerance = tolerance            # the probe gap a sync may show (None: check_sync's default)
        self.rank0 = trainer.rank.rank == 0
        self.probe = None
        if verify:
            from transformers import AutoTokenizer
            self.probe = AutoTokenizer.from_pretrained(trainer.path).encode(PROBE_TEXT)
        self._fps: dict[int, object] = {}        # version -> trainer checksum of those weights
        self._seen: set[str] | None = None       # the weights the generators' checksums see (None: all)
        if verify:
            self._fps[trainer.policy_version], _ = trainer.gather(lambda b: None, dtype=trainer.compute_dtype,
                                                                  probe_ids=self.probe)
        self._group, self._members, self._prefix, self.published = None, (), None, None

    def push(self) -> dict:
        tr, t = self.trainer, {}
        version = tr.publish()
        workers = lambda: placement.call(self.queue.workers, timeout_s=self.timeout, what="rollout queue")  # noqa: E731
        sent = [0]

        def count(bucket):
            sent[0] += sum(x.numel() * x.element_size() for _, x in bucket)
        if self.transport == "object_store":
            refs = []
            ship = (lambda b: (count(b), refs.append(ray.put(_pack(b))))) if self.rank0 else (lambda b: None)
            fp, lp = tr.gather(ship, dtype=tr.compute_dtype, probe_ids=self.probe, names=self._seen)
            if self.rank0:                      # kept alive: restarted generators fetch and check them
                self.published = {"refs": refs, "probe_ids": self.probe, "dtype": tr.compute_dtype,
                                  "tolerance": self.tolerance, "logprobs": None if lp is None else lp.tolist()}
                placement.call(self.queue.set_version, version, self.published, timeout_s=self.timeout,
                               what="rollout queue")      # then who to tell: one registering later reads it
                acks = {w: h.load_from_store.remote(version, refs, self.probe) for w, h in workers().items()}
        else:
            acks, send = on_rank0(lambda: self._broadcast_to(workers(), version, t), tr.rank,   # raised on
                                  "start the broadcast", share=False) or ({}, None)        # every rank
            fp, lp = tr.gather((lambda b: (count(b), send(b))) if send else (lambda b: None),
                               dtype=tr.compute_dtype, probe_ids=self.probe, names=self._seen)
            if self.rank0:
                placement.call(self.queue.set_version, version, None, timeout_s=self.timeout, what="rollout queue")
        if not self.rank0:
            return t
        t0 = time.perf_counter()
        done, pending = ray.wait(list(acks.values()), num_returns=len(acks), timeout=self.timeout)
        if pending:
            late = [w for w, r in acks.items() if r in pending]
            raise TimeoutError(f"weight sync v{version}: generators {late} did not load within {self.timeout} s")
        loads, fp_kept = [], True
        for wid, ref in acks.items():
            try:
                ack = ray.get(ref)
            except ray.exceptions.RayActorError:
                continue          # died meanwhile: it restarts and bootstraps from the object store
            loads.append(ack["load_s"])
            if self.probe is not None:
                seen = ack.get("fingerprinted")
                if seen is not None and set(seen) != self._seen:   # a CPU engine's checksum sees fewer
                    self._seen, self._fps, fp_kept = set(seen), {}, False   # weights: checksum those from now
                before = self._fps.get(ack["from_version"]) if fp_kept else None
                stuck = before is not None and not _equal(before, fp) and not ack["changed"]
                check_sync(probe_gap(lp, ack["probe_logprobs"]), stuck, tolerance=self.tolerance,
                           engine_dtype=tr.compute_dtype, where=f"generator {wid}", version=version)
        if self.probe is not None and fp_kept:
            self._fps = {v: f for v, f in self._fps.items() if v >= version - 8} | {version: fp}
        t.update(acks_s=time.perf_counter() - t0, generators=float(len(loads)), bytes=float(sent[0]),
                 gen_load_s=max(loads, default=0.0), policy_version=float(version))
        return t

    def forget_checksums(self) -> None:
        """After a restore: the checksums kept so far belong to weights no generator will report."""
        self._fps.clear()

    def _broadcast_to(self, gens: dict, version: int, t: dict):
        """(acks, ship): generators start receiving, then ship(bucket) broadcasts each bucket."""
        from minirl.distributed import listen
        from minirl.transport import BroadcastGroup, BucketMeta
        members = tuple(sorted(gens))
        t0 = time.perf_counter()
        if self._group is None or members != self._members or any(   # (re)build: a generator joined, left, or
                i["group"] != self._prefix for i in placement.get(      # restarted (under its id: in no group)
                    [gens[w].info.remote() for w in members], self.timeout, "generators")):
            self.close()
            host, prefix, world = ray.util.get_node_ip_address(), f"wsync-{uuid.uuid4().hex[:8]}", len(members) + 1
            store = listen(host, world, self.timeout)           # bound before anyone is told its port
            joins = [gens[w].join_group.remote(host, store.port, i + 1, world, prefix, self.timeout)
                     for i, w in enumerate(members)]
            self._group = BroadcastGroup(host, store.port, 0, world, prefix=prefix, device=self.trainer.device,
                                         timeout_s=self.timeout, store=store)
            placement.get(joins, self.timeout, "generators joining the broadcast group")
            self._members, self._prefix = members, prefix
        t["group_s"] = time.perf_counter() - t0
        metas = [BucketMeta.of_layout(layout) for layout in self.trainer.bucket_layout(self.trainer.compute_dtype)]
        acks = {w: gens[w].recv_broadcast.remote(version, metas, self.probe) for w in members}
        order = iter(metas)

        def ship(bucket):
            if BucketMeta.of(bucket) != next(order):
                raise RuntimeError("the trainer gathered its weights in another order than it announced "
                                   "to the generators: use transport='object_store' for this model")
            self._group.send(bucket)
        return acks, ship

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group, self._members = None, ()


def _pack(bucket):
    from minirl.transport import pack_bucket
    return pack_bucket(bucket)


def _equal(a, b) -> bool:
    return bool((a == b).all())
