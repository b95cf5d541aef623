"""torch: what each process computes over the global batch's rows, so that several processes
equal one process on the global batch where a per-process computation would not.

Each process of a torch run holds a contiguous share of every static global batch (process
r the rows `[r * n, (r + 1) * n)` of `P * n`). Two things are not exact from a share alone:

- **a metric's state that is not a sum.** Keras's own metrics keep sums (and counts), which
  the processes' states add up to (`reduced_values` in the torch backend). A user's metric may
  keep a running maximum, or a value that no reduction of the processes' states gives. Its
  `update_state` is given the global batch instead (`GatheredMetrics`): every process gathers
  the update's inputs (targets, predictions, weights, padding weights included) from every
  process, in process order, and updates its copy of the metric exactly as one process would;
  its variables are then already global and are read as they are. Cost: one all-gather per
  input tensor per step (tensors passed to several such metrics are gathered once), and each
  process computes the update on the whole batch.
- **per-row random draws.** A Dropout layer draws its mask with the shape of its input: from
  the same seed, every process would draw the mask of the global batch's first rows
  (process 1's mask would be process 0's). During training each such layer
  (`global_rows.RANDOM_ROW_LAYERS`) runs on a global-batch-shaped input instead, this
  process's rows at its offset and zeros elsewhere, and keeps its own rows of the output
  (`GlobalRowDraws`): every process draws the global batch's mask, as one process does, and
  the seed generator advances once per call, as in one process. Cost: P times that layer's
  elementwise work and memory (see docs/accelerator.md, "torch"). A padded batch draws for
  its real rows only (`GlobalRowDraws.real_rows`), as plain Keras draws for its shorter last
  batch; this holds in one process too.
"""

from __future__ import annotations

from collections.abc import Callable

import keras

from keras_accel.adapter.backends.global_rows import UserMetricPatches, install_row_draws


def _dist():
    import torch.distributed as dist

    return dist


class GatheredMetrics(UserMetricPatches):
    """Users' metrics updated on the global batch in every process, for one call.

    `local` holds the ids of their variables: global already, so read as they are (the
    reduction of the others' leaves them alone). `when()` says where every process updates
    together (inside a step), where the gather meets the other processes; elsewhere (a
    callback of the chief's) an update stays this process's own.
    """

    def __init__(self, when: Callable[[], bool] = lambda: True):
        super().__init__()
        self.when = when
        self.local: set[int] = set()
        self._gather = RowGather()

    def patch(self, patches, metric) -> None:
        self.local.update(id(v) for v in metric.variables)
        patches.set(metric, "update_state", self._gathered(metric, metric.update_state))

    def _gathered(self, metric, original):
        def update_state(*args, **kwargs):
            from keras_accel.adapter.steps import REPLICATED

            # A replicated step's rows are the global batch's in every process already.
            if not self.when() or REPLICATED.get():
                return original(*args, **kwargs)
            args, kwargs = self._gather.rows(metric, (args, kwargs))
            return original(*args, **kwargs)

        return update_state


class RowGather:
    """Every process's rows of each tensor, concatenated in process order (the global
    batch's rows in their order). A tensor seen again (the same predictions passed to two
    metrics) is gathered once: the last few results are kept with the tensor they came from.
    """

    KEPT = 16

    def __init__(self):
        self._kept: dict[int, tuple] = {}

    def rows(self, metric, structure):
        import torch

        leaves = [leaf for leaf in keras.tree.flatten(structure) if isinstance(leaf, torch.Tensor)]
        for leaf in leaves:
            if leaf.ndim == 0:
                raise ValueError(_scalar_message(metric, leaf))
        counts = {int(leaf.shape[0]) for leaf in leaves}
        if len(counts) > 1:
            raise ValueError(_rows_message(metric, leaves))
        return keras.tree.map_structure(
            lambda leaf: self.gather(leaf) if isinstance(leaf, torch.Tensor) else leaf, structure
        )

    def gather(self, tensor):
        import torch

        kept = self._kept.get(id(tensor))
        if kept is not None and kept[0] is tensor:
            return kept[1]
        dist = _dist()
        # gloo gathers no booleans: as bytes, and back.
        value = tensor.detach()
        value = (value.to(torch.uint8) if tensor.dtype == torch.bool else value).contiguous()
        parts = [torch.empty_like(value) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, value)
        gathered = torch.cat(parts, dim=0)
        if tensor.dtype == torch.bool:
            gathered = gathered.to(torch.bool)
        if len(self._kept) >= self.KEPT:
            self._kept.clear()
        self._kept[id(tensor)] = (tensor, gathered)
        return gathered


def _scalar_message(metric, leaf) -> str:
    return (
        f"The metric {metric.name!r} ({type(metric).__name__}) was updated with a scalar "
        f"tensor (shape {tuple(leaf.shape)}) in a torch run of several processes. A metric "
        "that is not Keras's own is updated on the global batch's rows, gathered from every "
        "process, which a value of this process's rows alone (a batch loss, a mean) cannot "
        "give. Pass per-row values (targets, predictions, weights with the batch on axis 0), "
        "or track a batch value with keras.metrics.Mean, whose sums the processes add up "
        "exactly."
    )


