"""torch's collectives for data parallelism over processes: the gradients averaged over
the processes (in one all-reduce per dtype, or in buckets sent while the backward pass goes
on, as `DistributedDataParallel` does), a sum across processes that differentiates (what
BatchNormalization's synchronized moments need), the chief's variables broadcast, and every
process's rows of a batch gathered in process order. Used by the torch runtime
(`keras_accel.adapter.backends.torch`) and by `acc.loop` on torch."""

from __future__ import annotations

import keras
import numpy as np

from keras_accel.adapter.steps import REPLICATED
from keras_accel.utils import library_internals


def _dist():
    import torch.distributed as dist

    return dist


def gather_rows(outputs):
    """Every process's outputs of this batch, concatenated in process order: the global
    batch's rows in their order (each process holds a contiguous share)."""
    import torch

    dist = _dist()

    def gather(leaf):
        if not isinstance(leaf, torch.Tensor):
            return leaf
        leaf = leaf.detach().contiguous()
        parts = [torch.empty_like(leaf) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, leaf)
        return torch.cat(parts, dim=0)

    return keras.tree.map_structure(gather, outputs)


def all_reduce_sum(tensors):
    """Sums a list of tensors across processes, differentiably (the gradient of a sum is
    the sum of the gradients: what BatchNormalization's synchronized moments need). In a
    replicated step every process holds the global batch already: as they are."""
    import torch

    if REPLICATED.get():
        return list(tensors)

    # One collective for the list: flattened, summed, cut again.
    shapes = [t.shape for t in tensors]
    flat = torch.cat([t.reshape(-1) for t in tensors])
    summed = _summed()(flat)
    out, start = [], 0
    for shape in shapes:
        size = int(np.prod(shape)) if len(shape) else 1
        out.append(summed[start : start + size].reshape(shape))
        start += size
    return out


_SUMMED: list = []


