"""Every private name of a library other than Keras that keras_accel touches, listed in one
place, each with its reason and a check (the companion of `keras_internals`, which holds
Keras's).

Python's standard library, torch, TensorFlow, JAX and Grain each have a few places where no
public name does what keras_accel needs. `INTERNALS` lists them; the accessors re-exported
here are the only code that reads them (tests/utils/test_keras_internals_only.py reads the
package's source to hold it to that). Each accessor is one of two kinds, and
`Internal.fallback` says which:

- **required**: without the name keras_accel cannot do the job; the accessor raises
  `LibraryInternalsError`, naming the library, its version and the name;
- **optional**: the name only saves time or noise; without it the accessor takes the
  public path it names (same numbers, the same files), never an error.

`check(library)` verifies a library's entries against the installed version (the tests run
it for every library installed), so a release that renames one fails in CI, naming the
version, before a user meets the fallback.

One module per library, each listing its internals (`INTERNALS`) beside their accessors:
`stdlib` (Python's), `pytorch`, `tensorflow_ops` (TensorFlow's own), `jax_runtime`,
`grain_datasets`; `lookup` holds `Internal`, the errors and how an entry is found.
"""

from __future__ import annotations

from keras_accel.utils.library_internals import (
    grain_datasets,
    jax_runtime,
    lookup,
    pytorch,
    stdlib,
    tensorflow_ops,
)
from keras_accel.utils.library_internals.grain_datasets import GrainBatching, grain_batching
from keras_accel.utils.library_internals.jax_runtime import jax_distributed_client
from keras_accel.utils.library_internals.lookup import (
    Internal,
    InternalsError,
    LibraryInternalsError,
)
from keras_accel.utils.library_internals.pytorch import (
    dcp_fsspec_reader,
    dcp_fsspec_writer,
    dcp_metadata_private_globals,
    dcp_save_in_one_process,
    fsdp_remove,
    module_parameters,
    tensor_version,
)
from keras_accel.utils.library_internals.stdlib import (
    current_frames,
    exit_now,
    register_before_thread_pools_shutdown,
)
from keras_accel.utils.library_internals.tensorflow_ops import (
    tf_auto_shard_dataset,
    tf_call_concrete,
    tf_compute_batch_size,
    tf_device_datasets_without_autotune,
    tf_iterator_made_when_read,
    tf_replicas_merge_to_reduce,
)

INTERNALS: list[Internal] = [
    *stdlib.INTERNALS,
    *pytorch.INTERNALS,
    *tensorflow_ops.INTERNALS,
    *jax_runtime.INTERNALS,
    *grain_datasets.INTERNALS,
]


def check(library: str) -> None:
    """Verify the module-level internals of `library` ("Python", "torch", "TensorFlow",
    "JAX"; Grain's are instance attributes, checked by `grain_batching` on a data set)
    against the installed version; raise `LibraryInternalsError` naming the first one
    missing and the version."""
    for internal in INTERNALS:
        if internal.library != library or internal.library == "Grain":
            continue
        if internal.module == "torch.Tensor":
            import torch

            if not hasattr(torch.zeros(1), internal.name):
                raise lookup.missing(internal)
            continue
        if internal.module == "torch.nn.Module()":  # An instance attribute.
            import torch

            if not hasattr(torch.nn.Module(), internal.name):
                raise lookup.missing(internal)
            continue
        lookup.find(internal)


__all__ = [
    "INTERNALS",
    "GrainBatching",
    "Internal",
    "InternalsError",
    "LibraryInternalsError",
    "check",
    "current_frames",
    "dcp_fsspec_reader",
    "dcp_metadata_private_globals",
    "fsdp_remove",
    "module_parameters",
    "dcp_fsspec_writer",
    "dcp_save_in_one_process",
    "exit_now",
    "grain_batching",
    "jax_distributed_client",
    "register_before_thread_pools_shutdown",
    "tensor_version",
    "tf_auto_shard_dataset",
    "tf_call_concrete",
    "tf_compute_batch_size",
    "tf_device_datasets_without_autotune",
    "tf_iterator_made_when_read",
    "tf_replicas_merge_to_reduce",
]