def _rows_message(metric, leaves) -> str:
    shapes = [tuple(leaf.shape) for leaf in leaves]
    return (
        f"The metric {metric.name!r} ({type(metric).__name__}) was updated with tensors of "
        f"different first dimensions {shapes} in a torch run of several processes. A metric "
        "that is not Keras's own is updated on the global batch, each tensor's rows gathered "
        "from every process along axis 0, so each must hold one entry per row of the batch. "
        "Pass per-row values only (constants belong in the metric's constructor)."
    )


class GlobalRowDraws:
    """During training, per-row random layers draw the global batch's numbers (see the module
    docstring), on its real rows only: installed per call on the layer instances, in one
    process too (where the global batch is the process's)."""

    def __init__(self, world: int, rank: int):
        self.world = world
        self.rank = rank
        self._counted = (None, 0)  # The step's row count, and the real rows it gave.

    def install(self, patches, model) -> int:
        """Installs on every layer of `model` that `global_rows.draws`; returns how many."""
        return install_row_draws(patches, model, self._global)

    def real_rows(self, static: int) -> int:
        """The real rows of the step's global batch of `static` rows: its first rows, the
        padding last. Plain Keras's last batch holds only these, and a draw of more rows
        takes more numbers from torch's generator (an unseeded Dropout's), shifting every
        draw after it."""
        from keras_accel.adapter.steps import ROW_COUNT

        counted = ROW_COUNT.get()  # Where the call pads: this process's share of the count.
        if counted is None:
            return static
        if self._counted[0] is not counted:  # Once per step: a host sync.
            self._counted = (counted, int(round(float(counted()) * self.world)))
        return min(static, self._counted[1])

    def _global(self, original, own: bool = False):
        """`original` (a layer's call) on the global batch's shape, this process's rows of
        its outputs kept: in training (`own` False: Keras's random layers) or at every call
        (`own`: a random layer of the user's, `_own_call`)."""
        if own:
            return self._own_call(original)
        world, rank = self.world, self.rank

        def call(inputs, training=False):
            import torch

            from keras_accel.adapter.steps import REPLICATED

            if not training or not isinstance(inputs, torch.Tensor) or REPLICATED.get():
                # A replicated step's rows are the global batch's: drawn as one process.
                return original(inputs, training=training)
            rows = inputs.shape[0]
            real = self.real_rows(world * rows)
            if world == 1 and real == rows:
                return original(inputs, training=training)
            # Zeros where the other processes' rows are: the draw depends on the shape
            # and the memory layout only, and the zeros' outputs are dropped.
            whole = inputs if world == 1 else _global_batch(inputs, world, rank)
            outputs = original(whole[:real], training=training)
            if real < whole.shape[0]:  # Padding rows (weight 0) pass through, undrawn,
                merged = whole.clone()  # in the input's memory layout (`_global_batch`),
                merged[:real] = outputs  # which a next random layer draws in.
                outputs = merged
            return outputs[rank * rows : (rank + 1) * rows]

        return call

    def _own_call(self, original):
        """A random layer of the user's (`global_rows.draws_of_its_own`): its inputs, any
        structure of tensors sharing their rows, widened to the global batch (each process
        drawing one process's numbers), a padded batch's real rows only drawn, the padding
        rows' outputs copies of the last real row's (values a next layer handles); this
        process's rows kept."""
        world, rank = self.world, self.rank

        def call(inputs, *args, **kwargs):
            import torch

            from keras_accel.adapter.steps import REPLICATED

            leaves = keras.tree.flatten(inputs)
            if (
                REPLICATED.get()
                or not leaves
                or not all(isinstance(t, torch.Tensor) and t.dim() for t in leaves)
                or len({t.shape[0] for t in leaves}) > 1  # Not rows of one batch.
            ):
                return original(inputs, *args, **kwargs)
            rows = leaves[0].shape[0]
            real = self.real_rows(world * rows)
            if world == 1 and real == rows:
                return original(inputs, *args, **kwargs)
            whole = keras.tree.map_structure(
                lambda t: t if world == 1 else _global_batch(t, world, rank), inputs
            )
            drawn = original(keras.tree.map_structure(lambda t: t[:real], whole), *args, **kwargs)

            def kept(t):
                if real < world * rows:
                    t = torch.cat([t, t[real - 1 : real].expand(world * rows - real, *t.shape[1:])])
                return t[rank * rows : (rank + 1) * rows]

            return keras.tree.map_structure(kept, drawn)

        return call


def _global_batch(inputs, world: int, rank: int):
    """`inputs` (this process's rows) at its offset in a global batch of zeros laid out in
    memory as `inputs` is: Keras's unseeded Dropout on torch is `torch.nn.functional.
    dropout`, whose mask is drawn in the input's memory order (`empty_like(input).
    bernoulli_`), so a conv's channels-first output (strides (C*L, 1, L) for (rows, L, C))
    draws another mask than a contiguous copy of it. Copied in, so the gradient reaches this
    process's rows through the layer's own backward."""
    dims = range(inputs.dim())
    order = sorted(dims, key=lambda d: (d != 0, -inputs.stride(d)))  # Rows outermost.
    rows = inputs.shape[0]
    shape = [world * rows if d == 0 else inputs.shape[d] for d in order]
    whole = inputs.new_zeros(shape).permute([order.index(d) for d in dims])
    whole[rank * rows : (rank + 1) * rows] = inputs
    return whole