def _summed():
    """`x -> sum of x over the processes`, with the sum of the gradients as its gradient
    (made once: a `torch.autograd.Function` over the public `all_reduce`; torch's own,
    `torch.distributed.nn.functional.all_reduce`, is deprecated for private functional
    collectives)."""
    if not _SUMMED:
        import torch

        class Summed(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                x = x.clone()
                _dist().all_reduce(x)
                return x

            @staticmethod
            def backward(ctx, grad):
                grad = grad.clone()
                _dist().all_reduce(grad)
                return grad

        _SUMMED.append(Summed.apply)
    return _SUMMED[0]


def averaged_apply(apply, buckets=None):
    """The optimizer's `apply` on gradients averaged over the processes: those the
    backward pass already sent (`GradientBuckets`), the others in one all-reduce per dtype
    over the flattened gradients (gradients that are None stay None: every process has the
    same ones). In a replicated step (`steps.REPLICATED`) every process's gradients are
    the global batch's already: applied as they are."""

    def averaged(grads, trainable_variables=None):
        grads = list(grads)
        if REPLICATED.get():
            if buckets is not None:
                buckets.skip()
            return apply(grads, trainable_variables)
        if buckets is not None:
            grads = buckets.averaged(grads, trainable_variables)
        return apply(
            average_gradients(grads, skip=buckets.done if buckets else ()), trainable_variables
        )

    return averaged


# Gradients sent together while the backward pass goes on: DistributedDataParallel's
# default bucket size.
BUCKET_BYTES = 25 * 1024 * 1024


class GradientBuckets:
    """The gradients' all-reduce overlapped with the backward pass, as
    `DistributedDataParallel` does it: the trainable weights in buckets of about
    `BUCKET_BYTES` (one dtype each), in the reverse of their order, roughly the order the
    backward pass produces their gradients; a bucket whose every gradient has been
    accumulated is sent at once (an asynchronous all-reduce) while the backward pass goes
    on with the layers below. The optimizer's `apply` waits for the buckets and takes the
    averages (`averaged`).

    Every process runs the same backward pass, so the buckets are sent in the same order
    everywhere (a collective's order must match). What the backward pass did not send (a
    weight without a gradient, a step that computes its gradients without `backward`, a
    gradient changed after it was sent) is averaged by `apply` itself, in bucket order.
    The hooks are the call's: `remove` takes them off."""

    def __init__(self, variables, bucket_bytes: int | None = None):
        import torch

        bucket_bytes = BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        params = [v.value for v in variables]
        params = [p for p in params if isinstance(p, torch.Tensor) and p.requires_grad]
        self.buckets: list[list] = []
        current, size = [], 0
        for param in reversed(params):
            if current and (size >= bucket_bytes or param.dtype != current[0].dtype):
                self.buckets.append(current)
                current, size = [], 0
            current.append(param)
            size += param.numel() * param.element_size()
        if current:
            self.buckets.append(current)
        self._bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.sent_early = 0  # Buckets the backward pass sent (for tests and benchmarks).
        self._reset()
        self._handles = [p.register_post_accumulate_grad_hook(self._ready) for p in params]

    def _reset(self) -> None:
        self._waiting = [len(bucket) for bucket in self.buckets]
        self._sent: list = [None] * len(self.buckets)
        self.done: set[int] = set()

    def _ready(self, param) -> None:
        index = self._bucket_of.get(id(param))
        if index is None or self._sent[index] is not None or REPLICATED.get():
            return
        self._waiting[index] -= 1
        if self._waiting[index] == 0:
            self._sent[index] = self._send(index)
            self.sent_early += 1

    def _send(self, index: int):
        import torch

        grads = [p.grad for p in self.buckets[index]]
        flat = torch.cat([g.reshape(-1) for g in grads])
        work = _dist().all_reduce(flat, async_op=True)
        return work, flat, grads, [library_internals.tensor_version(g) for g in grads]

    def averaged(self, grads: list, variables) -> list:
        """`grads` with the averages of what the backward pass sent in place; `done` then
        holds the positions taken care of."""
        world = _dist().get_world_size()
        position = {}
        if variables is not None:
            position = {id(v.value): i for i, v in enumerate(variables)}
        done = set()
        for index, sent in enumerate(self._sent):
            if sent is None:
                continue
            work, flat, sent_grads, versions = sent
            work.wait()
            places = [position.get(id(p)) for p in self.buckets[index]]
            usable = all(
                i is not None and grads[i] is g and library_internals.tensor_version(g) == v
                for i, g, v in zip(places, sent_grads, versions)
            )
            if not usable:  # Not the gradients this step applies: `apply` averages them.
                continue
            flat.div_(world)
            start = 0
            for i, g in zip(places, sent_grads):
                grads[i] = flat[start : start + g.numel()].view_as(g)
                start += g.numel()
                done.add(i)
        self._reset()
        self.done = done
        return grads

    def skip(self) -> None:
        """This step's gradients are applied as they are: nothing was sent."""
        self._reset()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def average_gradients(grads, skip=()):
    """`grads` averaged over the processes, in place of each (one all-reduce per dtype),
    but for the positions in `skip` (averaged already)."""
    import torch

    dist = _dist()
    world = dist.get_world_size()
    grads = list(grads)
    by_dtype: dict = {}
    for i, g in enumerate(grads):
        if g is not None and i not in skip:
            by_dtype.setdefault(g.dtype, []).append(i)
    for indices in by_dtype.values():
        flat = torch.cat([grads[i].reshape(-1) for i in indices])
        dist.all_reduce(flat)
        flat.div_(world)
        start = 0
        for i in indices:
            size = grads[i].numel()
            grads[i] = flat[start : start + size].view_as(grads[i])
            start += size
    return grads


def broadcast_variables(variables) -> None:
    """Assign the chief's values to `variables` in every process."""
    import torch

    dist = _dist()
    by_dtype: dict = {}
    for variable in variables:
        by_dtype.setdefault(variable.value.dtype, []).append(variable)
    for group in by_dtype.values():
        flat = torch.cat([v.value.detach().reshape(-1) for v in group])
        dist.broadcast(flat, src=0)
        start = 0
        for v in group:
            size = v.value.numel()
            v.assign(flat[start : start + size].view_as(v.value))
            start += size
