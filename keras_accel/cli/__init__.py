"""The `keras-accel` command line: `env`, `bench` and `launch`.

`env` says what would run here; `bench` runs the seed sweep; `launch` starts N processes
of one script on this host, as a cluster would (JAX's and TensorFlow's workers, or torch's one
process per device)."""
